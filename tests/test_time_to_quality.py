"""examples/time_to_quality.py's table from hand-made results (no cluster, no training): the target is fp32's final
held-out loss, a method reaches it at its first evaluation at or below it, and the speed-up is the best other
method's time over the row's own."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import time_to_quality as ttq  # noqa: E402


REGIME = {"ratio": 8.0, "compute_alone_ms": 100.0, "params": 1000, "bytes_per_host": 4000.0, "gbps": 0.012345,
          "rate": "12345kbit", "n_layer": 4}


def _curve(*points):
    return [{"step": s, "train_s": t, "held_out_loss": h} for s, t, h in points]


def _write(path, method, curve, steps=150):
    res = {"method": method, "label": ttq.METHODS[method][0], "steps": steps, "seed": 0, "params": 1000,
           "recipe": "nanogpt", "eval_every": 50, "curve": curve, "held_out_loss": curve[-1]["held_out_loss"],
           "regime": REGIME}
    (path / f"{method}.json").write_text(json.dumps(res))


def _row(table, method):
    label = ttq.METHODS[method][0]
    rows = [line for line in table if line.startswith(f"| {label} |")]
    assert len(rows) == 1, table
    return [c.strip() for c in rows[0].strip("|").split("|")]


def test_first_reach_is_the_first_point_at_or_below_the_target():
    curve = _curve((50, 5.0, 2.5), (100, 10.0, 2.0), (150, 15.0, 1.9))
    assert ttq.first_reach(curve, 2.0)["step"] == 100          # equal counts as reached
    assert ttq.first_reach(curve, 2.4)["step"] == 100
    assert ttq.first_reach(curve, 3.0)["step"] == 50
    assert ttq.first_reach(curve, 1.8) is None


def test_table_only_from_saved_curves(tmp_path):
    # fp32 ends at 2.0 (the target) at 150 steps, 30 s; fp16 gets there at step 100 (18 s); PowerSGD never;
    # TernGrad at step 50 (6 s): 3x sooner than fp16, the best other
    _write(tmp_path, "fp32", _curve((50, 10.0, 2.6), (100, 20.0, 2.2), (150, 30.0, 2.0)))
    _write(tmp_path, "fp16", _curve((50, 9.0, 2.5), (100, 18.0, 1.99), (150, 27.0, 1.95)))
    _write(tmp_path, "powersgd4", _curve((50, 4.0, 2.9), (100, 8.0, 2.5), (150, 12.0, 2.1)))
    _write(tmp_path, "terngrad", _curve((50, 6.0, 2.0), (100, 12.0, 1.8), (150, 18.0, 1.7)))
    (tmp_path / "regime.json").write_text(json.dumps(REGIME))
    lines = ttq.main(["--table-only", "--out", str(tmp_path)])
    written = (tmp_path / "table.md").read_text()
    assert "\n".join(lines) in written and "--table-only" in written
    assert "links 0.0123 Gbit/s (12345kbit)" in written and "Warning" not in written
    # method, ms/step, final, target, step, train s, speed-up
    assert _row(lines, "fp32") == [ttq.METHODS["fp32"][0], "200", "2.0000", "2.0000", "150", "30.0", "0.20x"]
    assert _row(lines, "fp16") == [ttq.METHODS["fp16"][0], "180", "1.9500", "2.0000", "100", "18.0", "0.33x"]
    assert _row(lines, "powersgd4")[4:] == ["never", "", ""]
    assert _row(lines, "terngrad") == [ttq.METHODS["terngrad"][0], "120", "1.7000", "2.0000", "50", "6.0", "3.00x"]
    assert lines[-1].startswith("Goal met: TernGrad reaches the target in 6.0 s, the best other (fp16) in 18.0 s: "
                                "3.00x sooner")


def test_table_verdict_when_terngrad_is_not_soon_enough(tmp_path):
    _write(tmp_path, "fp32", _curve((50, 10.0, 2.6), (100, 20.0, 2.0)))
    _write(tmp_path, "terngrad", _curve((50, 8.0, 2.1), (100, 16.0, 1.9)))
    lines = ttq.main(["--table-only", "--methods", "fp32,terngrad", "--out", str(tmp_path)])
    assert _row(lines, "terngrad")[4:] == ["100", "16.0", "1.25x"]
    assert lines[-1].startswith("Goal not met") and "1.25x sooner" in lines[-1]


def test_table_only_needs_saved_results(tmp_path):
    with pytest.raises(SystemExit, match="no results"):
        ttq.main(["--table-only", "--out", str(tmp_path)])


def test_resuming_refuses_results_of_another_setting(tmp_path):
    """A saved method ran 150 steps: a sweep of 1000 steps into the same folder stops rather than mixing them."""
    _write(tmp_path, "fp32", _curve((50, 10.0, 2.6), (150, 30.0, 2.0)))
    with pytest.raises(SystemExit, match="ran 150 steps"):
        ttq.main(["--methods", "fp32", "--steps", "1000", "--out", str(tmp_path)])
    assert ttq.main(["--methods", "fp32", "--steps", "150", "--out", str(tmp_path)])[-1] == "No TernGrad run."
