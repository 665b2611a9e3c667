"""docs/cluster.md's blocks: the emulated-cluster tables (released defaults, the calibrated regime, where
compute caps the gain) and the link measurements.
"""
from __future__ import annotations

from .common import _example, _load, _x


def block_cluster_regime(model: str, tags: tuple, last: str) -> str:
    """cluster.md's calibrated-regime table of ``model`` (2 hosts x 2 ranks): per configuration its step in each
    repeat (docs/cluster/regime/<model>-n2x2-regime8[-<tag>].json, examples/emulated_cluster_benchmark.py), its
    speed against fp16, the bytes its busiest host link carried one way per step (first repeat), and ``last``:
    "limit" (step / (compute alone + codec + those bytes at the link rate), per repeat) or "flat" (bytes against
    the flat exchange's)."""
    eb = _example("emulated_cluster_benchmark")
    cells = [_load(f"docs/cluster/regime/{model}-n2x2-regime8{'-' + t if t else ''}.json") for t in tags]
    names = " / ".join(t or "r1" for t in tags)
    alone = [c["compute_alone"]["compute_ms"] for c in cells]
    lines = [f"One rank's compute alone: {' / '.join(f'{a:.1f}' for a in alone)} ms ({names}), so the links ran at "
             f"{' / '.join(f'{eb.link_gbps(c):.3f}' for c in cells)} Gbit/s.", "",
             f"| configuration | ms/step {names} | vs fp16 | MB/step per host link | "
             + ("step / limit |" if last == "limit" else "vs flat's bytes |"), "|---|---|---|---|---|"]
    by = [{r["config"]: r for r in c["rows"]} for c in cells]
    for r in cells[0]["rows"]:
        k = r["config"]
        rows = [b[k] for b in by]
        label = k + (" (auto: node-aware)" if k == "terngrad" and r.get("node_aware") else
                     " (auto: flat)" if k == "terngrad" else "")
        steps = " / ".join(f"{x['step_ms']:.0f}" for x in rows)
        vs16 = "1.00x" if k == "fp16" else " / ".join(_x(b["fp16"]["step_ms"] / x["step_ms"]) for b, x in zip(by, rows))
        nbytes = eb._most_link_bytes(r)
        if last == "limit":
            lim = []
            for c, x in zip(cells, rows):
                limit = (c["compute_alone"]["compute_ms"] + x.get("codec_ms", 0.0)
                         + 1000 * 8 * eb._most_link_bytes(x) / (eb.link_gbps(c) * 1e9))
                lim.append(_x(x["step_ms"] / limit))
            tail = " / ".join(lim)
        else:
            flat = by[0].get("terngrad-flat")
            tail = _x(nbytes / eb._most_link_bytes(flat)) if k.startswith("terngrad") and flat else ""
        lines.append(f"| {label} | {steps} | {vs16} | {nbytes / 1e6:.1f} | {tail} |")
    return "\n".join(lines)


def _cluster_limit(eb, res: dict, row: dict):
    """step / limit of a row of an emulated-cluster cell, as examples/emulated_cluster_benchmark.py's table
    computes it (compute alone + codec + the bytes it received at the link rate); None without a limit."""
    gbps = eb.link_gbps(res)
    if "bytes_received_per_step" not in row or not gbps:
        return None
    return row["step_ms"] / (res["calibration"]["compute_ms"] + row["codec_ms"]
                             + 1000 * 8 * row["bytes_received_per_step"] / (gbps * 1e9))


CLUSTER_RELEASED = (("resnet50", 2, "1gbit", ("r1", "r2")), ("resnet50", 4, "1gbit", ("r1", "r2")),
                    ("transformer", 2, "1gbit", ("r1", "r2")), ("resnet50", 2, "none", ("r1",)),
                    ("transformer", 2, "none", ("r1",)))


def block_cluster_released() -> str:
    """cluster.md's table of docs/cluster/released/<model>-n<N>-<rate>-<tag>.json: ms per step of each
    configuration, repeats side by side, TernGrad's speedups and its step against its limit."""
    eb = _example("emulated_cluster_benchmark")
    lines = ["| model | N | link | fp32 | fp16 | TernGrad (defaults) | step/limit | auto |",
             "|---|---|---|---|---|---|---|---|"]
    for model, N, rate, tags in CLUSTER_RELEASED:
        cells = [_load(f"docs/cluster/released/{model}-n{N}-{rate}-{t}.json") for t in tags]
        by = [{r["config"]: r for r in c["rows"]} for c in cells]
        ms = lambda k: " / ".join(f"{b[k]['step_ms']:.0f}" for b in by)  # noqa: E731
        ratios = "; ".join(f"{_x(b['fp16']['step_ms'] / b['terngrad']['step_ms'])} / "
                           f"{_x(b['fp32']['step_ms'] / b['terngrad']['step_ms'])}" for b in by)
        if rate == "none":
            link = f"unshaped ({eb.link_gbps(cells[0]):.1f} Gbit/s)"
            tg = f"{ms('terngrad')} ({' / '.join(_x(b['terngrad']['step_ms'] / b['fp32']['step_ms']) for b in by)} of fp32's step)"
        else:
            link = rate
            tg = f"{ms('terngrad')} ({ratios})"
        lim = " / ".join(_x(_cluster_limit(eb, c, b["terngrad"])) for c, b in zip(cells, by))
        lines.append(f"| {model} | {N} | {link} | {ms('fp32')} | {ms('fp16')} | {tg} | {lim} | {ms('terngrad-auto')} |")
    return "\n".join(lines)


def block_cluster_released_n4() -> str:
    """cluster.md's two further ResNet-50 repeats at N = 4, 1 Gbit/s (docs/cluster/released/resnet50-n4-1gbit-r3/r4)."""
    eb = _example("emulated_cluster_benchmark")
    lines = ["| repeat | fp16 ms | TernGrad (defaults) ms | vs fp16 | step/limit | auto ms | auto vs fp16 |",
             "|---|---|---|---|---|---|---|"]
    for tag in ("r3", "r4"):
        c = _load(f"docs/cluster/released/resnet50-n4-1gbit-{tag}.json")
        b = {r["config"]: r for r in c["rows"]}
        f16, tg, auto = b["fp16"]["step_ms"], b["terngrad"]["step_ms"], b["terngrad-auto"]["step_ms"]
        lines.append(f"| {tag} | {f16:.0f} | {tg:.0f} | {_x(f16 / tg)} | {_x(_cluster_limit(eb, c, b['terngrad']))} "
                     f"| {auto:.0f} | {_x(f16 / auto)} |")
    return "\n".join(lines)


W = "docs/cluster/workload/"
CLUSTER_WORKLOAD = (
    ("transformer, 8 x 64 tokens (default)", 2, ("docs/cluster/transformer-n2-1gbit-r1.json",
                                                 "docs/cluster/transformer-n2-1gbit-r2.json")),
    ("transformer, 8 x 32 tokens", 2, (W + "transformer-n2-1gbit-ctx32.json",)),
    ("transformer, 8 x 16 tokens", 2, (W + "transformer-n2-1gbit-ctx16.json",)),
    ("resnet50, 8 x 64x64 (default)", 2, ("docs/cluster/resnet50-n2-1gbit-r1.json",
                                          "docs/cluster/resnet50-n2-1gbit-r2.json")),
    ("resnet50, 8 x 32x32", 2, (W + "resnet50-n2-1gbit-img32.json",)),
    ("resnet50, 8 x 64x64 (default)", 4, ("docs/cluster/resnet50-n4-1gbit-r1.json",
                                          "docs/cluster/resnet50-n4-1gbit-r2.json")),
    ("resnet50, 8 x 32x32", 4, (W + "resnet50-n4-1gbit-img32.json",)),
    ("transformer, 8 x 16 tokens", 4, (W + "transformer-n4-1gbit-ctx16.json",)),
)
CLUSTER_WORKLOAD_FIXED = (("transformer, 8 x 16 tokens", 2, (W + "transformer-n2-1gbit-ctx16-fixed.json",)),
                          ("resnet50, 8 x 32x32", 4, (W + "resnet50-n4-1gbit-img32-fixed.json",)))


def block_cluster_workload(spec: tuple, rounds: bool = False) -> str:
    """cluster.md's "where compute caps the gain" tables: per workload its cells (repeats side by side), the
    calibration's compute, each configuration's ms per step, TernGrad's and auto's speedup vs fp16 and TernGrad's
    step against its limit (examples/emulated_cluster_benchmark.py's formula)."""
    eb = _example("emulated_cluster_benchmark")
    lines = ["| model, workload | N | compute | fp32 | fp16 | TernGrad (defaults) | step/limit | auto |",
             "|---|---|---|---|---|---|---|---|"]
    for label, N, rels in spec:
        cells = [_load(rel) for rel in rels]
        by = [{r["config"]: r for r in c["rows"]} for c in cells]
        comp = sorted(c["calibration"]["compute_ms"] for c in cells)
        compute = f"{comp[0]:.0f}" if len(comp) == 1 else f"{comp[0]:.0f}-{comp[-1]:.0f}"
        ms = lambda k: " / ".join(f"{b[k]['step_ms']:.0f}" for b in by)  # noqa: E731
        vs16 = lambda k: " / ".join(_x(b["fp16"]["step_ms"] / b[k]["step_ms"]) for b in by)  # noqa: E731
        tg = f"{ms('terngrad')} ({vs16('terngrad')})"
        if rounds:
            tg += ", rounds " + "; ".join(", ".join(f"{x:.0f}" for x in b["terngrad"]["step_ms_by_round"]) for b in by)
        lim = " / ".join(_x(_cluster_limit(eb, c, b["terngrad"])) for c, b in zip(cells, by))
        lines.append(f"| {label} | {N} | {compute} | {ms('fp32')} | {ms('fp16')} | {tg} | {lim} "
                     f"| {ms('terngrad-auto')} ({vs16('terngrad-auto')}) |")
    return "\n".join(lines)


def block_link_measurement() -> str:
    """cluster.md: each set of link_measurement.sh runs (docs/cluster/link_measurement.json): the rate measured
    across nodes, how many runs read within 2x of the link's, the rates priced and the plans."""
    d = _load("docs/cluster/link_measurement.json")
    link = d["link_gbps"]
    out = ["| runs (controller, commit: probe) | measured across, Gbit/s (min / median / max) | within 2x of "
           f"{link:g} Gbit/s | priced across | priced inside | plan | MB per step on host 0's link | load (1 min) |",
           "|---|---|---|---|---|---|---|---|"]

    def priced(runs, key):
        return " or ".join(f"{v:g}" for v in sorted({r[key] for r in runs if r[key] is not None})) or "(no grid)"

    order = sorted(d["sets"], key=lambda k: (k.split("-")[0], d["sets"][k]["commit"] != "9fa9b50", k))
    for name in order:
        meta, runs = d["sets"][name], d["runs"][name]
        across = sorted(r["measured_across_gbps"] for r in runs)
        h = len(across) // 2
        median = across[h] if len(across) % 2 else (across[h - 1] + across[h]) / 2
        within = sum(1 for a in across if link / 2 <= a <= 2 * link)
        plans = {}
        for r in runs:
            plans[r["plan"]] = plans.get(r["plan"], 0) + 1
        mb = sorted(r["host0_eth0_MB_per_step_tx_rx"][0] for r in runs)
        loads = sorted(r["loadavg_1min"] for r in runs)
        out.append(f"| {len(runs)} ({name.split('-')[0]}, {meta['commit']}: {meta['probe']}) | "
                   f"{across[0]:.2f} / {median:.2f} / {across[-1]:.2f} | {within} of {len(runs)} | "
                   f"{priced(runs, 'priced_across_gbps')} | {priced(runs, 'priced_inside_gbps')} | "
                   + ", ".join(f"{p} in {n} of {len(runs)}" for p, n in sorted(plans.items()))
                   + f" | {mb[0]:.2f}-{mb[-1]:.2f} | {loads[0]:.1f}-{loads[-1]:.1f} |")
    return "\n".join(out)


# (hosts, the runs' tags): at 8 hosts each run holds three configurations (the eight ranks' copies of four or more
# exceeded the machine's 24 GiB), every run with its own fp16 and local rows
CLUSTER_MANY_HOSTS = ((6, ("n",)), (8, ("n", "o", "p")))


def block_cluster_many_hosts() -> str:
    """scale.md's emulated-cluster tables at 6 and 8 hosts x 1 rank, GPT-2 in the calibrated regime (RATIO 8),
    from docs/cluster/default/gpt2-n<H>-regime8-<tag>.json (examples/ddp_benchmark.py, with its Horovod rows): per
    configuration and run its step, its ratio to DDP's fp16 hook of the same run, bits per parameter, the busiest
    host link's bytes one way per step (measured on eth0), and two limits, as the benchmark's table computes them:
    compute alone (one rank, no exchange) + codec (the configuration's own clock) + those bytes at the link rate,
    and the same with the run's ``local`` row (every rank computing at once on the shared cores) in place of
    compute alone."""
    db = _example("ddp_benchmark")
    out = []
    for hosts, tags in CLUSTER_MANY_HOSTS:
        runs = [(t, _load(f"docs/cluster/default/gpt2-n{hosts}-regime8-{t}.json")) for t in tags]
        head = "; ".join(f"tag {t}: compute alone {res['regime']['compute_alone_ms']:.0f} ms, every rank computing at "
                         f"once (`local`) {_rows_of(res)['local']['step_ms']:.0f} ms, links "
                         f"{res['regime']['gbps']:.3f} Gbit/s" for t, res in runs)
        out += [f"**{hosts} hosts x 1** ({head}):", "",
                "| configuration (tag) | ms/step | vs DDP fp16 of its run | bits/param | MB/step per host link | limit = "
                "compute alone + codec + wire | step / limit | limit (shared cores) | step / that |",
                "|---|---|---|---|---|---|---|---|---|"]
        for t, res in runs:
            out += _many_hosts_rows(db, res, t, skip_fp16=t != tags[0])
        out.append("")
    return "\n".join(out[:-1])


def _rows_of(res: dict) -> dict:
    return {r["config"]: r for r in res["rows"]}


def _many_hosts_rows(db, res: dict, tag: str, skip_fp16: bool) -> list:
    """The table rows of one run (block_cluster_many_hosts); a later run's own fp16 row only sets its ratios."""
    by = _rows_of(res)
    alone, shared = res["regime"]["compute_alone_ms"], by["local"]["step_ms"]
    fp16 = by["fp16"]["step_ms"]
    lines = []
    for r in res["rows"]:
        if r["config"] == "local" or (skip_fp16 and r["config"] == "fp16"):
            continue
        nbytes = db.link_bytes(r)
        codec, wire = db.limit_terms(res, r)
        limit, limit_shared = alone + codec + wire, shared + codec + wire
        bits = f"{r['bits_per_param']:.2f}" if r.get("bits_per_param") is not None else ""
        lines.append(f"| {r['label']} ({tag}) | {r['step_ms']:.0f} | {_x(r['step_ms'] / fp16)} | {bits} | "
                     f"{nbytes / 1e6:.1f} | {limit:.0f} = {alone:.0f} + {codec:.0f} + {wire:.0f} | "
                     f"{_x(r['step_ms'] / limit)} | {limit_shared:.0f} | {_x(r['step_ms'] / limit_shared)} |")
    return lines
