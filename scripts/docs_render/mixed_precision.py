"""docs/mixed_precision.md's tables: fp16 with GradScaler, and bf16 against fp32."""
from __future__ import annotations

from .common import _load


# mixed_precision.md's runs (examples/mnist_lenet.py, ddp_mnist.py, transformers_lm.py with --json
# docs/mixed_precision/<file>.json): (file, model and frontend, exchange, steps).  LeNet on Horovod writes one record
# per epoch and not its step count, which its command fixes (2 epochs, --max-steps 200): those rows give it as
# "steps"; the others' JSON holds theirs (None).
MP_FP16_RUNS = [(f"lenet-hvd-fp16-{c}-{i}", "LeNet, Horovod", x, 400) for i in ("init65536", "init240")
                for c, x in (("terngrad", "TernGrad"), ("none", "Compression.none"), ("fp16", "Compression.fp16"))] + [
    (f"lenet-ddp-fp16-{c}-{i}", "LeNet, DDP", x, None) for i in ("init65536", "init240")
    for c, x in (("terngrad", "TernGrad hook"), ("none", "no hook"), ("fp16", "fp16_compress_hook"),
                 ("powersgd", "PowerSGD (rank 1)"), ("terngrad-zero", 'TernGrad hook, `on_nonfinite="zero"`'))] + [
    (f"lm-{f}-fp16-{c}-{i}", f"GPT-2 LM, {fe}", x, None) for f, fe in (("hvd", "Horovod"), ("ddp", "DDP"))
    for i in ("init65536", "init240") for c, x in (("terngrad", "TernGrad"), ("none", "none (fp32 allreduce)"))]


# (file, model, exchange, steps as for MP_FP16_RUNS): LeNet's README run, 2 epochs of 781 steps
MP_BF16_RUNS = [(f"lenet-hvd-{a}-{c}", "LeNet (Horovod)", x, 1562) for c, x in (("terngrad", "TernGrad"),
                ("none", "Compression.none")) for a in ("off", "bf16")] + [
    (f"lm-hvd-{a}-{c}{s}", f"GPT-2 LM (Horovod), seed {1 if s else 0}", x, None)
    for c, x in (("terngrad", "TernGrad"), ("none", "none")) for s in ("", "-seed1") for a in ("off", "bf16")]


def _pow2(v: float) -> str:
    """A loss scale as 2^k (0 once it has underflowed)."""
    import math
    if not v:
        return "0"
    k = math.log2(v)
    if k != int(k):
        raise ValueError(f"loss scale {v} is not a power of 2")
    return f"2^{int(k)}"


def _step_ranges(steps: list) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


def _mp_run(name: str, steps) -> dict:
    """One run of docs/mixed_precision/: its last epoch's record where the file holds one per epoch (LeNet on
    Horovod, whose loss is the epoch's mean), with ``steps`` and ``loss_last`` filled in."""
    res = _load(f"docs/mixed_precision/{name}.json")
    if isinstance(res, list):
        res = dict(res[-1], loss_last=res[-1]["loss"])
    if steps is not None:
        res["steps"] = steps
    return res


def _mp_quality(r: dict) -> str:
    return f"{100 * r['test_acc']:.2f}%" if "test_acc" in r else f"{r['held_out_loss']:.4f}"


def block_mp_fp16() -> str:
    """mixed_precision.md's fp16 + GradScaler table (MP_FP16_RUNS): per run its initial scale, the steps GradScaler
    skipped (total, each rank's, which), the final scale, the final loss and the test accuracy or held-out loss."""
    lines = ["| model, frontend | initial scale | exchange | steps | skipped | which steps | final scale | final loss "
             "| test acc / held-out loss |", "|---|---|---|---|---|---|---|---|---|"]
    for name, model, exchange, steps in MP_FP16_RUNS:
        r = _mp_run(name, steps)
        per_rank = ", ".join(str(n) for n in r["skipped_steps_per_rank"])
        lines.append(f"| {model} | {_pow2(r['init_scale'])} | {exchange} | {r['steps']} | {r['skipped_steps']} "
                     f"[{per_rank}] | {_step_ranges(r['skipped_at'])} | {_pow2(r['loss_scale'])} "
                     f"| {r['loss_last']:.4f} | {_mp_quality(r)} |")
    return "\n".join(lines)


def block_mp_bf16() -> str:
    """mixed_precision.md's bf16-against-fp32 table (MP_BF16_RUNS): final loss and test accuracy or held-out loss."""
    lines = ["| model | exchange | precision | steps | final loss | test acc / held-out loss |",
             "|---|---|---|---|---|---|"]
    for name, model, exchange, steps in MP_BF16_RUNS:
        r = _mp_run(name, steps)
        prec = {"off": "fp32", "bf16": "bf16"}[r["amp"]]
        lines.append(f"| {model} | {exchange} | {prec} | {r['steps']} | {r['loss_last']:.4f} | {_mp_quality(r)} |")
    return "\n".join(lines)
