"""docs/realshapes.md's tables: the real-shapes cells and ResNet-50's repeats."""
from __future__ import annotations

from .common import _load, _x


# realshapes.md's cells (docs/realshapes/<cell>.json, examples/realshapes_benchmark.py) in the page's order, each
# with the columns its TernGrad row sets in bold: the ones the page's goals judge for that cell.
REALSHAPES_CELLS = (("resnet50-n2-1gbit", ("vs fp32", "vs fp16", "step / limit")),
                    ("transformer-n2-1gbit", ("vs fp16",)),
                    ("resnet50-n4-1gbit", ("vs fp16",)),
                    ("resnet50-n2-none", ("vs fp32",)))


def _realshapes_limit(res: dict, r: dict, link: str) -> tuple:
    """(limit ms, compute, codec, wire) of a TernGrad row: compute alone (the calibration) + TernGrad's codec clock
    + the bytes a rank receives per step at the link rate (none on unshaped links)."""
    rate = {"1gbit": 1e9, "none": None}[link]
    wire = 1000 * 8 * r["bytes_received_per_step"] / rate if rate else 0.0
    compute = res["calibration"]["compute_ms"]
    return compute + r["codec_ms"] + wire, compute, r["codec_ms"], wire


def block_realshapes() -> str:
    """realshapes.md's results table (REALSHAPES_CELLS): per configuration its median step and per-round medians,
    images per second per worker, speed against fp32 and fp16, and for TernGrad its step-time limit."""
    cols = ["model", "N", "link", "configuration", "ms/step", "by round", "img/s per worker", "vs fp32", "vs fp16",
            "limit ms (compute + codec + wire)", "step / limit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for cell, bold in REALSHAPES_CELLS:
        res = _load(f"docs/realshapes/{cell}.json")
        link = cell.rsplit("-", 1)[1]
        by = {r["config"]: r for r in res["rows"]}
        for r in res["rows"]:
            main = r["config"] == "terngrad"
            b = (lambda col, v: f"**{v}**" if main and col in bold else v)  # noqa: E731
            c = {"vs fp32": _x(by["fp32"]["step_ms"] / r["step_ms"]),
                 "vs fp16": _x(by["fp16"]["step_ms"] / r["step_ms"]),
                 "limit": "", "step / limit": ""}
            if "codec_ms" in r:
                lim, compute, codec, wire = _realshapes_limit(res, r, link)
                c["limit"] = f"{lim:.0f} = {compute:.0f} + {codec:.0f} + {wire:.0f}"
                c["step / limit"] = _x(r["step_ms"] / lim)
            name, step = r["config"], f"{r['step_ms']:.0f}"
            if main:
                name, step = f"**{name}**", f"**{step}**"
            lines.append(f"| {res['model']} | {res['ranks']} | {link} | {name} | {step} "
                         f"| {', '.join(f'{x:.0f}' for x in r['step_ms_by_round'])} "
                         f"| {1000 * res['batch'] / r['step_ms']:.1f} | {b('vs fp32', c['vs fp32'])} "
                         f"| {b('vs fp16', c['vs fp16'])} | {c['limit']} | {b('step / limit', c['step / limit'])} |")
    return "\n".join(lines)


def block_realshapes_repeats() -> str:
    """realshapes.md's repeats of ResNet-50 at N = 2, 1 Gbit/s (docs/realshapes/resnet50-n2-1gbit[-repeatK].json)."""
    lines = ["| run | fp32 | fp16 | terngrad (defaults) | vs fp16 | vs fp32 | limit, step/limit | terngrad-shared "
             "| vs fp16 |", "|---|---|---|---|---|---|---|---|---|"]
    for run, tail in ((1, ""), (2, "-repeat2"), (3, "-repeat3")):
        res = _load(f"docs/realshapes/resnet50-n2-1gbit{tail}.json")
        by = {r["config"]: r for r in res["rows"]}
        fp32, fp16, t, sh = by["fp32"]["step_ms"], by["fp16"]["step_ms"], by["terngrad"], by["terngrad-shared"]
        lim = _realshapes_limit(res, t, "1gbit")[0]
        lines.append(f"| {'1 (table above)' if run == 1 else run} | {fp32:.0f} | {fp16:.0f} | {t['step_ms']:.0f} "
                     f"({', '.join(f'{x:.0f}' for x in t['step_ms_by_round'])}) | {_x(fp16 / t['step_ms'])} "
                     f"| {_x(fp32 / t['step_ms'])} | {lim:.0f}, {_x(t['step_ms'] / lim)} | {sh['step_ms']:.0f} "
                     f"| {_x(fp16 / sh['step_ms'])} |")
    return "\n".join(lines)
