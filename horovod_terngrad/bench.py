"""Benchmarks that print figures (run them; the numbers go in docs/, not in assertions).

    python -m horovod_terngrad.bench codec [--numel 25000000] [--threads 1]
        GB/s of the codec stages on this machine, beside a preallocated copy of the same tensor.
    horovodrun --gloo -np 2 -H localhost:2 python -m horovod_terngrad.bench step [--layers 32] [--width 256]
        Step time of an MLP with 2·layers parameter tensors under fp32 / fp16 / TernGrad (shared
        scaler, i.e. with the handshake, and per-rank scaler, without it), and where TernGrad's time goes.
"""
from __future__ import annotations

import argparse
import time

import torch


def _timeit(fn, repeat=5):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def op_chain_ternarize(g: torch.Tensor, c: float = 2.5) -> torch.Tensor:
    """What existing TernGrad implementations do: a chain of separate torch ops (the baseline)."""
    sigma = g.std()
    clipped = g.clamp(-c * sigma, c * sigma)
    a = clipped.abs()
    s = a.max()
    r = torch.empty_like(g).uniform_()
    return (torch.sign(clipped) * (r < a / s)).to(torch.int8)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_bandwidth_gbs(device) -> float | None:
    try:
        import cupy
        p = cupy.cuda.runtime.getDeviceProperties(device.index or 0)
        return 2 * p["memoryClockRate"] * 1e3 * p["memoryBusWidth"] / 8 / 1e9
    except Exception:  # noqa: BLE001 - unknown: print without the percentage
        return None


def bench_codec(args):
    from . import backends, codec
    from .codec import packing
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = args.numel
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    gb = 4 * n / 1e9

    def timed(fn):
        def run():
            fn()
            _sync(device)
        return _timeit(run, args.repeat)

    dst = torch.empty_like(g)
    t_copy = timed(lambda: dst.copy_(g))
    peak = _peak_bandwidth_gbs(device) if device.type == "cuda" else None
    print(f"codec benchmark on {device} ({n} fp32 elements, {args.threads} CPU thread(s)); copy into a "
          f"preallocated tensor: {gb / t_copy:.2f} GB/s" + (f"; device peak {peak:.0f} GB/s" if peak else ""))
    t_chain = timed(lambda: op_chain_ternarize(g))
    print(f"  baseline op chain (std, clamp, abs, max, uniform_, compare, sign, int8): {gb / t_chain:.2f} GB/s")
    chosen = backends.for_device(device)
    candidates = [(chosen.name, chosen)]
    if args.reference and chosen is not backends.REFERENCE:
        candidates.append(("torch-reference", backends.REFERENCE))
    for name, be in candidates:
        for fmt in ("2bit", "base3"):
            prep = be.prepare(g, 0, 2.5)
            key = codec.stream_key(0, 0, 0, 0)
            t_stats = timed(lambda: be.prepare(g, 0, 2.5))
            t_tern = timed(lambda: be.encode(g, prep.threshold, prep.scalers, 0, key, fmt))
            t_comp = t_stats + t_tern
            pct = f", {100 * gb / t_comp / peak:.0f}% of peak bandwidth" if peak else ""
            print(f"  {name:14s} {fmt:5s} compress {gb / t_comp:6.2f} GB/s of fp32 input "
                  f"(statistics {gb / t_stats:.2f}, ternarize+pack {gb / t_tern:.2f}); "
                  f"{t_chain / t_comp:.1f}x the op chain, {100 * t_copy / t_comp:.0f}% of copy{pct}")
            payload = be.encode(g, prep.threshold, prep.scalers, 0, key, fmt)
            for N in (2, 8):
                gathered = torch.cat([payload] * N)
                headers, offsets = packing.walk(gathered, N)
                t_dec = timed(lambda: be.decode(gathered, headers, offsets, N, out=dst))
                print(f"  {name:14s} {fmt:5s} decompress N={N}: {gb / t_dec:6.2f} GB/s of fp32 output into a "
                      f"preallocated tensor ({100 * t_copy / t_dec:.0f}% of copy)")


STEP_CONFIGS = {
    "fp32": ("fp32 (Compression.none)", lambda hvd, T: hvd.Compression.none),
    "fp16": ("fp16 (Compression.fp16)", lambda hvd, T: hvd.Compression.fp16),
    "terngrad": ("TernGrad shared scaler", lambda hvd, T: T()),
    "terngrad-unfused": ("TernGrad, no fusion", lambda hvd, T: T(fusion_numel=0)),
    "terngrad-per-rank": ("TernGrad per-rank scaler", lambda hvd, T: T(shared_scaler=False)),
    "terngrad-sharded": ("TernGrad sharded exchange", lambda hvd, T: T(exchange="sharded")),
}


def _times_s(fn, repeat: int, warmup: int = 1) -> list:
    """Seconds of each of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeat):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def _median_s(fn, repeat: int, warmup: int = 1) -> float:
    times = _times_s(fn, repeat, warmup)
    return sorted(times)[len(times) // 2]


def calibrate(hvd, make_model, x, steps: int) -> dict:
    """What the performance model needs, measured where the job runs, every rank at once:
    the compute time of a step without any exchange (so with whatever sharing of cores the job has:
    the median on this rank, and the mean over steps of the slowest rank's time),
    the time of a 4-byte allreduce (the per-collective latency, Horovod's negotiation included), and
    one large instance of each collective the exchanges use, at this model's sizes (fp32
    allreduce of all gradients; allgather of the TernGrad payloads; alltoall of the sharded chunks).
    ``perfmodel.calibrated_efficiency`` turns the collective times into per-collective efficiencies."""
    from . import perfmodel as pm
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def compute_step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    sizes = [p.numel() for p in model.parameters()]
    n, N = sum(sizes), hvd.size()
    hvd.allreduce(torch.zeros(1), name="bench.cal.barrier0")
    times = _times_s(compute_step, max(3, steps // 2), warmup=2)
    compute = sorted(times)[len(times) // 2]
    # a synchronous step waits for its slowest rank: the mean over steps of the slowest rank's time
    per_rank = hvd.allgather(torch.tensor([times], dtype=torch.float64), name="bench.cal.times")
    slowest = float(per_rank.max(dim=0).values.mean())
    hvd.allreduce(torch.zeros(1), name="bench.cal.barrier1")
    tiny = torch.zeros(1)
    small = _median_s(lambda: hvd.allreduce(tiny, name="bench.cal.small", op=hvd.Sum), 9, warmup=2)
    grads = torch.randn(n)
    allreduce = _median_s(lambda: hvd.allreduce(grads, name="bench.cal.ar", op=hvd.Sum), 3)
    payload = torch.zeros(sum(pm.payload_bytes(s) for s in sizes), dtype=torch.uint8)
    allgather = _median_s(lambda: hvd.allgather(payload, name="bench.cal.ag"), 3)
    chunk = pm.SHARDED_CHUNK_HEADER_BYTES + pm.packed_bytes(pm.shard_numel(n, N))
    chunks = torch.zeros(chunk * N, dtype=torch.uint8)
    alltoall = _median_s(lambda: hvd.alltoall(chunks, splits=torch.tensor([chunk] * N, dtype=torch.int32),
                                              name="bench.cal.a2a"), 3)
    return {"compute_ms": 1000 * compute, "compute_slowest_ms": 1000 * slowest, "small_allreduce_ms": 1000 * small, "allreduce": [4 * n, allreduce], "allgather": [payload.numel(), allgather],
            "alltoall": [chunk, alltoall]}


def bench_step(args):
    import json

    import horovod.torch as hvd

    from . import TernGradCompressor
    hvd.init()
    torch.set_num_threads(1)

    def make_model():   # a fresh model per configuration: Horovod's hooks stay on the parameters
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    model = make_model()
    ntensors = sum(1 for _ in model.parameters())
    nparams = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    calibration = calibrate(hvd, make_model, x, args.steps) if args.calibrate else None
    rows = []
    for key in args.configs.split(","):
        label, make = STEP_CONFIGS[key]
        comp = make(hvd, TernGradCompressor)
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters(), compression=comp)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup and hasattr(comp, "stats"):
                comp.stats.reset()
            t = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - t)
        step_ms = 1000 * sorted(times[args.warmup:])[len(times[args.warmup:]) // 2]
        row = {"config": key, "label": label, "step_ms": step_ms}
        if hasattr(comp, "stats"):
            st = comp.stats
            k = args.steps
            row.update(codec_ms=1000 * st.codec_s / k, handshake_wait_ms=1000 * st.handshake_wait_s / k,
                       payload_wait_ms=1000 * st.gather_wait_s / k, bits_per_element=st.bits_per_element(),
                       collectives_per_step=st.collectives / k,
                       received_bits_per_element=8 * st.bytes_received / max(1, st.elements))
        rows.append(row)
        hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{key}")
    if hvd.rank() == 0:
        print(f"step benchmark: MLP with {ntensors} parameter tensors ({nparams} parameters), batch {args.batch}, "
              f"{hvd.size()} ranks, median of {args.steps} steps")
        base = rows[0]["step_ms"]
        for r in rows:
            extra = ""
            if "codec_ms" in r:
                extra = (f"{r['collectives_per_step']:.0f} collectives/step, codec {r['codec_ms']:.2f} ms, waiting for handshakes {r['handshake_wait_ms']:.2f} ms, "
                         f"for payloads {r['payload_wait_ms']:.2f} ms per step; {r['bits_per_element']:.3f} bits/element sent")
            print(f"  {r['label']:26s} {r['step_ms']:8.2f} ms/step ({r['step_ms'] / base:.2f}x {rows[0]['config']})  {extra}")
        by = {r["config"]: r["step_ms"] for r in rows}
        if "terngrad" in by and "terngrad-unfused" in by:
            print(f"  tensor fusion saves {by['terngrad-unfused'] - by['terngrad']:+.2f} ms/step "
                  f"({by['terngrad-unfused'] / by['terngrad']:.2f}x) for {ntensors} tensors")
        if "terngrad" in by and "terngrad-per-rank" in by:
            print(f"  handshake cost (shared - per-rank scaler): {by['terngrad'] - by['terngrad-per-rank']:+.2f} ms/step "
                  f"for {ntensors} tensors")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": hvd.size(), "params": nparams, "tensors": ntensors, "batch": args.batch,
                           "rows": rows, "calibration": calibration}, f, indent=1)
    hvd.shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m horovod_terngrad.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("codec")
    c.add_argument("--numel", type=int, default=25_000_000)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--reference", action="store_true", help="also time the torch reference path")
    c.add_argument("--device", default="cpu", help="cpu or cuda")
    s = sub.add_parser("step")
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--width", type=int, default=256)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--configs", default="fp32,fp16,terngrad,terngrad-unfused,terngrad-per-rank",
                   help="comma list of " + ",".join(STEP_CONFIGS))
    s.add_argument("--json", default="", help="rank 0 writes the figures here")
    s.add_argument("--calibrate", action="store_true",
                   help="first measure compute alone and one large allreduce/allgather/alltoall (for the perf model)")
    args = p.parse_args(argv)
    {"codec": bench_codec, "step": bench_step}[args.what](args)


if __name__ == "__main__":
    main()
