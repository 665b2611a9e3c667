"""The GPU check: docs/gpu/*.json (scripts/gpu_check.sh --json), docs/gpu.md's tables and the performance model's
GPU rows (the codec charged at the measured profile).
"""
from __future__ import annotations

import glob
import json
import os

from .common import DOCS, _x
from .modelled import _cluster


GPU_NOT_RUN = "not run on a GPU yet"
GPU_TARGETS = 5           # 16M, 64M and 256M elements, GPT-2 124M's and ResNet-50's fused groups


def gpu_checks() -> list:
    """Every docs/gpu/*.json a GPU wrote, oldest first (by its "date")."""
    runs = []
    for path in sorted(glob.glob(os.path.join(DOCS, "gpu", "*.json"))):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if d.get("gpu"):
            runs.append({**d, "file": os.path.relpath(path, DOCS)})
    if not runs:
        raise SystemExit("render_docs: no docs/gpu/*.json with \"gpu\": true")
    return sorted(runs, key=lambda d: d["date"])


def _gpu_run(d: dict) -> str:
    return f"{d['device']}, {d['date']} ([{os.path.basename(d['file'])}]({d['file']}))"


def block_gpu_steps(d: dict) -> str:
    """gpu.md: the check's steps as the current JSON has them; a step it lacks is not run on a GPU yet."""
    from horovod_terngrad.operations import gpu_check as gc
    lines = [f"Run: {_gpu_run(d)}, torch {d['torch']}, CUDA {d['cuda']}.", "",
             "| step | result | status | s |", "|---|---|---|---|"]
    have = set()
    for r in d["rows"]:
        have.add(r["step"])
        lines.append(f"| {r['step']} | {r['result'].replace('|', '/')} | {r['status']} | {r['seconds']:.1f} |")
    for step in gc.STEPS:
        if step not in have:
            lines.append(f"| {step} | {GPU_NOT_RUN} | | |")
    return "\n".join(lines)


def block_gpu_kernels(d: dict) -> str:
    """gpu.md: the kernel table of the current JSON, and how much of the full table is still to run."""
    from horovod_terngrad.operations import gpu_check as gc
    rows = d.get("kernels") or []
    done = sum(r.get("status") == "ok" for r in rows)
    full = len(gc.KERNEL_PATHS) * GPU_TARGETS
    copy = d["copy"]
    lines = [f"Run: {_gpu_run(d)}; the device's copy {copy['moved_gbs']:.1f} GB/s moved ({copy['elements']:,} fp32 "
             "elements copied: a copy of B bytes moves 2B).", "", gc.kernel_table(rows)]
    if done < full:
        lines += ["", f"{done} of the {full} rows ({len(gc.KERNEL_PATHS)} paths x {GPU_TARGETS} targets) measured; "
                  f"the others: {GPU_NOT_RUN}."]
    return "\n".join(lines)


def block_gpu_goals(d: dict) -> str:
    """gpu.md: the GPU goals, each with the current JSON's figure or "not run on a GPU yet"."""
    from horovod_terngrad.operations import gpu_check as gc
    rows = [r for r in d.get("kernels") or [] if r.get("status") == "ok"]
    lines = ["| goal | measured | met? |", "|---|---|---|"]
    for op, name in (("compress", "compress (fp32 and bf16, 2bit and base3)"), ("decode", "decode (N = 2 and 8)")):
        rs = [r for r in rows if r["op"] == op]
        if not rs:
            lines.append(f"| {name} ≥ {gc.GOAL_OF_COPY:.0%} of copy | {GPU_NOT_RUN} | |")
            continue
        lo, hi = min(rs, key=lambda r: r["of_copy"]), max(rs, key=lambda r: r["of_copy"])
        span = (f"{lo['of_copy']:.0%}" if lo is hi else
                f"{lo['of_copy']:.0%} ({lo['kernel']}, {lo['target']}) to {hi['of_copy']:.0%} "
                f"({hi['kernel']}, {hi['target']})")
        lines.append(f"| {name} ≥ {gc.GOAL_OF_COPY:.0%} of copy | {span}; {len(rs)} row{'s' if len(rs) > 1 else ''} |"
                     f" {'yes' if lo['of_copy'] >= gc.GOAL_OF_COPY else '**no**'} |")
    o = d.get("optimizer") or {}
    if o.get("fused_ms") and o.get("params") == 148:
        ratio = o["tg_ms"] / o["fused_ms"]
        lines.append(f"| `optim.AdamW` ≤ 1.2x torch's fused AdamW, GPT-2 124M's 148 tensors | {o['tg_ms']:.2f} ms "
                     f"against {o['fused_ms']:.2f} ms ({ratio:.2f}x) | {'yes' if ratio <= 1.2 else '**no**'} |")
    else:
        seen = (f" (measured: {o['tg_ms']:.2f} ms against torch's foreach {o['foreach_ms']:.2f} ms on GPT-2's "
                f"{o['params']} tensors)" if o.get("foreach_ms") else "")
        lines.append(f"| `optim.AdamW` ≤ 1.2x torch's fused AdamW, GPT-2 124M's 148 tensors | {GPU_NOT_RUN}{seen} | |")
    t = d.get("train_step")
    if t:
        lines.append(f"| one GPU's GPT-2 124M step: TernGrad adds ≤ 5% | {t['added_ms']:.2f} ms of "
                     f"{t['compute_ms']:.1f} ms ({t['added_fraction']:.1%}) | "
                     f"{'yes' if t['added_fraction'] <= 0.05 else '**no**'} |")
    else:
        lines.append(f"| one GPU's GPT-2 124M step: TernGrad adds ≤ 5% | {GPU_NOT_RUN} | |")
    return "\n".join(lines)


def block_gpu_train_step(d: dict) -> str:
    """gpu.md: the one-GPU training step of the current JSON."""
    t = d.get("train_step")
    if not t:
        return f"{GPU_NOT_RUN[0].upper()}{GPU_NOT_RUN[1:]}."
    return "\n".join([
        "| figure | ms per step |", "|---|---|",
        f"| compute: {t['model']}, {t['batch']} x {t['tokens'] // t['batch']} tokens, bf16 autocast, forward, "
        f"backward and torch's {t['optimizer']} AdamW | {t['compute_ms']:.1f} |",
        f"| the codec at N = 8 ({t['ranks']} thread-ranks on the one GPU, {t['groups']} groups), one rank's share "
        f"of the {t['measured']} | {t['codec_ms_per_rank']:.2f} |",
        f"| `optim.AdamW`'s step less torch's | {t['optimizer_added_ms']:.2f} |",
        f"| TernGrad adds | {t['added_ms']:.2f} ({t['added_fraction']:.1%}) |"])


def block_gpu_codec_512(d: dict) -> str:
    """perfmodel.md: the 512-GPU goal rows (additive model, nodes of 4) with the codec free and charged at the GPU
    profile of the current gpu_check JSON."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    from horovod_terngrad.modelling.gpu_profile import GpuCodecProfile
    prof = GpuCodecProfile.from_check(d)
    rate, G, N = prof.codec_elements_per_s, 4, 512
    lines = [f"| {N} GPUs ({N // G} nodes x {G}), additive model | codec free | codec charged | the codec's ms "
             "per step |", "|---|---|---|---|"]
    for key, name in (("ethernet", "Ethernet"), ("infiniband", "InfiniBand")):
        cl = _cluster(key, G)
        c = hsdp.hsdp_compute_s(hsdp.GPT3_1P3B, cl.gpu)
        bf16 = hsdp.predict_hsdp_step(hsdp.GPT3_1P3B, N, cl.network, hsdp.HSDP_BF16, compute_s=c)
        free, paid = (hsdp.predict_hsdp_step(hsdp.GPT3_1P3B, N, cl.network, hsdp.HSDP_TERNGRAD_DEFAULT, compute_s=c,
                                           codec_elements_per_s=r) for r in (None, rate))
        if key == "ethernet":
            lines.append(f"| HSDP GPT-3 1.3B, {name}: x bf16 HSDP | {_x(bf16.step_s / free.step_s)} "
                         f"| {_x(bf16.step_s / paid.step_s)} | {1e3 * paid.codec_s:.1f} |")
        else:
            lines.append(f"| HSDP GPT-3 1.3B, {name}: step / its limit | {_x(free.step_s / free.limit_s)} "
                         f"| {_x(paid.step_s / paid.limit_s)} | {1e3 * paid.codec_s:.1f} |")
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        model, cl = pm.MODELS[mk], _cluster("infiniband", G)
        c = model.compute_s[cl.gpu]
        free, paid = (pm.compare_exchanges(model, c, N, cl.network, (pm.FP32, pm.TERNGRAD_DEFAULT),
                                           batch_per_worker=model.batch_per_gpu,
                                           codec_elements_per_s=r)[pm.TERNGRAD_DEFAULT] for r in (None, rate))
        lines.append(f"| Horovod {name}, InfiniBand: of linear | {free.scaling_efficiency:.3f} "
                     f"| {paid.scaling_efficiency:.3f} | {1e3 * paid.codec_s:.1f} |")
    lines += ["", f"Codec charged: every element operation of `perfmodel.codec_work_elements` at "
              f"{rate / 1e9:.1f}e9 per second, the slower of {prof.device}'s compress "
              f"({prof.compress_elements_per_s / 1e9:.1f}e9 elements/s) and its decode per payload element "
              f"(2 x {prof.decode_elements_per_s / 1e9:.1f}e9), from {_gpu_run(d)}; bf16 HSDP's own casts are not "
              "charged."]
    return "\n".join(lines)
