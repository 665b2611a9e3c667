"""One check of a GPU machine, in one call (scripts/gpu_check.sh), printing one table.

    python -m horovod_terngrad.operations.gpu_check               # on a GPU; a CPU dry run where there is none
    python -m horovod_terngrad.operations.gpu_check --dry-run     # the CPU dry run, GPU or not

Steps, each one row of the table:

1. ``tests``: the CUDA tests of the checkout (tests/test_kernels.py, tests/test_backends.py,
   tests/test_cuda_nosync.py, and tests/test_golden.py's CUDA tests: every exchange's pinned bytes and averages
   from CUDA tensors, and the default above 4 ranks against the CPU) under pytest.  Dry run: test_kernels.py (its CUDA sources built for the host) and
   test_cuda_nosync.py, whose CUDA tests skip.
2. ``identity <model>``: byte identity of the device backend against a CPU backend on a model's real tensor
   shapes (GPT-2 in GPT2LMHeadModel's layout, ResNet-50 in torchvision's): per tensor, two ranks' statistics,
   encoded payloads (both packings) and the decode of both payloads must be bit for bit the same.  On a GPU: the
   CUDA backend (CuPy kernels, or the torch reference on the GPU where CuPy is missing) against the fused CPU
   backend.  Dry run: the fused CPU backend against the torch reference.
3. ``codec``: the device backend's compress and decompress (N=2) rates in GB/s of fp32, beside a copy of the
   same tensor on the same device.
4. ``optimizer``: ``horovod_terngrad.optim.AdamW``'s step on GPT-2's tensors with a ternary gradient and its
   noise estimate (what every frontend hands over), beside ``torch.optim.AdamW``'s.
5. ``2 ranks``: two processes on the one device (gloo; on a GPU over CUDA tensors), the DDP hook and
   ``horovod_terngrad.optim.AdamW`` for a few steps: losses finite, the ranks' parameters identical.

A step that fails is marked FAIL (with its error) and the others still run; the exit status is 1 when any step
failed, else 0 (a CPU dry run that passes exits 0).  Every step has a time limit, so the whole check stays under
``--budget-s`` (default 420 s; scripts/gpu_check.sh stops it at 480 s).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_TEST_FILES = ("tests/test_kernels.py", "tests/test_backends.py", "tests/test_cuda_nosync.py",
                  "tests/test_golden.py::test_cuda_tensors_reproduce_the_pins",
                  "tests/test_golden.py::test_cuda_default_above_4_ranks_matches_the_cpu")
DRY_RUN_TEST_FILES = ("tests/test_kernels.py", "tests/test_cuda_nosync.py")
OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


@dataclass
class Row:
    step: str
    device: str
    result: str
    status: str
    seconds: float = 0.0


# -- model shapes ---------------------------------------------------------------------------------------------------

def gpt2_shapes(layers: int = 6, d: int = 512, vocab: int = 16384, context: int = 64) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of a transformers GPT2LMHeadModel in its order (the head is tied to wte):
    the DDP benchmark's GPT-2 by default (6 x 512, vocabulary 16384, context 64: 76 tensors, 27.3M elements)."""
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (context, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                   (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
                   (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                   (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                   (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
                   (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,))]
    return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def resnet50_shapes() -> list[tuple[str, tuple]]:
    """(name, shape) of torchvision's ResNet-50 parameters (operations/models.ResNet50, built on the meta device:
    no memory, no time)."""
    from .models import ResNet50
    with torch.device("meta"):
        model = ResNet50()
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


# -- steps ----------------------------------------------------------------------------------------------------------

def run_tests(files, timeout_s: float, root: str = ROOT, log: str | None = None) -> tuple[str, str]:
    """(result, status) of pytest over ``files`` of the checkout at ``root``; pytest's whole output goes to ``log``
    when given (the table keeps only its summary and the first failures)."""
    paths = [os.path.join(root, f) for f in files]                      # a file, or a file::test node id
    missing = [f for f, p in zip(files, paths) if not os.path.exists(p.split("::")[0])]
    if missing:
        return f"not in this tree: {', '.join(missing)} (run from a checkout)", SKIPPED
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", f"timeout={int(timeout_s)}", *paths]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=root, env=env)
    except subprocess.TimeoutExpired as e:
        if log:
            with open(log, "w") as f:
                f.write(str(e.stdout or "") + str(e.stderr or ""))
        return f"pytest did not finish in {timeout_s:.0f} s", FAIL
    if log:
        with open(log, "w") as f:
            f.write(p.stdout + p.stderr)
    lines = [x for x in p.stdout.strip().splitlines() if x.strip()]
    summary = lines[-1].strip("= ") if lines else (p.stderr.strip().splitlines() or ["no output"])[-1]
    if p.returncode == 0:
        return summary, OK
    failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))][:3]
    return summary + ("; " + "; ".join(failed) if failed else ""), FAIL


def _sample(n: int, seed: int) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 10:
        g[n // 3] = 40.0        # an outlier the clip cuts
        g[n // 2] = 0.0
    return g


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (so -0.0 differs from 0.0, and NaNs compare by their bits)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def identity(shapes, backend, device, other, other_device, ranks: int = 2, fmts=("2bit", "base3"),
             bucket_size: int = 0, clip: float = 2.5) -> tuple[int, int, list]:
    """Byte identity of ``backend`` on ``device`` against ``other`` on ``other_device`` over ``shapes``: for every
    tensor and packing, each rank's statistics (threshold, scalers, non-finite flag) and payload, then the decode
    of all ranks' payloads.  Returns (identical cases, cases, the names of the first few that differ)."""
    from .. import codec
    from ..codec import packing
    same = total = 0
    differ = []
    for t_index, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        for fmt in fmts:
            total += 1
            ok = True
            payloads = ([], [])
            for rank in range(ranks):
                g = _sample(n, seed=1000 * t_index + rank) * (rank + 1)
                key = codec.stream_key(7, 3, codec.tensor_id(name), rank)
                outs = []
                for be, dev, store in ((backend, device, payloads[0]), (other, other_device, payloads[1])):
                    gd = g.to(dev)
                    prep = be.prepare(gd, bucket_size, clip)
                    payload = be.encode(gd, prep.threshold, prep.scalers, bucket_size, key, fmt, shape=shape)
                    store.append(payload)
                    outs.append((prep, payload))
                (pa, ya), (pb, yb) = outs
                ok = ok and _same(pa.scalers, pb.scalers) and _same(ya, yb) \
                    and bool(pa.nonfinite) == bool(pb.nonfinite) \
                    and (float(pa.threshold) == float(pb.threshold)
                         or (math.isinf(float(pa.threshold)) and math.isinf(float(pb.threshold))))
            if ok:
                decoded = []
                for be, store in ((backend, payloads[0]), (other, payloads[1])):
                    gathered = torch.cat(store)
                    headers, offsets = packing.walk(gathered, ranks)
                    decoded.append(be.decode(gathered, headers, offsets, ranks))
                ok = _same(decoded[0], decoded[1])
            if ok:
                same += 1
            elif len(differ) < 3:
                differ.append(f"{name} {fmt}")
    return same, total, differ


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device, repeat: int = 5) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def codec_rates(backend, device, numel: int, fmt: str = "2bit") -> dict:
    """GB/s of fp32 through ``backend``'s compress (statistics + encode) and decompress of 2 payloads, and of a copy
    of the same tensor into a preallocated one, on ``device``."""
    from .. import codec
    from ..codec import packing
    g = _sample(numel, 0).to(device)
    dst = torch.empty_like(g)
    gb = 4 * numel / 1e9
    key = codec.stream_key(0, 0, 0, 0)
    copy_s = _best_s(lambda: dst.copy_(g), device)

    def compress():
        prep = backend.prepare(g, 0, 2.5)
        return backend.encode(g, prep.threshold, prep.scalers, 0, key, fmt)

    compress_s = _best_s(compress, device)
    payload = compress()
    gathered = torch.cat([payload, payload])
    headers, offsets = packing.walk(gathered, 2)
    decompress_s = _best_s(lambda: backend.decode(gathered, headers, offsets, 2, out=dst), device)
    return {"copy_gbs": gb / copy_s, "compress_gbs": gb / compress_s, "decompress_gbs": gb / decompress_s}


def optimizer_step_ms(shapes, device, steps: int = 10) -> dict:
    """Median ms of ``horovod_terngrad.optim.AdamW.step()`` on a ternary gradient with its noise estimate (each step:
    the exchange's record and estimate, as a frontend hands them over), and of ``torch.optim.AdamW.step()``, on
    parameters of ``shapes``."""
    from ..exchange import precision
    from ..optim import AdamW
    gen = torch.Generator().manual_seed(0)

    def params():
        ps = []
        for _, shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(device))
            p.grad = torch.randn(shape, generator=gen).mul_(1e-3).to(device)
            ps.append(p)
        return ps

    hp = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tg_params, torch_params = params(), params()
    tg_opt, torch_opt = AdamW(tg_params, **hp), torch.optim.AdamW(torch_params, foreach=True, **hp)
    noises = [p.grad.abs() * 1e-3 for p in tg_params]

    ledger = tg_opt.precision_ledger

    def tg_step():
        for p, noise in zip(tg_params, noises):           # what an exchange records and hands over (precision.py)
            ledger.set_record(p, precision.TERNARY)
            ledger.put_noise(p, noise, p.grad)
        tg_opt.step()

    times = {"tg": [], "torch": []}
    for _ in range(2):                                    # warm-up: state allocation, kernels' first launch
        tg_step()
        torch_opt.step()
    _sync(device)
    for _ in range(steps):
        for key, fn in (("tg", tg_step), ("torch", torch_opt.step)):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[key].append(time.perf_counter() - t0)
    ternary = sum(1 for p in tg_params if float(tg_opt.state[p].get("ternary_steps", torch.zeros(()))) > 0)
    return {"tg_ms": 1e3 * statistics.median(times["tg"]), "torch_ms": 1e3 * statistics.median(times["torch"]),
            "ternary_params": ternary, "params": len(tg_params)}


def _two_rank_worker(rank: int, world: int, init_file: str, device_type: str, steps: int, out_dir: str) -> None:
    """One of the 2 ranks: the DDP hook and TernGrad's AdamW on a small MLP, on the one device (gloo)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import ddp as tg_ddp
    from ..optim import AdamW
    result = {"rank": rank}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(0)                                           # the same initial parameters on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
        ddp = DDP(model, device_ids=[0] if device_type == "cuda" else None)
        state = tg_ddp.register(ddp, min_numel=4096)
        opt = AdamW(ddp.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(100 + rank)                # each rank its own data
        losses, t0 = [], time.perf_counter()
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=gen).to(device), torch.randint(0, 8, (32,), generator=gen).to(device)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        code = 0
        for p in model.parameters():
            code = zlib.crc32(p.detach().cpu().numpy().tobytes(), code)
        result.update(losses=losses, checksum=code, ms_per_step=1e3 * elapsed / steps,
                      bits_per_element=state.stats.bits_per_element(), tensors=state.stats.tensors)
        dist.barrier()
    except Exception:  # noqa: BLE001 - the error is this step's result
        result["error"] = traceback.format_exc(limit=4)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def two_ranks(device_type: str, steps: int = 10, timeout_s: float = 120) -> dict:
    """Spawn 2 processes on this machine's one device and return their results (rank order)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="tg_gpu_check_") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_two_rank_worker, args=(r, 2, init_file, device_type, steps, tmp))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:
            return {"error": f"the 2 ranks did not finish in {timeout_s:.0f} s"}
        ranks = []
        for r in range(2):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                return {"error": f"rank {r} exited with {procs[r].exitcode} before writing its result"}
            with open(path) as f:
                ranks.append(json.load(f))
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0].strip().splitlines()[-1], "trace": errors[0]}
    return {"ranks": ranks}


# -- the check ------------------------------------------------------------------------------------------------------

def _timed_row(step: str, device: str, fn) -> Row:
    t0 = time.perf_counter()
    try:
        result, status = fn()
    except Exception as e:  # noqa: BLE001 - a failing step is a FAIL row, the others still run
        result, status = f"{type(e).__name__}: {e}".splitlines()[0][:300], FAIL
    return Row(step, device, result, status, time.perf_counter() - t0)


def check(dry_run: bool, budget_s: float = 420.0, run_test_files: bool = True,
          pytest_log: str | None = None) -> tuple[str, list[Row]]:
    """Run every step; returns (the heading, the rows)."""
    from .. import backends
    gpu = torch.cuda.is_available() and not dry_run
    if gpu:
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(device)
        heading = f"gpu_check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
        device_label = "cuda"
        kernels = backends.cuda_kernels()
        backend = kernels if kernels is not None else backends.REFERENCE
        backend_label = "CuPy kernels" if kernels is not None else "torch reference on the GPU (CuPy missing)"
        other, other_device, other_label = backends.cpu_fused() or backends.REFERENCE, torch.device("cpu"), "CPU"
        gpt2, numel, opt_shapes = gpt2_shapes(), 1 << 26, gpt2_shapes()
        test_files, test_timeout = GPU_TEST_FILES, 0.5 * budget_s
    else:
        why = "--dry-run" if torch.cuda.is_available() else "no GPU"
        heading = f"gpu_check: CPU dry run ({why}; torch {torch.__version__}): GPU steps run on the CPU backends"
        device = torch.device("cpu")
        device_label = "cpu (no GPU)" if why == "no GPU" else "cpu (dry run)"
        fused = backends.cpu_fused()
        backend = fused if fused is not None else backends.REFERENCE
        backend_label = "fused CPU" if fused is not None else "torch reference (the fused CPU codec did not build)"
        other, other_device, other_label = backends.REFERENCE, torch.device("cpu"), "torch reference"
        # a 4 x 256 GPT-2 (vocabulary 256: the HSDP benchmark's) keeps the 2-core dry run short; ResNet-50 is whole
        gpt2, numel, opt_shapes = gpt2_shapes(4, 256, 256, 64), 1 << 22, gpt2_shapes(4, 256, 256, 64)
        test_files, test_timeout = DRY_RUN_TEST_FILES, 0.4 * budget_s
    rows = []
    if run_test_files:
        rows.append(_timed_row("tests", device_label, lambda: run_tests(test_files, test_timeout, log=pytest_log)))
    else:
        rows.append(Row("tests", device_label, "not asked for (--no-tests)", SKIPPED))

    def identity_step(shapes, label):
        def run():
            same, total, differ = identity(shapes, backend, device, other, other_device)
            elements = sum(math.prod(s) for _, s in shapes)
            text = (f"{backend_label} = {other_label}: {same}/{total} tensor x packing cases identical "
                    f"({len(shapes)} tensors, {elements / 1e6:.1f}M elements, 2 ranks, 2bit and base3)")
            return (text + (f"; differ: {', '.join(differ)}" if differ else "")), (OK if same == total else FAIL)
        return _timed_row(f"identity {label}", device_label, run)

    rows.append(identity_step(gpt2, "gpt2"))
    rows.append(identity_step(resnet50_shapes(), "resnet50"))

    def codec_step():
        r = codec_rates(backend, device, numel)
        return (f"{backend_label}, {numel / 1e6:.0f}M fp32: compress {r['compress_gbs']:.2f} GB/s "
                f"({100 * r['compress_gbs'] / r['copy_gbs']:.0f}% of copy), decompress N=2 {r['decompress_gbs']:.2f} "
                f"GB/s ({100 * r['decompress_gbs'] / r['copy_gbs']:.0f}%); device copy {r['copy_gbs']:.2f} GB/s"), OK
    rows.append(_timed_row("codec", device_label, codec_step))

    def optimizer_step():
        r = optimizer_step_ms(opt_shapes, device)
        ok = r["ternary_params"] == r["params"]
        return (f"tg AdamW {r['tg_ms']:.2f} ms/step, torch AdamW {r['torch_ms']:.2f} ms "
                f"({r['tg_ms'] / r['torch_ms']:.2f}x) on {r['params']} GPT-2 tensors; "
                f"{r['ternary_params']} took the ternary path"), (OK if ok else FAIL)
    rows.append(_timed_row("optimizer", device_label, optimizer_step))

    def ranks_step():
        r = two_ranks("cuda" if gpu else "cpu")
        if "error" in r:
            return f"{r['error']}"[:300], FAIL
        r0, r1 = r["ranks"]
        finite = all(math.isfinite(v) for v in r0["losses"] + r1["losses"])
        same = r0["checksum"] == r1["checksum"]
        text = (f"DDP hook + tg AdamW, gloo, {len(r0['losses'])} steps: losses finite {finite}, parameters "
                f"identical {same}, {r0['bits_per_element']:.2f} bits/element, {r0['ms_per_step']:.1f} ms/step")
        return text, (OK if finite and same else FAIL)
    rows.append(_timed_row("2 ranks", "cuda:0 x 2" if gpu else f"{device_label} x 2", ranks_step))
    return heading, rows


def table(heading: str, rows: list[Row]) -> str:
    lines = [heading, "", "| step | device | result | status | s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.step} | {r.device} | {r.result.replace('|', '/')} | {r.status} | {r.seconds:.1f} |")
    failed = [r.step for r in rows if r.status == FAIL]
    lines += ["", f"gpu_check: {len(rows) - len(failed)} of {len(rows)} steps passed or skipped"
              + (f"; FAILED: {', '.join(failed)}" if failed else "")]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the CPU dry run even where a GPU is")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the pytest step")
    p.add_argument("--budget-s", type=float, default=420.0, help="time for the whole check (the tests' share)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--pytest-log", default=None, help="write the tests step's whole pytest output here")
    args = p.parse_args(argv)
    heading, rows = check(args.dry_run, args.budget_s, args.tests, args.pytest_log)
    print(table(heading, rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heading": heading, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
