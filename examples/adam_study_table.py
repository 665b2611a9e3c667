"""The Adam study's table (docs/adam.md) from the runs' JSON results (docs/adam/run_lm.sh writes them).

    python examples/adam_study_table.py docs/adam/runs [--baseline fp32] [--prefix ddp-]

One row per configuration (the run tag): held-out loss per seed, mean and spread (max - min over seeds), the gap
of the mean to the baseline's mean, the worst per-seed gap (seeds paired: same initial weights and data), and
the bits per gradient element handed to collectives, averaged over the whole run (refreshes, warm-up and
full-precision tensors included).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics


def load(folder: str) -> dict:
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        m = re.match(r"(.+)\.s(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            runs.setdefault(m.group(1), {})[int(m.group(2))] = json.load(f)
    return runs


def table(runs: dict, baseline: str, tags=None) -> str:
    base = runs.get(baseline, {})
    base_mean = statistics.mean(r["held_out_loss"] for r in base.values()) if base else None
    seeds = sorted({s for rs in runs.values() for s in rs})
    lines = ["| configuration | " + " | ".join(f"seed {s}" for s in seeds) +
             " | mean | spread | gap of mean vs " + baseline + " | worst paired gap | bits/element over the run |",
             "|---" * (len(seeds) + 6) + "|"]
    for tag in tags or sorted(runs):
        rs = runs.get(tag)
        if not rs:
            continue
        losses = {s: r["held_out_loss"] for s, r in rs.items()}
        mean = statistics.mean(losses.values())
        spread = max(losses.values()) - min(losses.values())
        gap = f"{100 * (mean / base_mean - 1):+.2f}%" if base_mean else "-"
        paired = [100 * (losses[s] / base[s]["held_out_loss"] - 1) for s in losses if s in base]
        worst = f"{max(paired):+.2f}%" if paired and tag != baseline else "-"
        bits = statistics.mean(r.get("bits_per_element_overall", float("nan")) for r in rs.values())
        cells = " | ".join(f"{losses[s]:.4f}" if s in losses else "" for s in seeds)
        lines.append(f"| {tag} | {cells} | {mean:.4f} | {spread:.4f} | {gap} | {worst} | {bits:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--baseline", default="fp32")
    p.add_argument("--tags", default=None, help="comma-separated, in this order (default: all, sorted)")
    a = p.parse_args(argv)
    print(table(load(a.folder), a.baseline, a.tags.split(",") if a.tags else None))


if __name__ == "__main__":
    main()
