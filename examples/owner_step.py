"""Owner-step training in the simulator (a research path of examples/study_lm_scale.py): each shard's owner steps its shard of the weights and
sends every rank a ternary correction of their copy.

1. Gradients (the requantized exchange's first stage, run by the real engine): every rank ternarizes its gradient
   with one scaler per shard and sends shard o, with its squares trailer (codec/squares.py), to rank o (alltoall);
   owner o decodes the exact average a_o = (Σ_r s_r·t_r)/N and the first stage's noise estimate ν_o, with the
   minibatch's share taken out by the senders' squares.
2. Step: the owner keeps the master weights w_o and the optimizer state of its shard and takes
   horovod_terngrad.optim.AdamW's step with a_o and ν_o (the global norm clip needs one scalar allreduce of the
   owners' Σ a_o², 4 bytes).
3. Weights: the owner ternarizes d_o = w_o - x_o, where x_o is the shard of the copy x every rank trains on (the
   replica), q_o = s·t with one scaler per shard (or per ``delta_bucket`` elements), and sends q_o to every rank
   (allgather); every rank, the owner too, sets x_o += q_o.  Forward and backward passes run on x.

Each step's difference is taken against the master, so the replica's error x - w is one rounding of (one step +
the previous error), never a sum of roundings:

* ``rounding="nearest"`` (deterministic): s = max|d| per bucket, t = round(d/s) in {-1, 0, 1}; the error
  e = d - q has |e| <= s/2, and s' = max|step + e| <= max|step| + s/2, so s stays under 2·max|step| and the
  replica within max|step| of the master, elementwise (``nearest_ternary``; tests/test_owner_step.py);
* ``rounding="stochastic"``: the codec's unbiased rounding with s = max|d| (no clipping), E[x] = w, error variance
  s·|d| - d² per element; its own stream per (seed, step, tensor, owner);
* ``rounding="exact"`` (a control, not a candidate): the difference travels in fp32, so the replica is the
  master and only the first stage's rounding is left; counted as 32 bits per element.

The simulator's stand-in: one process plays every rank, so the owners' exact averages and estimates travel to
rank 0 in fp32 (a stand-in payload, not counted) and one optimizer steps every shard at once, which is the same
arithmetic (AdamW is elementwise; the clip reads the norm of the whole average).  The bits a real run would move
are counted from codec/sizes.py (``received_bytes``): the first stage's shards as the requantized exchange sends
them, the weight differences as ternary payloads (header, scalers, packed codes) per shard.  Tensors that the
policy keeps at full precision (``min_numel``, ``exclude``) are averaged in fp32 and stepped by every rank, as the
frontends do: their replica is the master.
"""
from __future__ import annotations

import contextlib
import types

import torch

from horovod_terngrad import backends, codec
from horovod_terngrad.codec import nearest, sizes, squares
from horovod_terngrad.codec.packing import FLAG_NONFINITE, Header, device_constant
from horovod_terngrad.exchange import allgather, reternarized
from horovod_terngrad.exchange import engine as engine_module
from horovod_terngrad.modelling.simulate import Simulator

ROUNDINGS = ("nearest", "stochastic", "exact")
WEIGHTS_SUFFIX = "#weights"     # the weight difference's random stream: tensor word of '<name>#weights'
STAND_IN_PREAMBLE = 4           # the stand-in payload's first bytes: byte 3 carries the senders' NaN/Inf flag


class OwnerShardStage:
    """The second stage of the simulated owner-step exchange: the owner's exact average of its shard and the first
    stage's noise estimate, handed to rank 0 in fp32 (the stand-in: a real owner keeps them and steps)."""

    label = "owner-step exchange (simulated)"
    settings_hint = ""
    takes_squares = True       # the senders' squares take the minibatch's share out of the owner's estimate

    @staticmethod
    def owner_chunks(ex, tk) -> list:
        per = 8 if tk.want_noise else 4
        return [STAND_IN_PREAMBLE + per * (hi - lo) if hi > lo else 0
                for lo, hi in sizes.reternarized_bounds(tk.numel, ex.coll.size, tk.group.bucket_size)]

    @staticmethod
    def owner_payload(backend, received, offsets, lo, hi, tk, ex) -> torch.Tensor:
        cfg, N, m = ex.config, ex.coll.size, hi - lo
        if m == 0:
            return reternarized.empty_payload(received.device)
        head = Header(cfg.first_stage_format(tk.group.transport), 0, tk.group.bucket_size, m)
        reternarized.check_shard_headers(received, offsets, head, tk.name)
        flags = received[device_constant([o + 3 for o in offsets], torch.int64, received.device)]
        bad = bool((flags & FLAG_NONFINITE).ne(0).any())
        divisor = N if tk.average else 1
        avg = backend.decode(received, [head] * N, offsets, divisor)
        parts = [torch.tensor([0, 0, 0, FLAG_NONFINITE if bad else 0], dtype=torch.uint8), avg.view(torch.uint8)]
        if tk.want_noise:
            noise = allgather.noise_estimate(received, [head] * N, offsets, divisor)
            if tk.squares:
                size = sizes.payload_size(m, head.fmt, tk.group.bucket_size, squares=True)
                squares.take_out_minibatch_share(noise, squares.read(received, [o + size for o in offsets]), divisor)
            parts.append(noise.view(torch.uint8))
        return torch.cat(parts)

    @staticmethod
    def decode(gathered, off, lo, hi, tk, ex, out, noise) -> None:
        m = hi - lo
        at = off + STAND_IN_PREAMBLE
        out[lo:hi] = gathered[at:at + 4 * m].clone().view(torch.float32)
        if noise is not None:
            noise[lo:hi] = gathered[at + 4 * m:at + 8 * m].clone().view(torch.float32)


TRANSPORT = types.SimpleNamespace(
    send=lambda ex, grp, sends: reternarized.send(ex, grp, sends, OwnerShardStage),
    after_alltoall=lambda ex, grp: reternarized.after_alltoall(ex, grp, OwnerShardStage),
    receive=lambda ex, tk: reternarized.receive(ex, tk, OwnerShardStage))


@contextlib.contextmanager
def owner_transport():
    """The engine's requantized groups take the owner-step stand-in while inside (restored on leaving)."""
    saved = engine_module.TRANSPORTS["requantized"]
    engine_module.TRANSPORTS["requantized"] = TRANSPORT
    try:
        yield
    finally:
        engine_module.TRANSPORTS["requantized"] = saved


def nearest_ternary(d: torch.Tensor, bucket: int) -> torch.Tensor:
    """Deterministic ternary rounding of the flat ``d`` (codec/nearest.py, what OwnerStepOptimizer sends): per
    bucket of ``bucket`` elements (the last one short) s = max|d|, q = s·round(d/s) with round to nearest in
    {-1, 0, 1} (a tie |d| = s/2 goes to ±s).  |d - q| <= s/2."""
    n = d.numel()
    if n == 0:
        return d.clone()
    k = bucket if 0 < bucket < n else 0
    t, scalers = nearest.nearest_ternary(d, k)
    return t.to(torch.float32) * codec.expand_scalers(scalers, k, n)


def stochastic_ternary(d: torch.Tensor, bucket: int, key, fmt: str) -> torch.Tensor:
    """The codec's unbiased ternary rounding of the flat fp32 ``d`` (one scaler per ``bucket`` elements, s = max|d|,
    no clipping) with the stream ``key``, encoded and decoded by the backend: E[q] = d."""
    n = d.numel()
    if n == 0:
        return d.clone()
    backend = backends.for_device(d.device)
    k = bucket if bucket < n else 0
    prep = backend.prepare(d, k, 0.0)
    payload = backend.encode(d, prep.threshold, prep.scalers, k, key, fmt, shape=(n,))
    return backend.decode(payload, [Header(fmt, 0, k, n)], [0], 1)


def delta_bytes(numel: int, n_ranks: int, fmt: str, stage_bucket: int, delta_bucket: int,
                exact: bool = False) -> list:
    """Bytes of each owner's weight-difference payload of one tensor: a ternary payload (header, one scaler per
    ``delta_bucket`` elements or per shard, packed codes) per non-empty shard (``exact``: fp32 values)."""
    out = []
    for lo, hi in sizes.reternarized_bounds(numel, n_ranks, stage_bucket):
        m = hi - lo
        if exact:
            out.append(4 * m)
        else:
            out.append(sizes.payload_size(m, fmt, delta_bucket if 0 < delta_bucket < m else 0) if m > 0 else 0)
    return out


def received_bytes(numel: int, n_ranks: int, fmt: str, stage_bucket: int = 0, delta_bucket: int = 0,
                   squares_trailer: bool = True, rank: int = 0, exact: bool = False,
                   grad_fmt: str | None = None) -> tuple[int, int]:
    """Bytes ``rank`` receives per step for one ternarized tensor: (gradient shards from the N-1 other ranks in
    the alltoall, the N-1 other owners' weight differences in the allgather).  ``grad_fmt``: the gradients'
    format where it is not the weights' ``fmt`` (the four-level code)."""
    grad = sizes.reternarized_chunk_bytes(numel, n_ranks, grad_fmt or fmt, stage_bucket, squares_trailer)[rank]
    delta = delta_bytes(numel, n_ranks, fmt, stage_bucket, delta_bucket, exact)
    return (n_ranks - 1) * grad, sum(delta) - delta[rank]


class OwnerStepSimulator(Simulator):
    """``Simulator`` whose ternarized parameters train owner-step (module docstring).  The model's parameters hold
    the master weights during the step and the replica during forward and backward passes:

        sim.to_replica(); grads = ... ; avg = sim.average(grads)
        sim.to_master(); (set .grad, clip, optimizer.step()); sim.send_weights()

    ``rounding``: "nearest", "stochastic" or "exact"; ``delta_bucket``: elements per scaler of the weight difference
    (0: one per shard)."""

    def __init__(self, model, n_workers, config, rounding: str = "nearest", delta_bucket: int = 0):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if config.exchange != "requantized" or config.hierarchical is not False:
            raise ValueError("owner-step runs the requantized exchange's first stage, flat: "
                             "TernGradConfig(exchange='requantized', hierarchical=False)")
        super().__init__(model, n_workers, config)
        self.rounding, self.delta_bucket = rounding, int(delta_bucket)
        self.ternary = [self.config.compresses(name, p.numel()) for name, p in zip(self.names, self.params)]
        self.master = [p.data for p in self.params]
        self.replica = [p.data.clone() if t else p.data for p, t in zip(self.params, self.ternary)]
        self.steps = 0
        self.grad_bytes = self.delta_bytes = self.elements = 0
        self.error_max = 0.0        # the largest |replica - master| after a step, over the run

    def to_replica(self) -> None:
        for p, x in zip(self.params, self.replica):
            p.data = x

    def to_master(self) -> None:
        for p, w in zip(self.params, self.master):
            p.data = w

    def _exchange(self, per_rank, names, routes=None):
        with owner_transport():
            return super()._exchange(per_rank, names, routes)

    @torch.no_grad()
    def send_weights(self) -> None:
        """Every owner's ternary weight difference to every rank: replica += q, per ternarized parameter."""
        N, fmt, bucket = self.n, self.config.packing, self.config.bucket_size
        for name, w, x, tern in zip(self.names, self.master, self.replica, self.ternary):
            if not tern:
                continue
            n = w.numel()
            wf, xf = w.reshape(-1), x.view(-1)
            for owner, (lo, hi) in enumerate(sizes.reternarized_bounds(n, N, bucket)):
                if hi <= lo:
                    continue
                d = (wf[lo:hi] - xf[lo:hi]).to(torch.float32)
                k = self.delta_bucket if 0 < self.delta_bucket < hi - lo else hi - lo
                if self.rounding == "exact":
                    q = d
                elif self.rounding == "nearest":
                    q = nearest_ternary(d, k)
                else:
                    key = codec.stream_key(self.config.seed, self.steps, codec.tensor_id(name + WEIGHTS_SUFFIX),
                                           owner)
                    q = stochastic_ternary(d, k, key, fmt)
                xf[lo:hi] += q.to(xf.dtype)
            self.error_max = max(self.error_max, float((wf - xf).abs().max()))
            g, dl = received_bytes(n, N, fmt, bucket, self.delta_bucket, exact=self.rounding == "exact",
                                   grad_fmt=self.config.first_stage_format("requantized"))
            self.grad_bytes += g
            self.delta_bytes += dl
            self.elements += n
        self.steps += 1

    def bits_received(self) -> tuple[float, float]:
        """Rank 0's bits received per ternarized element so far: (gradient stage, weight stage)."""
        e = max(1, self.elements)
        return 8 * self.grad_bytes / e, 8 * self.delta_bytes / e


__all__ = ["OwnerShardStage", "OwnerStepSimulator", "owner_transport", "nearest_ternary", "stochastic_ternary",
           "delta_bytes", "received_bytes", "ROUNDINGS"]
