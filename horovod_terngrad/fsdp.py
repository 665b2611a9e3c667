"""``horovod_terngrad.fsdp``: TernGrad as FSDP2's cross-node gradient reduction (HSDP: sharded inside a node,
ternary between nodes).

    import horovod_terngrad.fsdp as tg_fsdp
    state = tg_fsdp.register(model, mesh)     # model sharded with fully_shard(..., mesh=mesh["shard"])

The public names of the FSDP frontend (``frontends/fsdp.py``, where they are documented).  ``import
horovod_terngrad`` does not load this module; importing it, or ``horovod_terngrad.fsdp``, does.
"""
from .frontends.fsdp import TernGradFSDPState, register

__all__ = ["TernGradFSDPState", "register"]
