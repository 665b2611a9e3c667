"""Golden pins: the bytes every rank hands to each collective, and every decoded average, for a fixed set
of tensors, settings, exchanges, fusion and rank counts, over two steps (stream keys advance); and, at the codec,
the four-level code's payloads (codec/levels.py) of every rank of a group with its decoded average and noise estimate.

The pinned digests must not change:
a refactor of how payloads travel may move code, never a bit.  Re-pin only for an intended change
of the wire format or the arithmetic: ``.venv/bin/python scripts/write_golden.py`` (it runs ``_run`` below).
"""
import hashlib
import json
import os

import pytest
import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad import codec as C
from horovod_terngrad.codec import levels, packing
from horovod_terngrad.exchange import Engine, run_ranks

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "exchange.json")

SHAPES = [(0,), (1,), (7,), (3, 5), (1000,), (64, 33), (20011,)]
CASES = {
    "default": dict(),
    "base3": dict(packing="base3", seed=5),
    "buckets": dict(bucket_size=64),
    "noclip": dict(clip_factor=0.0),
    "per-rank": dict(shared_scaler=False),
    "per-rank-base3-buckets": dict(shared_scaler=False, packing="base3", bucket_size=100),
    "sharded": dict(exchange="sharded"),
    "sharded-base3-buckets": dict(exchange="sharded", packing="base3", bucket_size=50),
    "zero-nonfinite": dict(on_nonfinite="zero"),
    "auto": dict(exchange="auto"),
    # the re-ternarized exchange
    "reternarized": dict(exchange="reternarized", shared_scaler=False),
    "reternarized-base3-buckets": dict(exchange="reternarized", shared_scaler=False, packing="base3", bucket_size=50),
    "reternarized-shared": dict(exchange="reternarized"),
    "reternarized-zero-nonfinite": dict(exchange="reternarized", shared_scaler=False, on_nonfinite="zero"),
    # the requantized exchange.  "auto" weighs the two exchanges "default" runs, the allgather and the requantized
    # one: at 3 and 4 ranks it picks the requantized exchange for the large tensors
    "requantized": dict(exchange="requantized"),
    "requantized-base3-buckets": dict(exchange="requantized", packing="base3", bucket_size=50),
    # the four-level first stage (codec/levels.py), the shard-owner exchanges' default
    "requantized-4level": dict(exchange="requantized", levels=4),
    "reternarized-4level-base3-buckets": dict(exchange="reternarized", shared_scaler=False, levels=4, packing="base3",
                                              bucket_size=50),
}
# the settings again with the noise estimate asked for (as horovod_terngrad.optim's default asks): the payloads carry
# the senders' squares (codec/squares.py) and the estimate's digest is pinned beside the average's
NOISE_CASES = {
    "per-rank-noise": dict(shared_scaler=False),
    "requantized-noise": dict(exchange="requantized"),
    "requantized-base3-buckets-noise": dict(exchange="requantized", packing="base3", bucket_size=50),
    "requantized-4level-noise": dict(exchange="requantized", levels=4),
}
CASES.update(NOISE_CASES)
RANKS = (1, 2, 3, 4)
FUSED = ("alone", "fused")


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)
    t = t.cpu()                       # the CUDA check digests device tensors the same way
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def _grad(shape, rank, tensor, step, nan=False):
    gen = torch.Generator().manual_seed(7919 * tensor + 104729 * step + rank)
    g = torch.randn(shape, generator=gen) * (0.5 + rank)
    if nan and g.numel() > 3:
        g.view(-1)[3] = float("nan")
    return g


class _Recording:
    """Collectives that log (kind, name, digest of the input) of every call, then delegate.  Per-rank
    scalers' presence checks (a 1 per rank and step, added after the pins were written) are kept apart in
    ``presence`` and checked on their own, so the pins stay the ones the old code wrote."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.log, self.presence = inner, inner.rank, inner.size, [], []

    def allreduce_sum_async(self, tensor, name):
        entry = ["sum", name, _digest(tensor)]
        (self.presence if name.startswith("terngrad.presence.") else self.log).append(entry)
        return self.inner.allreduce_sum_async(tensor, name)

    def allreduce_max_async(self, tensor, name):
        self.log.append(["max", name, _digest(tensor)])
        return self.inner.allreduce_max_async(tensor, name)

    def allgather_async(self, tensor, name):
        self.log.append(["gather", name, _digest(tensor)])
        return self.inner.allgather_async(tensor, name)

    def alltoall_async(self, tensor, splits, name):
        self.log.append(["a2a", name, _digest(tensor), list(splits)])
        return self.inner.alltoall_async(tensor, splits, name)

    def poll(self, handle):
        return self.inner.poll(handle)

    def synchronize(self, handle):
        return self.inner.synchronize(handle)


def _run(case: str, n_ranks: int, fused: str, device: str = "cpu", settings: dict | None = None) -> dict:
    """One pinned case: the gradients live on ``device`` (the same values on every device: drawn on the CPU,
    then moved), so a CUDA run must reproduce the CPU's pins bit for bit.  ``settings`` replaces the case's."""
    # the cases' common settings: the paper's shared scaler and the ternary code (each case says where it differs)
    cfg = TernGradConfig(**({"shared_scaler": True, "levels": 3, **CASES[case]} if settings is None else settings))

    def body(c):
        rec = _Recording(c)
        ex = Engine(rec, cfg)
        outs = []
        for step in range(2):
            grads = [(_grad(s, c.rank, i, step, nan=(case.endswith("zero-nonfinite") and c.rank == n_ranks - 1 and i == 4)
                            ).to(device), f"layer{i}") for i, s in enumerate(SHAPES)]
            if case in NOISE_CASES:   # asked before the payloads leave, as the optimizer's routes ask
                if fused == "fused":
                    tickets = (ex.start_group(grads[:4], "g0", want_noise=[True] * 4)
                               + ex.start_group(grads[4:], "g1", want_noise=[True] * (len(grads) - 4)))
                else:
                    tickets = [ex.start_group([(g, name)], name, want_noise=[True])[0] for g, name in grads]
                outs.append([_digest(ex.finish(t)) for t in tickets]
                            + [None if t.noise is None else _digest(t.noise) for t in tickets])
                continue
            if fused == "fused":      # two groups, as the frontend cuts them: small tensors, then the rest
                tickets = ex.start_group(grads[:4], "g0") + ex.start_group(grads[4:], "g1")
            else:
                tickets = [ex.start(g, name) for g, name in grads]
            outs.append([_digest(ex.finish(t)) for t in tickets])
        return {"log": rec.log, "outs": outs, "presence": rec.presence}

    per_rank = run_ranks(n_ranks, body)
    for r in range(1, n_ranks):
        assert per_rank[r]["outs"] == per_rank[0]["outs"], f"rank {r} decoded other bits than rank 0"
    one = ["sum", None, _digest(torch.ones(1, dtype=torch.int32))]
    want_presence = [] if cfg.shares_scaler else [one] * 2        # one per step (a finish ends a step)
    for r in per_rank:
        assert [[k, None, d] for k, _, d in r["presence"]] == want_presence
    # a rank posts a payload as soon as its handshake is back: the order across names depends on thread
    # timing, so the log is compared as a sorted list (every collective, with its bytes, exactly once)
    return {"outs": per_rank[0]["outs"], "logs": [sorted(r["log"]) for r in per_rank]}


def _all_keys():
    return [(c, n, f) for c in CASES for n in RANKS for f in FUSED]


# -- the four-level code, pinned at the codec ----------------------------------------------------------------------
# Every rank of a group of 3 or 16 rounds its own gradient of each tensor (one holds a NaN on the last rank in the
# bucketed cases: its scalers are zero and it carries the NaN flag) with its stratified dithers; pinned per tensor and
# step: the gathered payloads, their average (divisor N) and the noise estimate (squares, divisor N²).
LEVEL_SHAPES = [(1,), (7,), (1000,), (64, 33)]
LEVEL_CASES = {
    "g3": dict(group=3, bucket=0),
    "g3-buckets": dict(group=3, bucket=64),
    "g16": dict(group=16, bucket=0),
    "g16-buckets": dict(group=16, bucket=100),
}
LEVEL_SEED = 13


def _level_keys():
    return [(f"4level/{c}", c) for c in LEVEL_CASES]


def _run_levels(case: str, backend=None, device: str = "cpu") -> dict:
    """One pinned four-level case through codec/levels.py (``backend`` None), or through a backend's prepare,
    encode_levels, decode and (where it has one) decode_noise, which must give the same digests; the gradients are
    drawn on the CPU and moved to ``device``."""
    group, bucket = LEVEL_CASES[case]["group"], LEVEL_CASES[case]["bucket"]
    out = {"payloads": [], "outs": [], "noise": []}
    for step in range(2):
        for i, shape in enumerate(LEVEL_SHAPES):
            tid, pays = C.tensor_id(f"layer{i}"), []
            for r in range(group):
                g = _grad(shape, r, i, step, nan=bucket > 0 and i == 2 and r == group - 1).reshape(-1).to(device)
                p = (backend or C).prepare(g, bucket, 2.5)
                flags = packing.FLAG_NONFINITE if bool(p.nonfinite) else 0
                own, strata = C.stream_key(LEVEL_SEED, step, tid, r), levels.strata_key(LEVEL_SEED, step, tid)
                encode = levels.encode if backend is None else backend.encode_levels
                pays.append(encode(g, p.threshold, p.scalers, bucket, own, strata, r, group, flags, shape))
            x = torch.cat(pays)
            h, o = packing.walk(x, group)
            avg = levels.decode_average(x, h, o, group) if backend is None else backend.decode(x, h, o, group)
            noise = (levels.decode_average(x, h, o, float(group) ** 2, squares=True) if backend is None
                     else backend.decode_noise(x, h, o, group) if hasattr(backend, "decode_noise") else None)
            out["payloads"].append(_digest(x))
            out["outs"].append(_digest(avg))
            out["noise"].append(None if noise is None else _digest(noise))
    return out


def _load():
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("case,n_ranks,fused", _all_keys())
def test_bytes_and_averages_match_the_pinned_digests(case, n_ranks, fused):
    torch.set_num_threads(1)
    want = _load()[f"{case}/{n_ranks}/{fused}"]
    got = _run(case, n_ranks, fused)
    assert got["outs"] == want["outs"], "decoded averages changed"
    for r in range(n_ranks):
        assert got["logs"][r] == want["logs"][r], f"rank {r}: collectives or their bytes changed"


def test_the_pins_cover_every_case():
    assert sorted(_load()) == sorted([f"{c}/{n}/{f}" for c, n, f in _all_keys()] + [k for k, _ in _level_keys()])


@pytest.mark.parametrize("backend", ["codec", "reference", "fused", "host-kernels"])
@pytest.mark.parametrize("case", list(LEVEL_CASES))
def test_four_level_bytes_match_the_pinned_digests(case, backend):
    """The reference's four-level bytes, average and noise estimate are pinned; the reference backend, the fused CPU
    backend and the CUDA kernels' host build reproduce them (the noise estimate where the backend has one)."""
    from horovod_terngrad.backends import REFERENCE, cpu_fused
    from horovod_terngrad.backends.cuda import KernelBackend
    from horovod_terngrad.backends.host_build import HostKernels
    torch.set_num_threads(1)
    want = _load()[f"4level/{case}"]
    be = {"codec": lambda: None, "reference": lambda: REFERENCE, "fused": cpu_fused,
          "host-kernels": lambda: KernelBackend(HostKernels())}[backend]()
    got = _run_levels(case, be)
    assert got["payloads"] == want["payloads"], "four-level payload bytes changed"
    assert got["outs"] == want["outs"], "decoded four-level averages changed"
    if None not in got["noise"]:
        assert got["noise"] == want["noise"], "four-level noise estimates changed"
    else:
        assert backend in ("reference", "host-kernels")          # the backends without decode_noise


# -- the same pins on a GPU ------------------------------------------------------------------------------------------
# The CUDA backend (CuPy kernels) must be byte-identical to the CPU's: the same payload bytes on every collective and
# the same decoded averages.  Skipped without a GPU; on CPU the kernels' arithmetic is checked through their host
# build (tests/test_kernels.py) and every exchange's bytes by the pins above.
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("n_ranks", (2, 4))
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_tensors_reproduce_the_pins(case, n_ranks):
    torch.set_num_threads(1)
    want = _load()[f"{case}/{n_ranks}/fused"]
    got = _run(case, n_ranks, "fused", device="cuda")
    assert got["outs"] == want["outs"], "CUDA decoded other averages than the CPU pins"
    for r in range(n_ranks):
        assert got["logs"][r] == want["logs"][r], f"rank {r}: CUDA sent other bytes than the CPU pins"


@cuda
@pytest.mark.parametrize("case", list(LEVEL_CASES))
def test_cuda_kernels_reproduce_the_four_level_pins(case):
    from horovod_terngrad.backends import cuda_kernels
    be = cuda_kernels()
    assert be is not None, "CuPy kernels failed to load on a CUDA machine"
    want = _load()[f"4level/{case}"]
    got = _run_levels(case, be, device="cuda")
    assert got["payloads"] == want["payloads"] and got["outs"] == want["outs"]


@cuda
@pytest.mark.parametrize("n_ranks", (6, 8))
def test_cuda_default_above_4_ranks_matches_the_cpu(n_ranks):
    """The default above 4 ranks (the requantized exchange, per-rank scalers) has no pin: the CPU run is the
    reference, on the same gradients."""
    torch.set_num_threads(1)
    cpu = _run("default", n_ranks, "fused", settings={})
    assert {e[1].split(".")[1] for e in cpu["logs"][0]} == {"rt", "rg"}     # a two-stage exchange ran
    gpu = _run("default", n_ranks, "fused", device="cuda", settings={})
    assert gpu["outs"] == cpu["outs"], "CUDA decoded other averages than the CPU"
    assert gpu["logs"] == cpu["logs"], "CUDA sent other bytes than the CPU"
