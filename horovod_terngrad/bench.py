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


def bench_codec(args):
    from . import codec
    from .backends import REFERENCE, cpu_fused
    torch.set_num_threads(args.threads)
    n = args.numel
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    gb = 4 * n / 1e9
    dst = torch.empty_like(g)
    t_copy = _timeit(lambda: dst.copy_(g))
    print(f"codec benchmark: {n} fp32 elements, {args.threads} thread(s); copy into a preallocated tensor "
          f"{gb / t_copy:.2f} GB/s")
    backends = [("cpu-fused", cpu_fused())]
    if args.reference:
        backends.append(("torch-reference", REFERENCE))
    for name, be in backends:
        if be is None:
            print(f"{name}: unavailable")
            continue
        for fmt in ("2bit", "base3"):
            st = be.stats(g, 0)
            thr = codec.clip_threshold(st, 2.5)
            s = codec.local_scalers(st, thr)
            key = codec.stream_key(0, 0, 0, 0)
            t_stats = _timeit(lambda: be.stats(g, 0), args.repeat)
            t_tern = _timeit(lambda: be.ternarize_pack(g, thr, s, 0, key, fmt), args.repeat)
            packed = be.ternarize_pack(g, thr, s, 0, key, fmt)
            line = (f"{name:15s} {fmt:5s} stats {gb / t_stats:6.2f} GB/s  ternarize+pack {gb / t_tern:6.2f} GB/s  "
                    f"compress {gb / (t_stats + t_tern):6.2f} GB/s ({100 * t_copy / (t_stats + t_tern):.0f}% of copy)")
            for N in (2, 8):
                t_dec = _timeit(lambda: be.decode_average([packed] * N, [s] * N, n, fmt, 0, N), args.repeat)
                line += f"  decode N={N} {gb / t_dec:6.2f} GB/s out"
            print(line, flush=True)


def bench_step(args):
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
    rows = []
    configs = [("fp32 (Compression.none)", hvd.Compression.none), ("fp16 (Compression.fp16)", hvd.Compression.fp16),
               ("TernGrad shared scaler", TernGradCompressor()),
               ("TernGrad per-rank scaler", TernGradCompressor(shared_scaler=False))]
    for label, comp in configs:
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
        extra = ""
        if hasattr(comp, "stats"):
            st = comp.stats
            k = args.steps
            extra = (f"codec {1000 * st.codec_s / k:.2f} ms, waiting for handshakes {1000 * st.handshake_wait_s / k:.2f} ms, "
                     f"for payloads {1000 * st.gather_wait_s / k:.2f} ms per step; {st.bits_per_element():.3f} bits/element")
        rows.append((label, step_ms, extra))
        hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{label}")
    if hvd.rank() == 0:
        print(f"step benchmark: MLP with {ntensors} parameter tensors ({nparams} parameters), batch {args.batch}, "
              f"{hvd.size()} ranks, median of {args.steps} steps")
        base = rows[0][1]
        for label, ms, extra in rows:
            print(f"  {label:26s} {ms:8.2f} ms/step ({ms / base:.2f}x fp32)  {extra}")
        shared, per_rank = rows[2][1], rows[3][1]
        print(f"  handshake cost (shared - per-rank scaler): {shared - per_rank:+.2f} ms/step "
              f"for {ntensors} tensors")
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
    s = sub.add_parser("step")
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--width", type=int, default=256)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    {"codec": bench_codec, "step": bench_step}[args.what](args)


if __name__ == "__main__":
    main()
