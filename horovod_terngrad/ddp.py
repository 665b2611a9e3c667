"""``horovod_terngrad.ddp``: TernGrad as a PyTorch ``DistributedDataParallel`` communication hook.

    import horovod_terngrad.ddp as tg_ddp           # or: from horovod_terngrad.ddp import register
    state = tg_ddp.register(ddp_model, packing="2bit")

The public names of the DDP frontend (``frontends/ddp.py``, where they are documented), importable under
the path README and docs give.  ``import horovod_terngrad`` does not load this module (nor
torch.distributed's hook machinery); importing it, or ``from horovod_terngrad import ddp``, does.
"""
from .frontends.ddp import TernGradState, find_ddp, register, terngrad_hook
from .frontends.ddp_owner_step import local_gradients_hook

__all__ = ["TernGradState", "terngrad_hook", "register", "find_ddp", "local_gradients_hook"]
