"""N data-parallel workers simulated in one process, with exactly the codec and averaging of a real run.

    sim = Simulator(model, n_workers=16, config=TernGradConfig())
    for step in range(steps):
        sim.step(x, y, loss_fn, optimizer)      # x, y: the global batch, split evenly over the workers

Averaging (``average=``):
* ``"exchange"``: all workers' gradients go through N ``AllgatherExchange`` instances (one per simulated
  rank) over an in-process ``ThreadWorld``, driven from this one thread: every rank starts, every rank
  flushes its payloads, and rank 0's result (identical on all ranks by construction) becomes the
  gradient.  Any TernGradConfig (sharded exchange, per-layer metrics) works.
* ``"direct"`` (default): the same backend calls in the same order without the collectives: each
  rank's statistics, the shared scaler as the max over ranks (what the handshake's allreduce-max
  gives), each rank's encode with its own stream key, then one decode of the N payloads, concatenated
  as an allgather would.  Bit-identical to ``"exchange"`` (tests/test_simulate.py checks it, and checks
  the default against 2 real Horovod ranks), without N copies of the gathered buffer and N·tensors
  Python-level collectives: the averaging of LeNet's gradients at N = 64 takes 48 ms instead of 83 ms
  (one CPU thread).

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

from .. import backends, codec
from ..config import NonFiniteGradientError, RankMismatchError, TernGradConfig
from ..exchange import AllgatherExchange, ThreadWorld
from ..exchange.allgather import ExchangeStats, check_gradient


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
                 compression: str = "terngrad", grad_mode: str = "loop", average: str | None = None):
        if compression not in ("terngrad", "none"):
            raise ValueError(f"compression must be 'terngrad' or 'none', got {compression!r}")
        if grad_mode not in ("loop", "vmap"):
            raise ValueError(f"grad_mode must be 'loop' or 'vmap', got {grad_mode!r}")
        self.model = model
        self.n = n_workers
        self.config = config or TernGradConfig()
        if average is None:
            average = "direct" if self.config.exchange == "allgather" else "exchange"
        if average not in ("direct", "exchange"):
            raise ValueError(f"average must be 'direct' or 'exchange', got {average!r}")
        if average == "direct" and self.config.exchange != "allgather":
            raise ValueError(f"average='direct' replays the allgather exchange; exchange="
                             f"{self.config.exchange!r} needs average='exchange'")
        self.compression = compression
        self.grad_mode = grad_mode
        self.average_mode = average
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.world = ThreadWorld(n_workers)
        self.engines = [AllgatherExchange(c, self.config) for c in self.world.ranks()]
        self._direct_stats = ExchangeStats()
        self._steps: dict[str, int] = {}

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
        # The policy (min_numel, exclude) keeps some tensors in fp32, as the Horovod frontend does.
        ternary = {i for i, name in enumerate(self.names) if self.config.compresses(name, grads[0][i].numel())}
        out = [None if i in ternary else mean(i) for i in range(len(self.names))]
        if self.average_mode == "direct":
            for i in sorted(ternary):
                out[i] = self._average_direct([grads[r][i] for r in range(self.n)], self.names[i])
            return out
        order = sorted(ternary)
        tickets = [[eng.start(grads[r][i], self.names[i]) for i in order] for r, eng in enumerate(self.engines)]
        for eng in self.engines:
            eng.flush()
        for i, t in zip(order, tickets[0]):
            out[i] = self.engines[0].finish(t)
        return out

    def _average_direct(self, per_rank: list[torch.Tensor], name: str) -> torch.Tensor:
        """AllgatherExchange's arithmetic for one tensor, all ranks at once (see module docstring)."""
        cfg, st = self.config, self._direct_stats
        for t in per_rank:
            check_gradient(t, name)
        shape, dtype = per_rank[0].shape, per_rank[0].dtype
        if any(t.shape != shape or t.dtype != dtype for t in per_rank):
            raise RankMismatchError(f"TernGrad: simulated ranks disagree on gradient '{name}'")
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        g32s = [t.detach().reshape(-1).to(torch.float32).contiguous() for t in per_rank]
        backend = backends.for_device(g32s[0].device)
        preps = [backend.prepare(g, cfg.bucket_size, cfg.clip_factor) for g in g32s]
        n = g32s[0].numel()
        st.tensors += 1
        st.elements += n
        st.collectives += 1                       # the payload allgather
        if cfg.shared_scaler:
            st.handshake_bytes_sent += 8 * (8 + preps[0].scalers.numel())
            st.collectives += 1                   # the handshake
        bad = [r for r, p in enumerate(preps) if bool(p.nonfinite)]
        if bad:
            msg = f"TernGrad: gradient '{name}' (shape {tuple(shape)}) contains NaN or Inf on rank(s) {bad}"
            if cfg.on_nonfinite == "raise":
                raise NonFiniteGradientError(msg)
            st.nonfinite_zeroed += 1
            return torch.zeros(shape, dtype=dtype, device=g32s[0].device)
        if n == 0:
            return torch.zeros(shape, dtype=dtype, device=g32s[0].device)
        if cfg.shared_scaler:
            shared = torch.stack([p.scalers for p in preps]).amax(dim=0)
            scalers = [shared] * self.n
        else:
            scalers = [p.scalers for p in preps]
        tid = codec.tensor_id(name)
        payloads = [backend.encode(g, p.threshold, s, cfg.bucket_size, codec.stream_key(cfg.seed, step, tid, r),
                                   cfg.packing, shape=shape)
                    for r, (g, p, s) in enumerate(zip(g32s, preps, scalers))]
        gathered = torch.cat(payloads)
        st.payload_bytes_sent += payloads[0].numel()
        st.bytes_received += gathered.numel() - payloads[0].numel()
        headers, offsets = codec.packing.walk(gathered, self.n, f"gathered payloads of '{name}'")
        return backend.decode(gathered, headers, offsets, self.n).view(shape).to(dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn, optimizer: torch.optim.Optimizer) -> None:
        avg = self.average(self.worker_gradients(x, y, loss_fn))
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        for p, g in zip(params, avg):
            p.grad = g.to(p.dtype)
        optimizer.step()

    def state_dict(self) -> dict:
        """What a resumed run needs to draw the same random streams: the per-tensor step counters (the
        stream key's ``step``), of the direct path and of each simulated rank's exchange."""
        return {"steps": dict(self._steps), "engine_steps": [dict(e._steps) for e in self.engines]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["engine_steps"]) != self.n:
            raise ValueError(f"simulator state is of {len(state['engine_steps'])} workers, this one has {self.n}")
        self._steps = dict(state["steps"])
        for e, steps in zip(self.engines, state["engine_steps"]):
            e._steps = dict(steps)

    @property
    def stats(self) -> ExchangeStats:
        """Rank 0's counters (what it handed to and got from the collectives)."""
        return self._direct_stats if self.average_mode == "direct" else self.engines[0].stats
