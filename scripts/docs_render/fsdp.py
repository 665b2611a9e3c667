"""docs/fsdp.md's blocks: the accuracy, speed and memory tables from the FSDP benchmarks' JSON, and the scale
text from the model.
"""
from __future__ import annotations

from .common import _example, _load, _pct, _x


def block_fsdp_lm() -> str:
    """fsdp.md's accuracy table, from docs/fsdp/lm/*.json (examples/transformers_lm.py --frontend fsdp)."""
    lines = ["| seed, steps | TernGrad held-out loss | native HSDP fp32 | TernGrad vs fp32 | replicas identical |",
             "|---|---|---|---|---|"]
    for steps, suffix in ((300, ""), (600, "-600")):
        for seed in (0, 1):
            tg = _load(f"docs/fsdp/lm/terngrad-seed{seed}{suffix}.json")
            fp = _load(f"docs/fsdp/lm/none-seed{seed}{suffix}.json")
            same = "both" if tg["params_identical"] and fp["params_identical"] else "no"
            lines.append(f"| {seed}, {steps} | {tg['held_out_loss']:.4f} | {fp['held_out_loss']:.4f} | "
                         f"{_pct(100 * (tg['held_out_loss'] / fp['held_out_loss'] - 1))} | {same} |")
    return "\n".join(lines)


FSDP_SPEED_LABELS = {"hsdp-fp32": "HSDP fp32 (native)", "hsdp-bf16": "HSDP bf16 reduce (native)",
                     "hsdp-terngrad": "HSDP + TernGrad", "local": "compute alone (no exchange)"}


def block_fsdp_speed() -> str:
    """fsdp.md's speed table, from docs/fsdp/gpt2-L4-E256-n2x2-regime8.json and its repeat (-r2), with
    examples/fsdp_benchmark.py's own limit, host-link and ratio formulas."""
    fb = _example("fsdp_benchmark")
    res = _load("docs/fsdp/gpt2-L4-E256-n2x2-regime8.json")
    rep = _load("docs/fsdp/gpt2-L4-E256-n2x2-regime8-r2.json")
    s, s2 = fb.summary(res), fb.summary(rep)
    lines = ["| configuration | ms/step | limit ms (compute + codec + link) | host-link MB/step per host "
             "| step vs HSDP bf16 | host-link bytes vs HSDP bf16 | replicas identical |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        rat = s["ratios_vs_bf16"][r["config"]]
        lim = fb.limit_ms(res, r)
        local = r["config"] == "local"
        limit = f"{lim[0]:.0f}" if local else f"{lim[0]:.0f} = {lim[1]:.0f} + {lim[2]:.0f} + {lim[3]:.0f}"
        bold = (lambda t: f"**{t}**") if r["config"] == "hsdp-terngrad" else (lambda t: t)  # noqa: E731
        same = "–" if r["replicas_identical"] is None else ("yes" if r["replicas_identical"] else "**no**")
        nbytes = "–" if local else bold(f"{rat['host_link_bytes']:.3f}x")
        lines.append(f"| {FSDP_SPEED_LABELS.get(r['config'], r['config'])} | {r['step_ms']:.0f} | {limit} "
                     f"| {fb.host_link(r)[0] / 1e6:.3f} | {bold(_x(rat['step']))} | {nbytes} | {same} |")
    tg, tg2 = s["ratios_vs_bf16"]["hsdp-terngrad"], s2["ratios_vs_bf16"]["hsdp-terngrad"]
    met = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    g = s["goals"]
    alone = sorted([res["compute_alone"]["compute_ms"], rep["compute_alone"]["compute_ms"]])
    lines += ["", f"Goals: host-link bytes ≤ 0.15x bf16's ({tg['host_link_bytes']:.3f}x, "
              f"{met(g['host_link_bytes_le_0.15x_bf16'])}), step time ≤ 0.6x bf16's ({_x(tg['step'])}, "
              f"{met(g['step_le_0.6x_bf16'])}), replicas identical ({met(g['replicas_identical'])}, every "
              f"configuration). The repeat (`--tag r2`, `docs/fsdp/gpt2-L4-E256-n2x2-regime8-r2.json`) gave "
              f"{_x(tg2['step'])} step time and {tg2['host_link_bytes']:.3f}x bytes: one rank's compute alone, the "
              f"regime's yardstick, measured {alone[0]:.0f} ms there and {alone[1]:.0f} ms here on this shared "
              f"machine, so take the larger step ratio as the honest figure."]
    tgrow = next(r for r in res["rows"] if r["config"] == "hsdp-terngrad")
    wait = 1000 * max(p["gather_wait_s"] for p in tgrow["terngrad_per_rank_per_step"])
    lines.append(f"TernGrad's hook blocks backward ({wait:.0f} ms per step waiting in allgathers, the most of any "
                 f"rank, of {tgrow['hook_ms']:.0f} ms inside the hook), with no overlap.")
    return "\n".join(lines)


FSDP_MEMORY_LABELS = {"ddp-terngrad": "DDP + TernGrad", "hsdp-fp32": "HSDP fp32 (native)",
                      "hsdp-terngrad": "HSDP + TernGrad"}


def block_fsdp_memory() -> str:
    """fsdp.md's memory table, from docs/fsdp/memory-gpt2-small-shapes.json and docs/fsdp/memory.json
    (examples/fsdp_memory.py): bytes per rank after the optimizer's step, the largest rank's."""
    def table(rel):
        res = _load(rel)
        ddp = next(r for r in res["rows"] if r["config"].startswith("ddp"))["max_persistent"]
        out = []
        for r in res["rows"]:
            big = max(r["per_rank"], key=lambda x: x["persistent"])
            out.append((r, big, r["max_persistent"] / ddp, (r["max_persistent"] + r["transient"]) / ddp))
        return res, out
    res, rows = table("docs/fsdp/memory-gpt2-small-shapes.json")
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    lines = [f"GPT-2 shapes, 12 layers x 768 (byte vocabulary: {res['params'] / 1e6:.1f}M parameters), AdamW, "
             f"{res['ranks'] // res['G']} nodes x G = {res['G']}:", "",
             "| configuration | params | grads | optimizer state | persistent (largest rank) | vs DDP "
             "| + transient (one unit gathered, one prefetched) | peak vs DDP |",
             "|---|---|---|---|---|---|---|---|"]
    for r, big, vs, peak in rows:
        lines.append(f"| {FSDP_MEMORY_LABELS.get(r['config'], r['config'])} | {mb(big['params'])} | {mb(big['grads'])} "
                     f"| {mb(big['optimizer'])} | {mb(r['max_persistent'])} | {vs:.3f}x "
                     f"| {mb(r['transient']) if r['transient'] else 0} | {peak:.3f}x |")
    small, srows = table("docs/fsdp/memory.json")
    ddp = next(x for x in srows if x[0]["config"].startswith("ddp"))
    hsdp = next(x for x in srows if x[0]["config"] == "hsdp-terngrad")
    lines += ["", f"The benchmark's GPT-2, 4 layers x 256 ({small['params'] / 1e6:.2f}M parameters; "
              "`docs/fsdp/memory.json`): persistent "
              f"{mb(ddp[0]['max_persistent'])} (DDP) against {mb(hsdp[0]['max_persistent'])} ({hsdp[2]:.3f}x); "
              f"with the transient {hsdp[3]:.3f}x (a 4-block model: one block is a quarter of it)."]
    return "\n".join(lines)


def block_fsdp_scale(be: dict, mod: dict) -> str:
    """fsdp.md's scale text: the allgather's break-even (hsdp_break_even) beside the default's plan and the sharded
    exchange's (modelled(), the source of choosing.md's HSDP table)."""
    first, at16, last = be["first"], be["at16"], be["last"]
    d16, dl = mod["hsdp"][("ethernet", 4, 16)], mod["hsdp"][("ethernet", 4, last[0])]
    return (f"With `exchange=\"allgather\"` every rank receives R-1 payloads, so TernGrad's cross-node bytes grow with "
            f"the node count: on the Ethernet cluster it beats HSDP bf16 up to {be['last_win_nodes']} nodes "
            f"({_x(first[1])} at {first[0]} nodes), falls just below it at 16 nodes ({_x(at16[1])}: about the same "
            f"bytes as bf16's ring) and loses beyond ({_x(last[1])} at {last[0]} nodes). The default runs the "
            f"allgather among up to 4 replicas only and the requantized exchange among more, whose traffic stays "
            f"flat in the replica count: {_x(d16['default'])} at 16 nodes and {_x(dl['default'])} at {last[0]} "
            f"nodes, with the optimizer's noise estimate. `exchange=\"sharded\"` (bit for bit in "
            f"`tests/test_fsdp.py` too) is flat as well ({_x(d16['sharded'])} at 16 nodes, {_x(dl['sharded'])} at "
            f"{last[0]} nodes) but gives no noise estimate. Keep the defaults; the settings per cluster: "
            f"[choosing settings](choosing.md).")
