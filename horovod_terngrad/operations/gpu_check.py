"""One check of a GPU machine, in one call (scripts/gpu_check.sh), printing one table.

    python -m horovod_terngrad.operations.gpu_check               # on a GPU; a CPU dry run where there is none
    python -m horovod_terngrad.operations.gpu_check --dry-run     # the CPU dry run, GPU or not

Steps, each one row of the table:

1. ``tests``: the CUDA tests of the checkout (tests/test_kernels.py, tests/test_backends.py,
   tests/test_cuda_nosync.py, tests/test_adam_kernel.py (the optimizer's kernel against its host build), and
   tests/test_golden.py's CUDA tests: every exchange's pinned bytes and averages
   from CUDA tensors, and the default above 4 ranks against the CPU) under pytest.  Dry run: test_kernels.py (its
   CUDA sources built for the host) and test_cuda_nosync.py, whose CUDA tests skip.
2. ``identity <model>``: byte identity of the device backend against a CPU backend on a model's real tensor
   shapes (GPT-2 in GPT2LMHeadModel's layout, ResNet-50 in torchvision's): per tensor, two ranks' statistics,
   encoded payloads (both packings) and the decode of both payloads must be bit for bit the same.  On a GPU: the
   CUDA backend (CuPy kernels, or the torch reference on the GPU where CuPy is missing) against the fused CPU
   backend.  Dry run: the fused CPU backend against the torch reference.
3. ``kernels``: the kernel table.  Each codec path (``KERNEL_PATHS``: compress = prepare + encode of fp32 and of
   bf16 gradients, 2bit and base3; decode of 2 and of 8 payloads) on single tensors of 16M, 64M and 256M elements
   and on GPT-2 124M's and ResNet-50's gradients cut into the frontends' fused groups, one call per member as the
   engine makes them.  Per row: the bytes the kernel must move per element (``traffic``), the GPU time (CUDA
   events) and the wall time per call, elements/s, GB/s moved and the fraction of the device's copy bandwidth,
   measured in the same call (a copy of B bytes moves 2B); goal: 70%.  Dry run: the host build of the CUDA
   kernels at 64K and 256K elements, a 12 x 128 GPT-2 (148 tensors) and ResNet-50's tensors at 1/16.
4. ``optimizer``: ``horovod_terngrad.optim.AdamW``'s step on GPT-2 124M's 148 tensors with a ternary gradient and
   its noise estimate (what every frontend hands over), beside ``torch.optim.AdamW``'s fused and foreach steps.
5. ``train step``: one GPU's GPT-2 124M step (bf16 autocast, 8 x 1024 tokens; forward, backward, torch's fused
   AdamW), and what TernGrad adds: the codec at N = 8 (8 thread-ranks through ``exchange.Engine`` on the one
   device, one rank's share of the device time) plus ``optim.AdamW``'s step less torch's fused one; goal: 5%.
6. ``2 ranks``: two processes on the one device (gloo; on a GPU over CUDA tensors), the DDP hook and
   ``horovod_terngrad.optim.AdamW`` for a few steps: losses finite, the ranks' parameters identical.

A step that fails is marked FAIL (with its error) and the others still run; the exit status is 1 when any step
failed, else 0 (a CPU dry run that passes exits 0).  Every step has its share of ``--budget-s`` (``STEP_BUDGET_S``;
default 420 s, scripts/gpu_check.sh stops the whole call at 480 s): the tests, the kernel table, the thread-ranks
and the 2 ranks stop at theirs; the other steps' sizes fit theirs.  ``--json`` writes
every figure (docs/gpu/*.json; scripts/render_docs.py renders docs/gpu.md and the performance model's GPU rows from
the newest a GPU wrote).
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
                  "tests/test_adam_kernel.py", "tests/test_golden.py::test_cuda_tensors_reproduce_the_pins",
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


# -- timing ---------------------------------------------------------------------------------------------------------

def traffic_formula(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """Bytes a codec kernel must move per gradient element, reads and writes counted (a copy moves 2 per byte):
    compress (statistics, then ternarize + pack: two passes over the input) 2·in_bytes + the code's bytes (1/4 in
    2bit, 1/5 in base3); decode of ``payloads`` payloads: their codes + 4 (fp32 written).  Used where the kernels'
    own ``backends.cuda.traffic`` is missing; the two agree (tests/test_gpu_check.py)."""
    code = {"2bit": 1 / 4, "base3": 1 / 5}.get(fmt)
    if code is None:
        raise ValueError(f"traffic: fmt must be '2bit' or 'base3', got {fmt!r}")
    if op == "compress":
        return 2.0 * in_bytes + code
    if op == "decode":
        return payloads * code + 4.0
    raise ValueError(f"traffic: op must be 'compress' or 'decode', got {op!r}")


def traffic(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """``horovod_terngrad.backends.cuda.traffic`` where the checkout has it, else :func:`traffic_formula`."""
    from ..backends import cuda
    fn = getattr(cuda, "traffic", None) or traffic_formula
    return float(fn(op, in_bytes=in_bytes, fmt=fmt, payloads=payloads))


class Timer:
    """Seconds per call on ``device``: ``wall`` (host clock, the call and a synchronization: what a caller waits,
    host overhead included) and ``gpu`` (CUDA events; None on the CPU).  The GPU figure queues the calls behind a
    wait kernel long enough for the host to enqueue them all, so the events span only the device's work, not the
    host's launch gaps; ``queued`` says whether that held (the wait was still running when the last call was
    enqueued).  Where it did not (a call that makes the host wait for the device), the span is an upper bound."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        if not hasattr(torch.cuda, "_sleep"):
            return 0.0
        cycles = 10_000_000
        torch.cuda._sleep(cycles)                     # first launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(1e-6, start.elapsed_time(end) / 1e3)

    def wall(self, fn, repeat: int) -> float:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
        return best

    def gpu(self, fn, repeat: int, host_s: float) -> tuple[float | None, bool | None]:
        """(seconds per call from CUDA events, queued) for ``repeat`` calls in a row; ``host_s``: the wall time of
        one call (sizes the wait).  (None, None) on the CPU."""
        if not self.cuda:
            return None, None
        _sync(self.device)
        if self.cycles_per_s:
            wait_s = min(10.0, 1.5 * host_s * repeat + 0.005)
            torch.cuda._sleep(int(wait_s * self.cycles_per_s))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        queued = bool(self.cycles_per_s) and not start.query()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat, queued

    def measure(self, fn, repeat: int) -> dict:
        """{"wall_s", "gpu_s", "queued", "s"}: one warm-up call, the best wall of ``repeat``, then the GPU time
        of ``repeat`` in a row; ``s`` is the GPU time where there is one, else the wall time."""
        fn()
        _sync(self.device)
        wall = self.wall(fn, repeat)
        gpu, queued = self.gpu(fn, repeat, wall)
        return {"wall_s": wall, "gpu_s": gpu, "queued": queued, "s": gpu if gpu is not None else wall}


def copy_rate(device, numel: int, timer: Timer, repeat: int) -> dict:
    """The device's copy bandwidth: ``dst.copy_(src)`` of ``numel`` fp32 elements; a copy of B bytes moves 2B
    (read and write), and ``moved_gbs`` counts both."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = timer.measure(lambda: dst.copy_(src), repeat)
    return {"elements": numel, "moved_gbs": 8 * numel / t["s"] / 1e9, "s": t["s"], "wall_s": t["wall_s"]}


# -- the kernel table -----------------------------------------------------------------------------------------------

# each codec path of the table: (name, op, input dtype, packing, payloads)
KERNEL_PATHS = (("compress fp32 2bit", "compress", torch.float32, "2bit", 1),
                ("compress bf16 2bit", "compress", torch.bfloat16, "2bit", 1),
                ("compress fp32 base3", "compress", torch.float32, "base3", 1),
                ("compress bf16 base3", "compress", torch.bfloat16, "base3", 1),
                ("decode N=2 2bit", "decode", torch.float32, "2bit", 2),
                ("decode N=8 2bit", "decode", torch.float32, "2bit", 8),
                ("decode N=2 base3", "decode", torch.float32, "base3", 2),
                ("decode N=8 base3", "decode", torch.float32, "base3", 8))
GOAL_OF_COPY = 0.70


@dataclass
class Target:
    """What a kernel row runs on: one tensor (``groups`` = [[n]]) or a model's compressed gradients cut into the
    frontends' fused groups (``exchange/fusion.py``), each member its own prepare / encode / decode as the
    engine runs them (``exchange/engine.py``'s ``start_group``)."""

    name: str
    groups: list            # [[numel of each member] per group], backward order
    tensors: int            # the model's tensors, compressed or not

    @property
    def elements(self) -> int:
        return sum(sum(g) for g in self.groups)

    @property
    def members(self) -> list:
        return [n for g in self.groups for n in g]


def size_target(numel: int) -> Target:
    label = f"{numel >> 20}M" if numel >= 1 << 20 else f"{numel >> 10}K"
    return Target(label, [[numel]], 1)


def model_target(label: str, shapes) -> Target:
    """``shapes`` (registration order) cut as the Horovod frontend cuts them with the default settings."""
    from ..config import TernGradConfig
    from ..exchange import fusion
    names = [n for n, _ in shapes]
    sizes = [math.prod(s) for _, s in shapes]
    plan = fusion.cut_sizes(sizes, TernGradConfig(), names)
    numel = dict(zip(names, sizes))
    groups = len(plan.groups)
    return Target(f"{label} ({len(shapes)} tensors, {groups} group{'s' if groups != 1 else ''})",
                  [[numel[n] for n in g] for g in plan.groups], len(shapes))


def reads_bf16(backend) -> bool:
    """Whether ``backend`` reads bf16 gradients itself (``BF16_INPUT``); otherwise the engine casts them to fp32
    first, and so does the table.  Never probed with a bf16 tensor: a kernel that reads fp32 would run past the
    tensor's end."""
    from .. import backends
    return backends.has_capability(backend, backends.BF16_INPUT)


def kernel_rows(backend, device, targets, timer: Timer, copy_gbs: float, repeat: int, budget_s: float,
                seed: int = 0) -> list[dict]:
    """One row per (codec path, target): bytes per element, GPU and wall ms per call, elements/s, GB/s moved and
    the fraction of the device's copy bandwidth.  Rows past ``budget_s`` are left out with status "skipped"."""
    from .. import codec
    from ..codec import packing
    t_start = time.perf_counter()
    direct_bf16 = reads_bf16(backend)
    rows = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for target in targets:
        # every member its own allocation, as every parameter's gradient is (aligned as the allocator aligns them)
        fp32 = [torch.randn(n, device=device, generator=gen) for n in target.members]
        bf16 = [g.to(torch.bfloat16) for g in fp32]
        keys = [codec.stream_key(7, 3, i, 0) for i in range(len(target.members))]
        payloads = {}
        for name, op, dtype, fmt, n_pay in KERNEL_PATHS:
            row = {"kernel": name, "op": op, "dtype": str(dtype).replace("torch.", ""), "fmt": fmt,
                   "payloads": n_pay, "target": target.name, "elements": target.elements,
                   "tensors": target.tensors, "members": len(target.members)}
            rows.append(row)
            if time.perf_counter() - t_start > budget_s:
                row.update(status=SKIPPED, note=f"past the step's {budget_s:.0f} s")
                continue
            views = fp32 if dtype == torch.float32 else bf16
            in_bytes = views[0].element_size()
            if op == "compress":
                cast = dtype != torch.float32 and not direct_bf16

                def fn(views=views, fmt=fmt, cast=cast):
                    for v, key in zip(views, keys):
                        g = v.to(torch.float32) if cast else v            # the engine's cast
                        prep = backend.prepare(g, 0, 2.5)
                        backend.encode(g, prep.threshold, prep.scalers, 0, key, fmt)
                row["path"] = ("cast to fp32 first" if cast else f"reads {row['dtype']}")
                row["bytes_per_element"] = traffic("compress", in_bytes=in_bytes, fmt=fmt)
            else:
                if fmt not in payloads:
                    payloads[fmt] = []
                    for v, key in zip(views, keys):
                        prep = backend.prepare(v, 0, 2.5)
                        payloads[fmt].append(backend.encode(v, prep.threshold, prep.scalers, 0, key, fmt))
                gathered = [torch.cat([y] * n_pay) for y in payloads[fmt]]
                walked = [packing.walk(g, n_pay) for g in gathered]
                outs = [torch.empty(n, device=device) for n in target.members]

                def fn(gathered=gathered, walked=walked, outs=outs, n_pay=n_pay):
                    for g, (headers, offsets), o in zip(gathered, walked, outs):
                        backend.decode(g, headers, offsets, n_pay, out=o)
                row["path"] = f"{n_pay} payloads"
                row["bytes_per_element"] = traffic("decode", fmt=fmt, payloads=n_pay)
            t = timer.measure(fn, repeat)
            n = target.elements
            gbs = row["bytes_per_element"] * n / t["s"] / 1e9
            row.update(status=OK, gpu_ms=None if t["gpu_s"] is None else 1e3 * t["gpu_s"],
                       wall_ms=1e3 * t["wall_s"], queued=t["queued"], gelem_s=n / t["s"] / 1e9, gbs=gbs,
                       of_copy=gbs / copy_gbs)
            del fn
        del fp32, bf16, payloads
    return rows


def codec_profile(rows: list[dict], device_name: str) -> dict | None:
    """The performance model's GPU profile from the kernel table: elements/s of the fp32 2bit compress and of the
    2-payload decode (per element written), on the largest single tensor measured."""
    def best(kernel):
        ok = [r for r in rows if r["kernel"] == kernel and r.get("status") == OK and r["tensors"] == 1]
        return max(ok, key=lambda r: r["elements"]) if ok else None
    c, d, d8 = best("compress fp32 2bit"), best("decode N=2 2bit"), best("decode N=8 2bit")
    if c is None or d is None:
        return None
    prof = {"device": device_name, "compress_elements_per_s": 1e9 * c["gelem_s"],
            "decode_elements_per_s": 1e9 * d["gelem_s"],
            "source": f"gpu_check kernel table: compress fp32 2bit and decode N=2 2bit on {c['target']} elements"}
    if d8 is not None:
        prof["decode8_elements_per_s"] = 1e9 * d8["gelem_s"]
    return prof


# -- the optimizer --------------------------------------------------------------------------------------------------

def optimizer_step_ms(shapes, device, timer: Timer | None = None, steps: int = 10) -> dict:
    """ms per step of ``horovod_terngrad.optim.AdamW`` on a ternary gradient with its noise estimate (each step
    the exchange's record and estimate, as a frontend hands them over: included), and of ``torch.optim.AdamW``
    fused and foreach, on parameters of ``shapes``: GPU time (wall on the CPU), and wall time."""
    from ..exchange import precision
    from ..optim import AdamW
    timer = timer or Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def params():
        ps = []
        for _, shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen).mul_(0.02))
            p.grad = torch.randn(shape, device=device, generator=gen).mul_(1e-3)
            ps.append(p)
        return ps

    hp = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tg_params = params()
    tg_opt = AdamW(tg_params, **hp)
    noises = [p.grad.abs() * 1e-3 for p in tg_params]
    ledger = tg_opt.precision_ledger

    def tg_step():
        for p, noise in zip(tg_params, noises):           # what an exchange records and hands over (precision.py)
            ledger.set_record(p, precision.TERNARY)
            ledger.put_noise(p, noise, p.grad)
        tg_opt.step()

    out = {"params": len(tg_params), "elements": sum(p.numel() for p in tg_params)}
    t = timer.measure(tg_step, steps)
    out.update(tg_ms=1e3 * t["s"], tg_wall_ms=1e3 * t["wall_s"])
    out["ternary_params"] = sum(1 for p in tg_params
                                if float(tg_opt.state[p].get("ternary_steps", torch.zeros(()))) > 0)
    for kind in ("fused", "foreach"):
        ps = params()
        try:
            opt = torch.optim.AdamW(ps, **hp, **{kind: True})
            t = timer.measure(opt.step, steps)
            out.update({f"{kind}_ms": 1e3 * t["s"], f"{kind}_wall_ms": 1e3 * t["wall_s"]})
        except (RuntimeError, ValueError) as e:       # a torch without the fused step on this device
            out[f"{kind}_ms"] = None
            out[f"{kind}_error"] = str(e).splitlines()[0][:200]
    return out


# -- a training step ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPT2Size:
    layers: int
    d: int
    heads: int
    vocab: int
    context: int

    def shapes(self):
        return gpt2_shapes(self.layers, self.d, self.vocab, self.context)


GPT2_124M = GPT2Size(12, 768, 12, 50257, 1024)
GPT2_DRY_RUN = GPT2Size(12, 128, 4, 256, 64)        # 148 tensors, 2.5M elements: the CPU dry run's stand-in


def compute_step_ms(size: GPT2Size, device, batch: int, timer: Timer, steps: int = 5) -> dict:
    """One rank's compute of a GPT-2 step: forward and backward under bf16 autocast, then torch's fused AdamW
    (foreach where fused is missing), on ``batch`` sequences of the whole context."""
    from .models import gpt2_lm
    torch.manual_seed(0)
    model, source = gpt2_lm(size.layers, size.d, size.heads, size.vocab, size.context)
    model = model.to(device)
    try:
        opt, opt_kind = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "fused"
    except (RuntimeError, ValueError):
        opt, opt_kind = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), "foreach"
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, size.vocab, (batch, size.context + 1), device=device, generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, size.vocab), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = timer.measure(step, steps)
    n = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    return {"compute_ms": 1e3 * t["s"], "compute_wall_ms": 1e3 * t["wall_s"], "queued": t["queued"],
            "model": source, "params": n, "tensors": tensors, "batch": batch, "tokens": batch * size.context,
            "optimizer": opt_kind}


def codec_share_ms(shapes, device, timer: Timer, ranks: int = 8, steps: int = 2, timeout_s: float = 120.0) -> dict:
    """The codec's time for one rank's share of a step: ``ranks`` thread-ranks (``exchange.ThreadWorld``, buffers
    shared, not copied: the transport is not the codec's) each average the gradients of ``shapes`` with the
    default settings, cut into the frontend's fused groups, through ``exchange.Engine``; the device time of
    ``steps`` steps divided by ranks and steps.  All ranks must decode the same averages."""
    import threading

    from ..config import TernGradConfig
    from ..exchange import Engine, ThreadWorld, fusion
    cfg = TernGradConfig()
    names = [n for n, _ in shapes]
    sizes = [math.prod(s) for _, s in shapes]
    plan = fusion.cut_sizes(sizes, cfg, names)
    grads = []
    for r in range(ranks):                                # every gradient its own allocation, as a parameter's
        gen = torch.Generator(device=device).manual_seed(100 + r)
        grads.append({n: torch.randn(s, device=device, generator=gen).mul_(1e-3) for n, s in zip(names, sizes)})
    world = ThreadWorld(ranks, copy=False)
    engines = [Engine(c, cfg) for c in world.ranks()]
    digests: list = [None] * ranks

    def one_rank(r, n_steps):
        ex = engines[r]
        for _ in range(n_steps):
            tickets = []
            for i, grp in enumerate(plan.groups):
                items = [(grads[r][n], n) for n in grp]
                tickets += ex.start_group(items, grp[0] if len(grp) == 1 else f"fused.{i}")
            outs = [ex.finish(t) for t in tickets]
        digests[r] = [float(o.double().sum()) for o in outs[:3]] if n_steps else None

    def all_ranks(n_steps):
        errors: list = [None] * ranks

        def body(r):
            try:
                one_rank(r, n_steps)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                raise TimeoutError(f"a thread-rank did not finish in {timeout_s:.0f} s")
        for e in errors:
            if e is not None:
                raise e

    t0 = time.perf_counter()
    all_ranks(1)                                          # warm-up: the first step of every tensor
    _sync(device)
    host_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if timer.cuda:
        gpu, queued = timer.gpu(lambda: all_ranks(steps), 1, host_s * steps)
    else:
        gpu, queued = None, None
        all_ranks(steps)
    _sync(device)
    wall = time.perf_counter() - t0
    s = gpu if gpu is not None else wall
    busy = device_busy_s(lambda: all_ranks(1), device) if timer.cuda else None
    same = all(d == digests[0] for d in digests)
    out = {"span_ms_per_rank": 1e3 * s / (ranks * steps), "wall_ms_per_step": 1e3 * wall / steps,
           "queued": queued, "ranks": ranks, "steps": steps, "groups": len(plan.groups),
           "compressed_elements": sum(plan.numel.values()), "same_on_every_rank": same,
           "busy_ms_per_rank": None if busy is None else 1e3 * busy / ranks}
    # the device's busy time where the profiler gives it (the span also counts the device waiting for 8 threads'
    # launches), else the span of CUDA events, else (CPU) the wall time of all ranks
    if busy is not None:
        out.update(codec_ms_per_rank=out["busy_ms_per_rank"], measured="device busy time (torch.profiler)")
    else:
        out.update(codec_ms_per_rank=out["span_ms_per_rank"],
                   measured="CUDA events" if gpu is not None else "wall time of all ranks")
    return out


def device_busy_s(fn, device) -> float | None:
    """Seconds the device spent in kernels, copies and fills during ``fn()`` (torch.profiler's CUDA activity, every
    thread's), or None where the profiler cannot say."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - no CUPTI, an older profiler: the events' span stands
        return None
    return us / 1e6 if us > 0 else None


def _rounded(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


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


STEPS = ("tests", "identity gpt2", "identity resnet50", "kernels", "optimizer", "train step", "2 ranks")
# the steps' shares of --budget-s (seconds at the default 420; scaled with it): each step stops itself in time
# (on one H100: tests about 64 s, the rest under 15 s each; the 2 ranks' share is what a loaded 2-core dry run needs)
STEP_BUDGET_S = {"tests": 140, "identity": 30, "kernels": 60, "optimizer": 20, "train step": 60, "2 ranks": 90}


@dataclass
class Plan:
    """What one run measures, on a GPU or in the CPU dry run."""

    gpu: bool
    sizes: tuple                # the single-tensor targets of the kernel table
    gpt2: GPT2Size              # the kernel table's, the optimizer's and the training step's GPT-2
    resnet50_scale: int         # ResNet-50's tensors at 1/scale of their elements in the kernel table
    identity_gpt2: tuple        # gpt2_shapes arguments of the identity step
    copy_elements: int
    repeat: int
    batch: int
    train_steps: int


GPU_PLAN = Plan(True, (1 << 24, 1 << 26, 1 << 28), GPT2_124M, 1, (), 1 << 28, 10, 8, 5)
DRY_RUN_PLAN = Plan(False, (1 << 16, 1 << 18), GPT2_DRY_RUN, 16, (4, 256, 256, 64), 1 << 23, 2, 2, 2)


def scaled_resnet50(scale: int):
    return [(n, s if scale == 1 else (max(1, math.prod(s) // scale),)) for n, s in resnet50_shapes()]


def check(dry_run: bool, budget_s: float = 420.0, run_test_files: bool = True,
          pytest_log: str | None = None) -> tuple[str, list[Row], dict]:
    """Run every step; returns (the heading, the rows, the measurements for the JSON)."""
    from .. import backends
    gpu = torch.cuda.is_available() and not dry_run
    share = {k: v * budget_s / 420.0 for k, v in STEP_BUDGET_S.items()}
    info: dict = {"schema": 2, "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "torch": torch.__version__, "budget_s": budget_s, "step_budget_s": share}
    if gpu:
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(device)
        info.update(device=name, cuda=torch.version.cuda)
        heading = f"gpu_check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
        device_label = "cuda"
        kernels = backends.cuda_kernels()
        backend = kernels if kernels is not None else backends.REFERENCE
        backend_label = "CuPy kernels" if kernels is not None else "torch reference on the GPU (CuPy missing)"
        table_backend, table_label = backend, backend_label
        other, other_device, other_label = backends.cpu_fused() or backends.REFERENCE, torch.device("cpu"), "CPU"
        plan, gpt2 = GPU_PLAN, gpt2_shapes()
        test_files = GPU_TEST_FILES
    else:
        why = "--dry-run" if torch.cuda.is_available() else "no GPU"
        heading = f"gpu_check: CPU dry run ({why}; torch {torch.__version__}): GPU steps run on the CPU backends"
        info.update(device=f"CPU dry run ({why})", cuda=None)
        device = torch.device("cpu")
        device_label = "cpu (no GPU)" if why == "no GPU" else "cpu (dry run)"
        fused = backends.cpu_fused()
        backend = fused if fused is not None else backends.REFERENCE
        backend_label = "fused CPU" if fused is not None else "torch reference (the fused CPU codec did not build)"
        try:                                          # the CUDA source and driver, built for the host
            from ..backends.cuda import KernelBackend
            from ..backends.host_build import HostKernels
            table_backend, table_label = KernelBackend(HostKernels()), "host build of the CUDA kernels"
        except Exception as e:  # noqa: BLE001 - no compiler: the table runs on the CPU backend
            table_backend, table_label = backend, f"{backend_label} (host build failed: {type(e).__name__})"
        other, other_device, other_label = backends.REFERENCE, torch.device("cpu"), "torch reference"
        plan, gpt2 = DRY_RUN_PLAN, gpt2_shapes(*DRY_RUN_PLAN.identity_gpt2)
        test_files = DRY_RUN_TEST_FILES
    info["backend"], info["table_backend"] = backend_label, table_label
    timer = Timer(device)
    rows = []
    if run_test_files:
        rows.append(_timed_row("tests", device_label,
                               lambda: run_tests(test_files, share["tests"], log=pytest_log)))
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

    def kernels_step():
        copy = copy_rate(device, plan.copy_elements, timer, plan.repeat)
        info["copy"] = copy
        targets = [size_target(n) for n in plan.sizes]
        targets += [model_target("GPT-2 124M" if plan.gpu else "GPT-2 12x128", plan.gpt2.shapes()),
                    model_target("ResNet-50" if plan.resnet50_scale == 1 else f"ResNet-50 at 1/{plan.resnet50_scale}",
                                 scaled_resnet50(plan.resnet50_scale))]
        krows = kernel_rows(table_backend, device, targets, timer, copy["moved_gbs"], plan.repeat, share["kernels"])
        info["kernels"] = krows
        prof = codec_profile(krows, info["device"])
        if prof is not None and plan.gpu:
            info["codec_profile"] = prof
        done = [r for r in krows if r["status"] == OK]
        if not done:
            return "no kernel row finished in the step's budget", FAIL
        worst, best = min(done, key=lambda r: r["of_copy"]), max(done, key=lambda r: r["of_copy"])
        met = sum(r["of_copy"] >= GOAL_OF_COPY for r in done)
        skipped = len(krows) - len(done)
        return (f"{table_label}: {len(done)} rows ({len(KERNEL_PATHS)} paths x {len(targets)} targets"
                + (f", {skipped} past the budget" if skipped else "")
                + f"), {GOAL_OF_COPY:.0%} of copy met by {met}; {worst['of_copy']:.0%} ({worst['kernel']}, "
                f"{worst['target']}) to {best['of_copy']:.0%} ({best['kernel']}, {best['target']}); device copy "
                f"{copy['moved_gbs']:.1f} GB/s moved"), OK
    rows.append(_timed_row("kernels", device_label, kernels_step))

    def optimizer_step():
        r = optimizer_step_ms(plan.gpt2.shapes(), device, timer)
        info["optimizer"] = r
        ok = r["ternary_params"] == r["params"]
        ref = r.get("fused_ms") or r.get("foreach_ms")
        vs = (f"torch fused {r['fused_ms']:.2f} ms ({r['tg_ms'] / r['fused_ms']:.2f}x)" if r.get("fused_ms")
              else "torch fused: " + r.get("fused_error", "none"))
        return (f"tg AdamW {r['tg_ms']:.2f} ms/step, {vs}, foreach "
                + (f"{r['foreach_ms']:.2f} ms" if r.get("foreach_ms") else "none")
                + f" on {r['params']} GPT-2 tensors ({r['elements'] / 1e6:.1f}M); "
                f"{r['ternary_params']} took the ternary path"), (OK if ok and ref else FAIL)
    rows.append(_timed_row("optimizer", device_label, optimizer_step))

    def train_step():
        c = compute_step_ms(plan.gpt2, device, plan.batch, timer, plan.train_steps)
        k = codec_share_ms(plan.gpt2.shapes(), device, timer, ranks=8, steps=2, timeout_s=share["train step"])
        opt = info.get("optimizer") or {}
        ref = opt.get("fused_ms") or opt.get("foreach_ms")
        opt_added = max(0.0, opt["tg_ms"] - ref) if ref and "tg_ms" in opt else None
        added = k["codec_ms_per_rank"] + (opt_added or 0.0)
        r = {**c, **k, "optimizer_added_ms": opt_added, "added_ms": added,
             "added_fraction": added / c["compute_ms"]}
        info["train_step"] = r
        text = (f"{c['model']}, {c['params'] / 1e6:.1f}M in {c['tensors']} tensors, {c['batch']} x "
                f"{c['tokens'] // c['batch']} tokens, bf16 autocast: compute {c['compute_ms']:.1f} ms; TernGrad adds "
                f"{added:.2f} ms ({r['added_fraction']:.1%}): codec at N=8 {k['codec_ms_per_rank']:.2f} ms per rank "
                f"({k['groups']} group{'s' if k['groups'] != 1 else ''}), optimizer "
                + ("unmeasured" if opt_added is None else f"{opt_added:.2f} ms")
                + f"; averages identical on the 8 ranks {k['same_on_every_rank']}")
        return text, (OK if k["same_on_every_rank"] and opt_added is not None else FAIL)
    rows.append(_timed_row("train step", device_label, train_step))

    def ranks_step():
        r = two_ranks("cuda" if gpu else "cpu", timeout_s=share["2 ranks"])
        if "error" in r:
            return f"{r['error']}"[:300], FAIL
        r0, r1 = r["ranks"]
        finite = all(math.isfinite(v) for v in r0["losses"] + r1["losses"])
        same = r0["checksum"] == r1["checksum"]
        text = (f"DDP hook + tg AdamW, gloo, {len(r0['losses'])} steps: losses finite {finite}, parameters "
                f"identical {same}, {r0['bits_per_element']:.2f} bits/element, {r0['ms_per_step']:.1f} ms/step")
        return text, (OK if finite and same else FAIL)
    rows.append(_timed_row("2 ranks", "cuda:0 x 2" if gpu else f"{device_label} x 2", ranks_step))
    info["heading"] = heading
    info["rows"] = [asdict(r) for r in rows]
    return heading, rows, _rounded(info)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def kernel_table(krows: list[dict]) -> str:
    """The kernel table's Markdown (also what docs/gpu.md renders from the JSON)."""
    lines = ["| kernel | target | elements | bytes/element | GPU ms | wall ms | Gelem/s | GB/s moved | of copy "
             f"| ≥ {GOAL_OF_COPY:.0%} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in krows:
        head = f"| {r['kernel']} ({r.get('path', '')}) | {r['target']} | {r['elements']:,} |"
        if r.get("status") != OK:
            lines.append(head + f" {r.get('bytes_per_element', '-')} | {r.get('note', r.get('status'))} "
                         "| | | | | |")
            continue
        lines.append(head + f" {r['bytes_per_element']:.3g} | {_ms(r['gpu_ms'])} | {_ms(r['wall_ms'])} "
                     f"| {r['gelem_s']:.2f} | {r['gbs']:.1f} | {r['of_copy']:.0%} "
                     f"| {'yes' if r['of_copy'] >= GOAL_OF_COPY else 'no'} |")
    return "\n".join(lines)


def table(heading: str, rows: list[Row], info: dict | None = None) -> str:
    lines = [heading, "", "| step | device | result | status | s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.step} | {r.device} | {r.result.replace('|', '/')} | {r.status} | {r.seconds:.1f} |")
    if info and info.get("kernels"):
        copy = info["copy"]
        lines += ["", f"Kernels ({info['table_backend']}; GPU ms from CUDA events, '-' on the CPU; GB/s moved = "
                  f"bytes/element x elements / time, reads and writes; of copy = against the device's copy, "
                  f"{copy['moved_gbs']:.1f} GB/s moved: {copy['elements']:,} fp32 elements copied, 2 x 4 bytes "
                  "each):", "", kernel_table(info["kernels"])]
    failed = [r.step for r in rows if r.status == FAIL]
    lines += ["", f"gpu_check: {len(rows) - len(failed)} of {len(rows)} steps passed or skipped"
              + (f"; FAILED: {', '.join(failed)}" if failed else "")]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the CPU dry run even where a GPU is")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the pytest step")
    p.add_argument("--budget-s", type=float, default=420.0, help="time for the whole check (the steps' shares)")
    p.add_argument("--json", default=None, help="also write the rows and every measurement here (docs/gpu/*.json)")
    p.add_argument("--pytest-log", default=None, help="write the tests step's whole pytest output here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    heading, rows, info = check(args.dry_run, args.budget_s, args.tests, args.pytest_log)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(heading, rows, info), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
