"""N data-parallel workers simulated in one process, with exactly the codec and averaging of a real run.

    sim = Simulator(model, n_workers=16, config=TernGradConfig())
    for step in range(steps):
        sim.step(x, y, loss_fn, optimizer)      # x, y: the global batch, split evenly over the workers

Each worker's gradient is computed on its slice of the global batch, then all workers' gradients go
through N ``AllgatherExchange`` instances (one per simulated rank) over an in-process ``ThreadWorld``,
driven from this one thread: every rank starts, every rank flushes its payloads, and rank 0's result
(identical on all ranks by construction) becomes the gradient.  So the ternary vectors, scalers and
decoded averages are the bytes a real N-rank Horovod run produces for the same inputs and seed (a test
checks this against 2 real ranks bit for bit).

Gradients per worker come from either
* ``grad_mode="loop"``: one ordinary backward pass per worker on its slice: bit-identical to what
  each Horovod rank computes (same ops, same order), cost N small passes per step; or
* ``grad_mode="vmap"``: per-sample gradients for the whole global batch in one pass with
  ``torch.func`` (vmap of grad), averaged per worker: the same gradients up to float rounding, and
  far cheaper at large N (this is what makes N = 64 studies take minutes on one CPU).

``compression="none"`` averages the fp32 gradients instead (the baseline).
"""
from __future__ import annotations

import torch

from .config import TernGradConfig
from .exchange import AllgatherExchange, ThreadWorld


def batch_indices(seed: int, step: int, n_examples: int, batch: int) -> torch.Tensor:
    """The global batch of a step: a fixed permutation per epoch, the same in every process."""
    per_epoch = n_examples // batch
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[k * batch:(k + 1) * batch]


def worker_slice(global_idx: torch.Tensor, rank: int, n_workers: int) -> torch.Tensor:
    """Worker ``rank``'s share of a global batch (contiguous slices, equal sizes)."""
    per = global_idx.numel() // n_workers
    return global_idx[rank * per:(rank + 1) * per]


class Simulator:
    def __init__(self, model: torch.nn.Module, n_workers: int, config: TernGradConfig | None = None,
                 compression: str = "terngrad", grad_mode: str = "loop"):
        if compression not in ("terngrad", "none"):
            raise ValueError(f"compression must be 'terngrad' or 'none', got {compression!r}")
        if grad_mode not in ("loop", "vmap"):
            raise ValueError(f"grad_mode must be 'loop' or 'vmap', got {grad_mode!r}")
        self.model = model
        self.n = n_workers
        self.config = config or TernGradConfig()
        self.compression = compression
        self.grad_mode = grad_mode
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.world = ThreadWorld(n_workers)
        self.engines = [AllgatherExchange(c, self.config) for c in self.world.ranks()]
        self.last_ternary_zero_fraction: dict[str, float] = {}

    # -- gradients per worker ---------------------------------------------------------------------
    def worker_gradients(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> list[list[torch.Tensor]]:
        """[worker][parameter] gradients of the mean loss over each worker's slice of (x, y)."""
        if x.shape[0] % self.n:
            raise ValueError(f"global batch {x.shape[0]} does not split evenly over {self.n} workers")
        per = x.shape[0] // self.n
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        if self.grad_mode == "loop":
            out = []
            for r in range(self.n):
                grads = torch.autograd.grad(loss_fn(self.model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]), params)
                out.append([g.detach() for g in grads])
            return out
        from torch.func import functional_call, grad, vmap
        named = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())

        def sample_loss(p, xi, yi):
            return loss_fn(functional_call(self.model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(named, x, y)
        stacked = [per_sample[n].reshape(self.n, per, *per_sample[n].shape[1:]).mean(dim=1) for n in self.names]
        return [[g[r] for g in stacked] for r in range(self.n)]

    # -- averaging --------------------------------------------------------------------------------
    def average(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """What every rank gets back: TernGrad's decoded average (or the fp32 mean)."""
        if self.compression == "none":
            return [torch.stack([grads[r][i] for r in range(self.n)]).mean(dim=0) for i in range(len(self.names))]
        tickets = [[eng.start(grads[r][i], name) for i, name in enumerate(self.names)]
                   for r, eng in enumerate(self.engines)]
        for eng in self.engines:
            eng.flush()
        return [self.engines[0].finish(t) for t in tickets[0]]

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn, optimizer: torch.optim.Optimizer) -> None:
        avg = self.average(self.worker_gradients(x, y, loss_fn))
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        for p, g in zip(params, avg):
            p.grad = g.to(p.dtype)
        optimizer.step()

    @property
    def stats(self):
        return self.engines[0].stats
