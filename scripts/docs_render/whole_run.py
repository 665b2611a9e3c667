"""The whole-run study (docs/study/whole_run/*/runs.jsonl): the headline's accuracy row and the table of the
defaults against fp32 AdamW at the end of whole runs (docs/choosing.md, docs/scale.md).
"""
from __future__ import annotations

import glob
import json
import os
import statistics

from .common import DOCS, _pct2


WHOLE_RUN_WORKLOADS = {("llama", "perlpod"): "Llama 2 x 64 on Perl's documentation, 3 epochs",
                       ("gpt2", "copyright"): "GPT-2 2 x 64 on Debian's copyright files, 1 epoch"}


def whole_runs() -> list:
    """Every simulator run of the whole-run study (docs/study/whole_run/*/runs.jsonl, examples/study_lm_scale.py)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(DOCS, "study", "whole_run", "*", "runs.jsonl"))):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def runs_the_default(r: dict) -> bool:
    """Whether a study row ran what ``TernGradConfig()`` runs at its N and topology: the exchange
    ``policy.default_transport(·)`` picks among the N ranks (flat) or the N / G nodes (node-aware, bf16 inside
    the node), with horovod_terngrad.optim.AdamW and its noise estimate as the exchanges form it now (the senders'
    squares take the minibatch's share out: ``"estimate": "squares"``; rows without it ran the whole sum).  A row
    whose exchange is ``default`` ran ``TernGradConfig()``'s own pick.  The first stage's code is the config's
    default: where the transport takes the four-level code (``TernGradConfig.first_stage_format``), only the rows
    that ran it (the study's ``+4level``) ran the defaults."""
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import policy
    among = r["N"] // r["G"] if r["G"] > 1 else r["N"]
    transport = policy.default_transport(among)
    suffix = "+4level" if TernGradConfig().first_stage_format(transport) == "4level" else ""
    return (r["optimizer"] == "terngrad" and r["method"] in ("default" + suffix, transport + suffix)
            and r.get("estimate") == "squares")


def _mean_by_lr(rows: list) -> dict:
    """{lr: mean held-out loss} of the study rows, for each lr with at least 3 seeds."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["lr"], []).append(r["held_out"])
    return {lr: statistics.mean(v) for lr, v in by.items() if len(v) >= 3}


def _fp32_best(rows: list, model: str, corpus: str):
    """(the workload's rows, fp32's mean at its best lr, that lr), or None without an fp32 sweep of 3-seed cells."""
    mine = [r for r in rows if r["model"] == model and r["corpus"] == corpus]
    fp32 = _mean_by_lr([r for r in mine if r["method"] == "none"])
    if len(fp32) < 2:
        return None
    best = min(fp32, key=fp32.get)
    return mine, fp32[best], best


def _cells_at_fp32_best(rows: list, select, pick) -> list:
    """Per workload with an fp32 sweep: the runs ``select`` takes at fp32's best lr, grouped by (G, N), and of the
    groups with 3 seeds or more the one ``pick`` chooses among their sorted keys, as (workload name, N, seeds, lr,
    mean vs fp32's best mean in %, worst seed vs it in %, mean bits received)."""
    cells = []
    for (model, corpus), name in WHOLE_RUN_WORKLOADS.items():
        found = _fp32_best(rows, model, corpus)
        if found is None:
            continue
        mine, ref, best = found
        by: dict = {}
        for r in mine:
            if r["lr"] == best and select(r):
                by.setdefault((r["G"], r["N"]), []).append(r)
        full = sorted(k for k, v in by.items() if len(v) >= 3)
        if full:
            cell = by[pick(full)]
            vals = [r["held_out"] for r in cell]
            cells.append((name, cell[0]["N"], len(vals), best, 100 * (statistics.mean(vals) / ref - 1),
                          100 * (max(vals) / ref - 1), statistics.mean(r["bits_received"] for r in cell)))
    return cells


def _what(cells: list) -> str:
    return "; ".join(f"{name}, N = {N}, {k} seeds, lr {lr:g}" for name, N, k, lr, *_ in cells)


def whole_run_headline(rows: list) -> str:
    """The headline's accuracy row: the defaults against fp32 AdamW at fp32's best lr (the same lr for both), at the
    end of whole runs, per workload with an fp32 sweep and a 3-seed cell of the defaults at that lr (flat, the
    smallest N there)."""
    cells = _cells_at_fp32_best(rows, runs_the_default, lambda keys: keys[0])
    if not cells:
        return "| held-out loss at the end of whole runs vs fp32 AdamW at fp32's best lr | not measured | [scale](DOCS/scale.md) |"
    figs = " / ".join(f"{_pct2(gap)} ({_pct2(worst)})" for *_, gap, worst, _bits in cells)
    return (f"| held-out loss at the end of whole runs vs fp32 AdamW at fp32's best lr (the same for both): TernGrad's "
            f"defaults with `horovod_terngrad.optim.AdamW`, {_what(cells)}: mean (worst seed) | {figs} | "
            f"[scale](DOCS/scale.md) |")


def owner_step_headline(rows: list) -> str:
    """The headline's owner-step row: ``OwnerStepOptimizer``'s runs (the study's ``owner-step-nearest``, whose
    arithmetic it runs) against fp32 AdamW at fp32's best lr, per workload with 3 seeds of each there (flat, the
    largest N with 3 seeds)."""
    cells = _cells_at_fp32_best(rows, lambda r: r["method"] == "owner-step-nearest" and r["G"] <= 1,
                                lambda keys: max(keys, key=lambda k: k[1]))
    if not cells:
        return ("| held-out loss vs fp32 AdamW at fp32's best lr, `optim.OwnerStepOptimizer` | not measured "
                "| [scale](DOCS/scale.md) |")
    figs = " / ".join(f"{_pct2(gap)} ({_pct2(worst)}) at {bits:.2f} bits" for *_, gap, worst, bits in cells)
    return (f"| held-out loss at the end of whole runs vs fp32 AdamW at fp32's best lr (the same for both): "
            f"`horovod_terngrad.optim.OwnerStepOptimizer` (each rank steps its shard), {_what(cells)}: mean (worst "
            f"seed), bits per element received | {figs} | [scale](DOCS/scale.md#under-4-bits-each-owner-steps-its-"
            f"shard-ownerstepoptimizer) |")


def block_whole_run(rows: list) -> str:
    """Per workload, topology and N: the exchange the defaults run, and its held-out loss at the end of whole runs
    against fp32 AdamW's: both at fp32's best lr (the lr a user keeps), both at the recipe's lr 2e-3, and each at
    its own best lr where a sweep ran."""
    from horovod_terngrad.exchange import policy
    lines = ["| workload | topology | N | exchange the defaults run | seeds | vs fp32 AdamW, both at fp32's best lr: "
             "mean (worst seed) | both at the recipe's lr (2e-3) | each at its own best lr |",
             "|---|---|---|---|---|---|---|---|"]

    def gap(vals, ref):
        return f"{_pct2(100 * (statistics.mean(vals) / ref - 1))} ({_pct2(100 * (max(vals) / ref - 1))})"

    for (model, corpus), name in WHOLE_RUN_WORKLOADS.items():
        mine = [r for r in rows if r["model"] == model and r["corpus"] == corpus]
        fp32_lr = _mean_by_lr([r for r in mine if r["method"] == "none"])
        if not fp32_lr:
            continue
        best_lr = min(fp32_lr, key=fp32_lr.get) if len(fp32_lr) >= 2 else None
        cells: dict = {}
        for r in mine:
            if r["method"] != "none" and runs_the_default(r):
                cells.setdefault((r["G"], r["N"]), []).append(r)
        for (G, N), rs in sorted(cells.items()):
            at_best = [r["held_out"] for r in rs if best_lr is not None and r["lr"] == best_lr]
            at_recipe = [r["held_out"] for r in rs if r["lr"] == 2e-3]
            if len(at_best) < 2 and len(at_recipe) < 2:
                continue
            among = N // G if G > 1 else N
            ex = policy.default_transport(among)
            topo = "flat" if G <= 1 else f"nodes of {G} (bf16 inside)"
            what = ex if G <= 1 else f"node-aware, {ex} across {among} nodes"
            best = _mean_by_lr(rs)
            sweep = (f"{_pct2(100 * (min(best.values()) / min(fp32_lr.values()) - 1))} (lr {min(best, key=best.get):g} "
                     f"vs {best_lr:g})") if len(best) >= 2 and best_lr is not None else "-"
            first = (f"{gap(at_best, fp32_lr[best_lr])} (lr {best_lr:g})" if len(at_best) >= 2
                     else "- (not run)" if best_lr is not None else "- (no fp32 sweep)")
            recipe = gap(at_recipe, fp32_lr[2e-3]) if len(at_recipe) >= 2 and 2e-3 in fp32_lr else "- (not run)"
            seeds = max(len(at_best), len(at_recipe))
            lines.append(f"| {name} | {topo} | {N} | {what} | {seeds} | {first} | {recipe} | {sweep} |")
    return "\n".join(lines)
