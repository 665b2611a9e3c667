"""The check: the device and backends a call runs on, its steps in order (each a named function of the run,
returning its result and status), the JSON's figures and the table it prints."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from .identity import identity
from .kernels import GOAL_OF_COPY, KERNEL_PATHS, codec_profile, kernel_rows, kernel_table, model_target, size_target
from .optimizer import optimizer_step_ms
from .pytest_step import DRY_RUN_TEST_FILES, GPU_TEST_FILES, run_tests
from .shapes import GPT2_124M, GPT2_DRY_RUN, GPT2Size, gpt2_shapes, resnet50_shapes, scaled_resnet50
from .status import FAIL, OK, SKIPPED, Row, timed_row
from .timing import Timer, copy_rate
from .train_step import codec_share_ms, compute_step_ms
from .two_ranks import two_ranks

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


@dataclass
class Run:
    """One call of the check: its device, the backend checked (``backend``, the kernel table's ``table_backend``)
    and the one it must equal byte for byte (``other``), its plan, the steps' shares of the budget, and ``info``:
    every figure for the JSON, which the steps fill in order (the train step reads the optimizer's)."""

    gpu: bool
    heading: str
    device: torch.device
    device_label: str
    backend: object
    backend_label: str
    table_backend: object
    table_label: str
    other: object
    other_device: torch.device
    other_label: str
    plan: Plan
    gpt2: list                  # the identity step's GPT-2 shapes
    test_files: tuple
    share: dict
    info: dict
    timer: Timer


def _on_gpu(info: dict) -> dict:
    """The Run's fields on the GPU: the CUDA backend (CuPy kernels, else the torch reference on the GPU) against
    the fused CPU backend."""
    from ... import backends
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    info.update(device=name, cuda=torch.version.cuda)
    heading = f"gpu_check on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    kernels = backends.cuda_kernels()
    backend = kernels if kernels is not None else backends.REFERENCE
    label = "CuPy kernels" if kernels is not None else "torch reference on the GPU (CuPy missing)"
    return dict(heading=heading, device=device, device_label="cuda", backend=backend, backend_label=label,
                table_backend=backend, table_label=label, other=backends.cpu_fused() or backends.REFERENCE,
                other_device=torch.device("cpu"), other_label="CPU", plan=GPU_PLAN, gpt2=gpt2_shapes(),
                test_files=GPU_TEST_FILES)


def _on_cpu(info: dict) -> dict:
    """The Run's fields of the CPU dry run: the fused CPU backend against the torch reference, the kernel table on
    the host build of the CUDA kernels."""
    from ... import backends
    why = "--dry-run" if torch.cuda.is_available() else "no GPU"
    heading = f"gpu_check: CPU dry run ({why}; torch {torch.__version__}): GPU steps run on the CPU backends"
    info.update(device=f"CPU dry run ({why})", cuda=None)
    fused = backends.cpu_fused()
    backend = fused if fused is not None else backends.REFERENCE
    label = "fused CPU" if fused is not None else "torch reference (the fused CPU codec did not build)"
    try:                                          # the CUDA source and driver, built for the host
        from ...backends.cuda import KernelBackend
        from ...backends.host_build import HostKernels
        table_backend, table_label = KernelBackend(HostKernels()), "host build of the CUDA kernels"
    except Exception as e:  # noqa: BLE001 - no compiler: the table runs on the CPU backend
        table_backend, table_label = backend, f"{label} (host build failed: {type(e).__name__})"
    return dict(heading=heading, device=torch.device("cpu"),
                device_label="cpu (no GPU)" if why == "no GPU" else "cpu (dry run)", backend=backend,
                backend_label=label, table_backend=table_backend, table_label=table_label, other=backends.REFERENCE,
                other_device=torch.device("cpu"), other_label="torch reference", plan=DRY_RUN_PLAN,
                gpt2=gpt2_shapes(*DRY_RUN_PLAN.identity_gpt2), test_files=DRY_RUN_TEST_FILES)


def setup(dry_run: bool, budget_s: float) -> Run:
    """The run on the GPU, or the CPU dry run where there is none or ``dry_run`` asks for it."""
    gpu = torch.cuda.is_available() and not dry_run
    share = {k: v * budget_s / 420.0 for k, v in STEP_BUDGET_S.items()}
    info: dict = {"schema": 2, "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "torch": torch.__version__, "budget_s": budget_s, "step_budget_s": share}
    fields = _on_gpu(info) if gpu else _on_cpu(info)
    info["backend"], info["table_backend"] = fields["backend_label"], fields["table_label"]
    return Run(gpu=gpu, share=share, info=info, timer=Timer(fields["device"]), **fields)


# -- the steps: each (result, status) -------------------------------------------------------------------------------

def step_tests(run: Run, pytest_log: str | None) -> tuple[str, str]:
    return run_tests(run.test_files, run.share["tests"], log=pytest_log)


def step_identity(run: Run, shapes) -> tuple[str, str]:
    same, total, differ = identity(shapes, run.backend, run.device, run.other, run.other_device)
    elements = sum(math.prod(s) for _, s in shapes)
    text = (f"{run.backend_label} = {run.other_label}: {same}/{total} tensor x packing cases identical "
            f"({len(shapes)} tensors, {elements / 1e6:.1f}M elements, 2 ranks, 2bit and base3)")
    return (text + (f"; differ: {', '.join(differ)}" if differ else "")), (OK if same == total else FAIL)


def step_kernels(run: Run) -> tuple[str, str]:
    plan, info = run.plan, run.info
    copy = copy_rate(run.device, plan.copy_elements, run.timer, plan.repeat)
    info["copy"] = copy
    targets = [size_target(n) for n in plan.sizes]
    targets += [model_target("GPT-2 124M" if plan.gpu else "GPT-2 12x128", plan.gpt2.shapes()),
                model_target("ResNet-50" if plan.resnet50_scale == 1 else f"ResNet-50 at 1/{plan.resnet50_scale}",
                             scaled_resnet50(plan.resnet50_scale))]
    krows = kernel_rows(run.table_backend, run.device, targets, run.timer, copy["moved_gbs"], plan.repeat,
                        run.share["kernels"])
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
    return (f"{run.table_label}: {len(done)} rows ({len(KERNEL_PATHS)} paths x {len(targets)} targets"
            + (f", {skipped} past the budget" if skipped else "")
            + f"), {GOAL_OF_COPY:.0%} of copy met by {met}; {worst['of_copy']:.0%} ({worst['kernel']}, "
            f"{worst['target']}) to {best['of_copy']:.0%} ({best['kernel']}, {best['target']}); device copy "
            f"{copy['moved_gbs']:.1f} GB/s moved"), OK


def step_optimizer(run: Run) -> tuple[str, str]:
    r = optimizer_step_ms(run.plan.gpt2.shapes(), run.device, run.timer)
    run.info["optimizer"] = r
    ok = r["ternary_params"] == r["params"]
    ref = r.get("fused_ms") or r.get("foreach_ms")
    vs = (f"torch fused {r['fused_ms']:.2f} ms ({r['tg_ms'] / r['fused_ms']:.2f}x)" if r.get("fused_ms")
          else "torch fused: " + r.get("fused_error", "none"))
    return (f"tg AdamW {r['tg_ms']:.2f} ms/step, {vs}, foreach "
            + (f"{r['foreach_ms']:.2f} ms" if r.get("foreach_ms") else "none")
            + f" on {r['params']} GPT-2 tensors ({r['elements'] / 1e6:.1f}M); "
            f"{r['ternary_params']} took the ternary path"), (OK if ok and ref else FAIL)


def step_train(run: Run) -> tuple[str, str]:
    plan = run.plan
    c = compute_step_ms(plan.gpt2, run.device, plan.batch, run.timer, plan.train_steps)
    k = codec_share_ms(plan.gpt2.shapes(), run.device, run.timer, ranks=8, steps=2, timeout_s=run.share["train step"])
    opt = run.info.get("optimizer") or {}
    ref = opt.get("fused_ms") or opt.get("foreach_ms")
    opt_added = max(0.0, opt["tg_ms"] - ref) if ref and "tg_ms" in opt else None
    added = k["codec_ms_per_rank"] + (opt_added or 0.0)
    r = {**c, **k, "optimizer_added_ms": opt_added, "added_ms": added, "added_fraction": added / c["compute_ms"]}
    run.info["train_step"] = r
    text = (f"{c['model']}, {c['params'] / 1e6:.1f}M in {c['tensors']} tensors, {c['batch']} x "
            f"{c['tokens'] // c['batch']} tokens, bf16 autocast: compute {c['compute_ms']:.1f} ms; TernGrad adds "
            f"{added:.2f} ms ({r['added_fraction']:.1%}): codec at N=8 {k['codec_ms_per_rank']:.2f} ms per rank "
            f"({k['groups']} group{'s' if k['groups'] != 1 else ''}), optimizer "
            + ("unmeasured" if opt_added is None else f"{opt_added:.2f} ms")
            + f"; averages identical on the 8 ranks {k['same_on_every_rank']}")
    return text, (OK if k["same_on_every_rank"] and opt_added is not None else FAIL)


def step_two_ranks(run: Run) -> tuple[str, str]:
    r = two_ranks("cuda" if run.gpu else "cpu", timeout_s=run.share["2 ranks"])
    if "error" in r:
        return f"{r['error']}"[:300], FAIL
    r0, r1 = r["ranks"]
    finite = all(math.isfinite(v) for v in r0["losses"] + r1["losses"])
    same = r0["checksum"] == r1["checksum"]
    text = (f"DDP hook + tg AdamW, gloo, {len(r0['losses'])} steps: losses finite {finite}, parameters "
            f"identical {same}, {r0['bits_per_element']:.2f} bits/element, {r0['ms_per_step']:.1f} ms/step")
    return text, (OK if finite and same else FAIL)


def named_steps(run: Run, pytest_log: str | None = None) -> list:
    """(step, device, the step's call) in the order they run: :data:`STEPS`."""
    d = run.device_label
    return [("tests", d, lambda: step_tests(run, pytest_log)),
            ("identity gpt2", d, lambda: step_identity(run, run.gpt2)),
            ("identity resnet50", d, lambda: step_identity(run, resnet50_shapes())),
            ("kernels", d, lambda: step_kernels(run)),
            ("optimizer", d, lambda: step_optimizer(run)),
            ("train step", d, lambda: step_train(run)),
            ("2 ranks", "cuda:0 x 2" if run.gpu else f"{d} x 2", lambda: step_two_ranks(run))]


# -- the check ------------------------------------------------------------------------------------------------------

def check(dry_run: bool, budget_s: float = 420.0, run_test_files: bool = True,
          pytest_log: str | None = None) -> tuple[str, list[Row], dict]:
    """Run every step; returns (the heading, the rows, the measurements for the JSON)."""
    run = setup(dry_run, budget_s)
    rows = []
    for step, device, call in named_steps(run, pytest_log):
        if step == "tests" and not run_test_files:
            rows.append(Row(step, device, "not asked for (--no-tests)", SKIPPED))
        else:
            rows.append(timed_row(step, device, call))
    run.info["heading"] = run.heading
    run.info["rows"] = [asdict(r) for r in rows]
    return run.heading, rows, _rounded(run.info)


def _rounded(obj):
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


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
