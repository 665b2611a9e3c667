"""examples/fsdp_benchmark.py's table, limits, ratios and goals on a made-up cell (pure functions, no cluster)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import fsdp_benchmark as fb  # noqa: E402


def _cell():
    link = {"hsdp-bf16": 6.5e6, "hsdp-terngrad": 0.8e6, "hsdp-fp32": 13e6, "local": 1e3}
    step = {"hsdp-bf16": 2000.0, "hsdp-terngrad": 1100.0, "hsdp-fp32": 4000.0, "local": 800.0}
    rows = []
    for key in ("hsdp-fp32", "hsdp-bf16", "hsdp-terngrad", "local"):
        b = link[key]
        row = {"config": key, "step_ms": step[key], "step_ms_by_round": [step[key]] * 2,
               "link_bytes_per_step": {"tgf-h0": [b, b], "tgf-h1": [b, b]},
               "replicas_identical": None if key == "local" else True}
        if key == "hsdp-terngrad":
            pr = {"codec_s": 0.01, "hook_s": 0.1, "gather_wait_s": 0.08, "tensors": 18, "elements": 1.6e6,
                  "uncompressed_elements": 6912, "collectives": 5, "payload_bytes_sent": 2e5,
                  "handshake_bytes_sent": 0}
            row.update(codec_ms=10.0, hook_ms=100.0, terngrad_per_rank_per_step=[pr] * 4,
                       terngrad_bytes_sent_per_host={"tgf-h0": 4e5, "tgf-h1": 4e5},
                       terngrad_config={"min_numel": 4096})
        rows.append(row)
    return {"rows": rows, "rate": "8000kbit", "hosts": 2, "ranks": 4, "ranks_per_host": 2, "params": 3257856,
            "tensors": 52, "n_layer": 4, "n_embd": 256, "seq_len": 128, "batch": 8,
            "compute_alone": {"compute_ms": 400.0, "tensors_small": 34},
            "regime": fb.regime_rate(8, 0.4, 3257856, 4, 2)}


def test_limits_ratios_goals_and_table():
    res = _cell()
    tg = res["rows"][2]
    limit, compute, codec, wire = fb.limit_ms(res, tg)
    assert compute == 800.0 and codec == 10.0
    assert abs(wire - 1000 * 8 * 0.8e6 / 8e6) < 1e-9                     # busier direction at 8 Mbit/s: 800 ms
    assert limit == compute + codec + wire
    s = fb.summary(res)
    assert abs(s["ratios_vs_bf16"]["hsdp-terngrad"]["step"] - 0.55) < 1e-12
    assert abs(s["ratios_vs_bf16"]["hsdp-terngrad"]["host_link_bytes"] - 0.8 / 6.5) < 1e-12
    assert s["goals"] == {"host_link_bytes_le_0.15x_bf16": True, "step_le_0.6x_bf16": True, "replicas_identical": True}
    res["rows"][1]["replicas_identical"] = False
    assert fb.summary(res)["goals"]["replicas_identical"] is False
    text = "\n".join(fb.table(res))
    assert "| hsdp-terngrad | 1100 |" in text and "0.123x" in text and "**no**" in text and "MISSED" in text
    # native payload per host: 2(R-1)/R x dtype bytes x parameters
    assert f"| {2 * 3257856 / 1e6:.3f} |" in text


def test_cell_path_and_help():
    import argparse
    args = argparse.Namespace(n_layer=4, n_embd=256, hosts=2, ranks_per_host=2, regime_compute="every-rank",
                              tag="r2", out="docs/fsdp")
    assert fb.cell_path(args, 8.0).endswith("docs/fsdp/gpt2-L4-E256-n2x2-regime8-every-rank-r2.json")
