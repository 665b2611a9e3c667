"""The Adam study's table (docs/adam.md) from the runs' JSON results (docs/adam/run_lm.sh writes them).

    python examples/adam_study_table.py docs/adam/runs [--baseline fp32] [--prefix ddp-]

One row per configuration (the run tag): held-out loss per seed, mean and spread (max - min over seeds), the gap
of the mean to the baseline's mean, the worst per-seed gap (seeds paired: same initial weights and data), and
the bits per gradient element handed to collectives, averaged over the whole run (refreshes, warm-up and
full-precision tensors included).  A row whose runs record another global batch (sequences per step over all
ranks, ``global_batch`` in transformers_lm.py's result) or sequence length than the baseline's gets no gaps: its
gap cells say what differs (runs written before those fields existed are not checked).
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
        differs = _differs(rs, base) if base else None
        if differs:
            gap = worst = f"not comparable: {differs}"
        bits = statistics.mean(r.get("bits_per_element_overall", float("nan")) for r in rs.values())
        cells = " | ".join(f"{losses[s]:.4f}" if s in losses else "" for s in seeds)
        lines.append(f"| {tag} | {cells} | {mean:.4f} | {spread:.4f} | {gap} | {worst} | {bits:.2f} |")
    return "\n".join(lines)


def _differs(runs: dict, base: dict) -> str | None:
    """What makes these runs' held-out losses incomparable with the baseline's: another global batch or sequence
    length (as recorded; None where either side does not record it)."""
    for key, what in (("global_batch", "global batch"), ("seq_len", "sequence length")):
        mine = {r[key] for r in runs.values() if key in r}
        theirs = {r[key] for r in base.values() if key in r}
        if mine and theirs and mine != theirs:
            return f"{what} {'/'.join(map(str, sorted(mine)))} vs {'/'.join(map(str, sorted(theirs)))}"
    return None


def bits_projection(model_args: list, min_numel: int, schedule=None, steps=(1000, 100_000)) -> dict:
    """Bits per gradient element one rank hands to collectives, averaged over runs of ``steps`` steps, for
    examples/transformers_lm.py's model: ternarized tensors' payloads (codec.sizes: 2-bit codes, scaler, header)
    on ternary steps and 32 bits on the schedule's refreshes; tensors under ``min_numel`` at 32 bits always.
    Also the steady state (every step past the spacing's growth) and the ternary step alone."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import transformers_lm as lm

    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.codec.schedule import RefreshSchedule
    from horovod_terngrad.codec.sizes import payload_size
    schedule = schedule or RefreshSchedule()
    cfg = TernGradConfig(min_numel=min_numel)
    model = lm.make_model(lm.parse_args(model_args))
    tern = plain = tern_bits = 0
    for name, p in model.named_parameters():
        if cfg.compresses(name, p.numel()):
            tern += p.numel()
            tern_bits += 8 * payload_size(p.numel(), cfg.packing, cfg.bucket_size)
        else:
            plain += p.numel()
    total = tern + plain
    per_tern = tern_bits / tern
    out = {"elements": total, "ternarized_share": tern / total, "ternary_step": (tern_bits + 32 * plain) / total}
    for n in steps:
        out[f"run_{n}"] = (tern * schedule.bits_per_element(n, per_tern) + 32 * plain) / total
    out["steady"] = (tern * schedule.steady_bits_per_element(per_tern) + 32 * plain) / total
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--baseline", default="fp32")
    p.add_argument("--tags", default=None, help="comma-separated, in this order (default: all, sorted)")
    p.add_argument("--bits", action="store_true",
                   help="also the bits projection of the default schedule for the study's models (min_numel 0 and 4096)")
    a = p.parse_args(argv)
    print(table(load(a.folder), a.baseline, a.tags.split(",") if a.tags else None))
    if a.bits:
        print()
        print("| model | min_numel | ternarized share | ternary step | 1000-step run | 100k-step run | steady |")
        print("|---|---|---|---|---|---|---|")
        for label, margs in (("GPT-2 4x128, bytes", ["--n-layer", "4"]), ("GPT-2 6x128, bytes", ["--n-layer", "6"]),
                             ("GPT-2 12x768, 50257 vocab (GPT-2 small)",
                              ["--n-layer", "12", "--n-embd", "768", "--n-head", "12"])):
            for mn in (0, 4096):
                b = bits_projection(margs + (["--vocab", "50257"] if "768" in margs else []), mn)
                print(f"| {label} | {mn} | {100 * b['ternarized_share']:.2f}% | {b['ternary_step']:.3f} | "
                      f"{b['run_1000']:.3f} | {b['run_100000']:.3f} | {b['steady']:.3f} |")


if __name__ == "__main__":
    main()
