"""docs/ddp.md's accuracy studies (examples/study_ddp.py's JSON: per seed, per hook, the comparisons it
computed): equal steps, equal wall-clock, the long CifarNet runs and their moving average.
"""
from __future__ import annotations

import statistics

from .common import _load


# ddp.md's accuracy studies (examples/study_ddp.py's JSON: per seed, per hook, the comparisons it computed)
DDP_STUDY_LABELS = {"fp32": "DDP fp32", "fp16": "fp16_compress_hook", "powersgd1": "PowerSGD rank 1",
                    "powersgd4": "PowerSGD rank 4", "terngrad": "TernGrad-DDP"}
DDP_LONG_LABELS = {"fp32": "DDP fp32", "powersgd4": "PowerSGD rank 4", "terngrad": "TernGrad-DDP (defaults)",
                   "terngrad-b512": "TernGrad-DDP, bucket_size 512"}
DDP_GOAL_HOOKS = ("powersgd4", "terngrad")   # the goal compares these two: their mean gaps in bold


def _study(rel: str, key: str = "comparisons") -> tuple:
    """(hooks in the study's order, {hook: [its comparison per seed]}) of a study_ddp.py JSON."""
    comp = _load(rel)[key]
    seeds = sorted(comp, key=int)
    hooks = list(comp[seeds[0]]["hooks"])
    return hooks, {h: [comp[s]["hooks"][h] for s in seeds] for h in hooks}


def _gaps(rows: list, key: str) -> tuple:
    """(per seed, mean) of a gap in points."""
    vals = [r[key] for r in rows]
    return ", ".join(f"{v:+.2f}" for v in vals), f"{statistics.mean(vals):+.2f}"


def _bits(rows: list) -> str:
    b = statistics.mean(r["bits_per_param"] for r in rows)
    return f"{b:.0f}" if b in (16.0, 32.0) else f"{b:.2f}"


def _bold_if(hook: str, v: str) -> str:
    return f"**{v}**" if hook in DDP_GOAL_HOOKS else v


DDP_STUDIES = (("LeNet", "docs/ddp/study_lenet.json"), ("CifarNet", "docs/ddp/study_cifarnet.json"))


def block_ddp_accuracy_steps() -> str:
    """ddp.md's equal-steps accuracy table: LeNet and CifarNet (docs/ddp/study_lenet.json, study_cifarnet.json)."""
    lines = ["| study | hook | final accuracy (mean) | gap per seed | mean gap | gap, last 3 (mean) | bits/param |",
             "|---|---|---|---|---|---|---|"]
    for study, rel in DDP_STUDIES:
        hooks, by = _study(rel)
        for h in hooks:
            rows = by[h]
            acc = f"{100 * statistics.mean(r['final_acc'] for r in rows):.2f}%"
            if h == "fp32":
                lines.append(f"| {study} | {DDP_STUDY_LABELS[h]} | {acc} | | | | {_bits(rows)} |")
                continue
            per, mean = _gaps(rows, "gap")
            lines.append(f"| {study} | {DDP_STUDY_LABELS[h]} | {acc} | {per} | {_bold_if(h, mean)} "
                         f"| {_gaps(rows, 'tail_gap')[1]} | {_bits(rows)} |")
    return "\n".join(lines)


def block_ddp_accuracy_wallclock() -> str:
    """ddp.md's equal wall-clock table: per hook its ms/step and steps by the budget T per seed and its gap at T."""
    lines = ["| study | hook | ms/step (seed 1, 2) | steps by T | gap at T per seed | mean |",
             "|---|---|---|---|---|---|"]
    for study, rel in DDP_STUDIES:
        hooks, by = _study(rel)
        for h in [h for h in hooks if h != "fp32"] + ["fp32"]:
            rows = by[h]
            ms = ", ".join(f"{r['ms_per_step']:.1f}" for r in rows)
            steps = ", ".join(f"{r['steps_at_budget']:.0f}" for r in rows)
            if h == "fp32":
                gaps = "| | |"
            else:
                per, mean = _gaps(rows, "gap_at_budget")
                gaps = f"| {per} | {_bold_if(h, mean)} |"
            lines.append(f"| {study} | {DDP_STUDY_LABELS[h]} | {ms} | {steps} {gaps}")
    return "\n".join(lines)


def block_ddp_cifarnet_long(rel: str, last: str) -> str:
    """ddp.md's 1200-step CifarNet table of ``rel`` (study_ddp.py's JSON): per hook its final accuracy per seed and
    its mean gaps to fp32 at equal steps, over the last 3 records and at equal wall-clock; ``last``: "bits" (bits
    per parameter) or "lr2e-4" (the mean gap of docs/ddp/cifarnet-long/, the same study at Adam lr 0.0002)."""
    hooks, by = _study(rel)
    _, base = _study("docs/ddp/cifarnet-long/study_cifarnet.json")
    tail_head = "bits/param" if last == "bits" else "at lr 0.0002 (above)"
    lines = ["| hook | final accuracy, seed 1 / 2 | gap per seed | mean gap | mean gap, last 3 | mean gap at equal "
             f"wall-clock | {tail_head} |", "|---|---|---|---|---|---|---|"]
    for h in hooks:
        rows = by[h]
        acc = " / ".join(f"{100 * r['final_acc']:.2f}%" for r in rows)
        if last == "bits":
            tail = _bits(rows)
        elif h == "fp32":
            tail = f"{100 * statistics.mean(r['final_acc'] for r in base[h]):.2f}% (mean)"
        else:
            tail = _gaps(base[h], "gap")[1]
        if h == "fp32":
            lines.append(f"| {DDP_LONG_LABELS[h]} | {acc} | | | | | {tail} |")
            continue
        per, mean = _gaps(rows, "gap")
        lines.append(f"| {DDP_LONG_LABELS[h]} | {acc} | {per} | {_bold_if(h, mean)} | {_gaps(rows, 'tail_gap')[1]} "
                     f"| {_gaps(rows, 'gap_at_budget')[1]} | {tail} |")
    return "\n".join(lines)


def block_ddp_cifarnet_ema() -> str:
    """ddp.md's raw-against-averaged CifarNet table (docs/ddp/cifarnet-ema/study_cifarnet.json, --ema-decay 0.99):
    per hook its mean gap to fp32 (and per seed) and over the last 3 records, of the raw and the averaged
    parameters."""
    rel = "docs/ddp/cifarnet-ema/study_cifarnet.json"
    hooks, raw = _study(rel)
    _, ema = _study(rel, "comparisons_ema")
    lines = ["| hook | raw: mean gap (seed 1, 2) | raw, last 3 | averaged: mean gap (seed 1, 2) | averaged, last 3 |",
             "|---|---|---|---|---|"]
    for h in hooks:
        if h == "fp32":
            cells = [f"{100 * statistics.mean(r['final_acc'] for r in b[h]):.2f}% (final, mean) | " for b in (raw, ema)]
            lines.append(f"| {DDP_LONG_LABELS[h]} | {cells[0]}| {cells[1]}|")
            continue
        out = []
        for b in (raw, ema):
            per, mean = _gaps(b[h], "gap")
            out.append(f"{_bold_if(h, mean)} ({per}) | {_gaps(b[h], 'tail_gap')[1]}")
        lines.append(f"| {DDP_LONG_LABELS[h]} | {out[0]} | {out[1]} |")
    return "\n".join(lines)
