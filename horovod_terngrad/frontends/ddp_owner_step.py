"""DDP with ``OwnerStepOptimizer``: the gradients stay on their rank until the optimizer's step exchanges them.

``OwnerStepOptimizer`` (optim/owner_step.py) owns its exchange: it needs every rank's own gradient, not DDP's
average.  A model that a framework wraps in ``DistributedDataParallel`` anyway (Lightning, Accelerate, the
Trainer) registers ``local_gradients_hook``: each bucket is handed back as it is, at no cost, so DDP's
allreduce never runs and the optimizer's step sends ternary payloads instead.

    ddp_model.register_comm_hook(None, local_gradients_hook)
    opt = OwnerStepOptimizer(ddp_model.module.named_parameters(), collectives="torch", lr=...)

DDP still broadcasts the parameters at construction (every replica starts alike) and keeps its bucket views;
``no_sync`` accumulates as usual (the hook does not run inside it).
"""
import torch
import torch.distributed


def local_gradients_hook(state, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that returns each bucket's local gradients unchanged (module docstring)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


__all__ = ["local_gradients_hook"]
