"""Measured figures, from the benchmarks' JSON: ``measured()`` computes every figure the blocks show once per
process (the Adam study's gaps, the DDP and HSDP step ratios).
"""
from __future__ import annotations

import functools
import glob
import json
import os
import re
import statistics

from .common import DOCS, _rows


def adam_runs() -> dict:
    """tag -> {seed: run} of docs/adam/runs/*.json (docs/adam/run_lm.sh)."""
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(DOCS, "adam", "runs", "*.json"))):
        m = re.match(r"(.+)\.s(\d+)\.json$", os.path.basename(path))
        if m:
            with open(path, encoding="utf-8") as f:
                runs.setdefault(m.group(1), {})[int(m.group(2))] = json.load(f)
    return runs


def adam_gap(runs: dict, tag: str, baseline: str) -> tuple[float, int]:
    """Gap of the mean held-out loss of ``tag`` to ``baseline``'s mean, in percent, and the seeds behind it
    (the same formula as examples/adam_study_table.py, docs/adam.md's tables)."""
    mean = statistics.mean(r["held_out_loss"] for r in runs[tag].values())
    base = statistics.mean(r["held_out_loss"] for r in runs[baseline].values())
    return 100 * (mean / base - 1), len(runs[tag])


@functools.lru_cache(maxsize=None)
def measured() -> dict:
    """Every measured figure a rendered block shows, computed from the JSON once."""
    m: dict = {}
    runs = adam_runs()
    for key, tag, base in (("adam_ddp", "tgc", "fp32"), ("adam_hsdp", "fsdp-tgc", "fsdp-hsdp-fp32"),
                           ("adam_hvd", "hvd-tgc", "hvd-fp32"), ("adam_stdlib", "stdlib-6x96-tgc", "stdlib-6x96-fp32"),
                           ("adam_plain", "terngrad-adamw", "fp32"),
                           ("adam_plain_stdlib", "stdlib-6x96-terngrad-adamw", "stdlib-6x96-fp32"),
                           ("adam_refresh", "tg-adamw-m128-minnumel0", "fp32"), ("adam_fp16hook", "fp16hook", "fp32"),
                           ("adam_powersgd4", "powersgd4", "fp32"),
                           ("adam_ddp4", "ddp4-tgc-allgather", "ddp4-fp32"),
                           ("adam_ddp4_ret", "ddp4-tgc-reternarized", "ddp4-fp32")):
        m[key], m[key + "_seeds"] = adam_gap(runs, tag, base)
    m["bits_tgc"] = statistics.mean(r["bits_per_element_overall"] for r in runs["tgc"].values())
    m["bits_defaults"] = statistics.mean(r["bits_per_element_overall"] for r in runs["tg-adamw-defaults"].values())
    for model in ("mlp", "resnet50"):
        r = _rows(f"docs/ddp/{model}-n2-1gbit.json")
        m[f"ddp_{model}_vs_psgd4"] = r["terngrad"]["step_ms"] / r["powersgd4"]["step_ms"]
        m[f"ddp_{model}_vs_fp16"] = r["terngrad"]["step_ms"] / r["fp16"]["step_ms"]
        m[f"ddp_{model}_bits"] = r["terngrad"]["bits_per_param"]
    side = "docs/ddp/side-by-side"
    for rel in ("docs/ddp/gpt2-regime8/gpt2-n2-regime8.json", "docs/ddp/gpt2-regime8/gpt2-n2-regime8-r5.json"):
        r = _rows(rel)
        key = "r5" if rel.endswith("-r5.json") else "r3"
        m[f"ddp_gpt2_{key}_vs_psgd4"] = r["terngrad"]["step_ms"] / r["powersgd4"]["step_ms"]
        m[f"ddp_gpt2_{key}_tg_vs_psgd4"] = r["terngrad-tgadamw"]["step_ms"] / r["powersgd4"]["step_ms"]
    m["ddp_gpt2_vs_fp16"] = (_rows("docs/ddp/gpt2-regime8/gpt2-n2-regime8.json")["terngrad"]["step_ms"]
                             / _rows("docs/ddp/gpt2-regime8/gpt2-n2-regime8.json")["fp16"]["step_ms"])
    del side
    for tag, rel in (("", "docs/fsdp/gpt2-L4-E256-n2x2-regime8.json"),
                     ("_r2", "docs/fsdp/gpt2-L4-E256-n2x2-regime8-r2.json")):
        r = _rows(rel)
        tg, bf = r["hsdp-terngrad"], r["hsdp-bf16"]
        m["hsdp_step_vs_bf16" + tag] = tg["step_ms"] / bf["step_ms"]
        link = lambda row: sum(sum(v) for v in row["link_bytes_per_step"].values())  # noqa: E731
        m["hsdp_bytes_vs_bf16" + tag] = link(tg) / link(bf)
    return m
