"""N data-parallel workers simulated in one process, with exactly the codec and exchange of a real run.

    sim = Simulator(model, n_workers=16, config=TernGradConfig())
    for step in range(steps):
        sim.step(x, y, loss_fn, optimizer)      # x, y: the global batch, split evenly over the workers

Averaging runs the real engine: N ``exchange.Engine`` instances (one per simulated rank) over one
in-process ``ThreadWorld`` that shares buffers instead of copying them, driven from this one thread: every
rank starts its tensors, every rank advances what every rank has posted until nothing moves (handshakes
into payloads, alltoalls into owners' sums), then rank 0 finishes; its result (identical on all ranks by
construction) becomes the gradient.  So every TernGradConfig works (sharded exchange, per-layer metrics)
and nothing here re-implements the exchange.  Only rank 0 decodes: a step costs N statistics passes, N
encodes and one decode, plus the engine's bookkeeping per rank and tensor.

Gradients per worker (``grad_mode=``):
* ``"loop"`` (default): one ordinary backward pass per worker on its slice: bit-identical to what each
  Horovod rank computes (same ops, same order); cost N small passes per step;
* ``"vmap"``: per-sample gradients with ``torch.func`` (vmap of grad), averaged per worker: any model,
  the same gradients up to float rounding; slower than ``"loop"`` for LeNet on CPU (it materializes
  64 per-sample copies of every gradient).

``compression="none"`` averages the fp32 gradients instead (the baseline).  Tensors that the config's
policy keeps at full precision (``min_numel``, ``exclude``) are averaged in fp32 as well, as the Horovod
frontend sends them through Horovod's own allreduce (the same bits at N = 2; at other N Horovod's ring
adds in another order, so equal up to float rounding).
"""
from __future__ import annotations

import torch

from ..config import TernGradConfig
from ..exchange import precision
from ..errors import RankMismatchError
from ..exchange import Engine, ExchangeStats, ThreadWorld
from ..exchange.hierarchical import HierarchicalEngine
from ..exchange.thread_collectives import hierarchical_collectives
from ..exchange.topology import Topology


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
                 compression: str = "terngrad", grad_mode: str = "loop", ranks_per_node: int = 1):
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
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.world = ThreadWorld(n_workers, copy=False)
        # one thread plays every rank: poll (ordered=False); simulated ranks never join
        self.engines = [Engine(c, self.config, ordered=False, joins=False) for c in self.world.ranks()]
        self.topology = Topology.contiguous(n_workers, ranks_per_node)
        if self.config.hierarchical is not False and self.topology.flat_reason() is None:
            # nodes of ranks_per_node ranks: the node-aware engine over each rank's flat one, as the
            # frontends build it (hierarchical="auto" asks the cost model per group, as they do)
            sub = hierarchical_collectives(self.topology, copy=False)
            self.engines = [HierarchicalEngine(e, *sub[r], self.topology) for r, e in enumerate(self.engines)]

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
        def mean(i):
            return torch.stack([grads[r][i] for r in range(self.n)]).mean(dim=0)
        if self.compression == "none":
            return [mean(i) for i in range(len(self.names))]
        # The policy (min_numel, exclude) keeps some tensors in fp32, as the Horovod frontend does; what
        # horovod_terngrad.optim reads is decided and recorded as the frontends do it (exchange/precision.py):
        # a refresh step of its schedule travels in fp32 too
        routes = [precision.route([p], self.config.compresses(name, grads[0][i].numel()))
                  for i, (name, p) in enumerate(zip(self.names, self.params))]
        ternary = [i for i, r in enumerate(routes) if r.ternary]
        out = [None if i in ternary else mean(i) for i in range(len(self.names))]
        for i, avg in zip(ternary, self._exchange([[grads[r][i] for i in ternary] for r in range(self.n)],
                                                  [self.names[i] for i in ternary],
                                                  [routes[i] for i in ternary])):
            out[i] = avg
        return out

    def average_tensor(self, per_rank: list[torch.Tensor], name: str) -> torch.Tensor:
        """One tensor's exchange: ``per_rank[r]`` is rank r's gradient; returns rank 0's result."""
        return self._exchange([[t] for t in per_rank], [name])[0]

    def _exchange(self, per_rank: list, names: list, routes: list | None = None) -> list:
        """Every rank's tensors through its engine; rank 0's results.  ``routes``: each tensor's
        ``precision.route``; where its optimizer asked for the ternary noise estimate (horovod_terngrad.optim),
        every rank's ticket asks for it, as the frontends' do, and rank 0's estimate is handed to the optimizer
        with the average (only rank 0 decodes)."""
        if len(per_rank) != self.n:
            raise RankMismatchError(f"TernGrad: {len(per_rank)} simulated ranks' gradients for {self.n} workers")
        routes = routes or [None] * len(names)
        tickets = []
        for eng, tensors in zip(self.engines, per_rank):
            tickets.append([eng.start(t, name, route=r) for t, name, r in zip(tensors, names, routes)])
        moved = True
        while moved:            # each stage completes once every rank has posted it
            before = [eng.pending() for eng in self.engines]
            for eng in self.engines:
                eng.progress(block=False)
            moved = [eng.pending() for eng in self.engines] != before
        try:
            outs = [self.engines[0].finish(t) for t in tickets[0]]
            for tk, out in zip(tickets[0], outs):
                precision.deliver(tk, out)
            return outs
        finally:
            for eng in self.engines[1:]:   # their results are rank 0's; end their step as a finish would
                eng.reset()

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn, optimizer: torch.optim.Optimizer) -> None:
        avg = self.average(self.worker_gradients(x, y, loss_fn))
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        for p, g in zip(params, avg):
            p.grad = g.to(p.dtype)
        optimizer.step()

    def state_dict(self) -> dict:
        """What a resumed run needs to draw the same random streams: each simulated rank's per-tensor
        step counters (the stream key's ``step``)."""
        return {"engine_steps": [dict(e.steps) for e in self.engines]}    # (hierarchical: the flat engine's dict)

    def load_state_dict(self, state: dict) -> None:
        steps = state["engine_steps"]
        if state.get("steps") and not any(steps):       # a checkpoint of the former replay: one counter set
            steps = [state["steps"]] * self.n
        if len(steps) != self.n:
            raise ValueError(f"simulator state is of {len(steps)} workers, this one has {self.n}")
        for e, s in zip(self.engines, steps):
            e.steps.clear()
            e.steps.update(s)

    @property
    def stats(self) -> ExchangeStats:
        """Rank 0's counters (what it handed to and got from the collectives)."""
        return self.engines[0].stats
