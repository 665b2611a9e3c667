"""examples/study_ddp.py at tiny scale: real DDP over gloo, 2 ranks spawned by the script, two hooks, a few steps,
a small test subset; the JSON, the tables and the plot come out, and the comparison is of like with like."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "examples", "study_ddp.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))

import study_ddp  # noqa: E402


@pytest.mark.slow
def test_study_ddp_runs_every_hook_for_the_same_steps_and_terngrad_changes_the_curve(tmp_path):
    hooks = ["fp32", "terngrad", "powersgd4"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, SCRIPT, "--study", "lenet", "--hooks", ",".join(hooks), "--ranks", "2",
                        "--steps", "12", "--eval-every", "6", "--test-limit", "300", "--seeds", "3",
                        "--out", str(tmp_path), "--timeout", "120", "--ema-decay", "0.9"],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "study_lenet.json").read_text())
    runs = {r["hook"]: r for r in doc["runs"]}
    assert sorted(runs) == sorted(hooks)
    for r in runs.values():
        assert r["ranks"] == 2 and r["steps"] == 12 and r["seed"] == 3 and r["params_identical"]
        assert [c["step"] for c in r["curve"]] == [0, 6, 12]
        assert all(0.0 <= c["test_acc"] <= 1.0 for c in r["curve"])
        assert r["curve"][0]["wall_s"] == 0.0 and r["curve"][-1]["wall_s"] == r["wall_s"] > 0
        # the moving average starts at the initial weights and is evaluated at every record
        assert r["curve"][0]["test_acc_ema"] == r["curve"][0]["test_acc"]
        assert all(0.0 <= c["test_acc_ema"] <= 1.0 for c in r["curve"])
    # the same initial weights for every hook (the same accuracy before the first step) ...
    assert len({r["curve"][0]["test_acc"] for r in runs.values()}) == 1
    # ... and TernGrad compressed something: its curve is not fp32's
    fp32, tg = runs["fp32"]["curve"], runs["terngrad"]["curve"]
    assert [c["loss"] for c in fp32[1:]] != [c["loss"] for c in tg[1:]]
    assert 1.9 < runs["terngrad"]["bits_per_param"] < 3 and runs["fp32"]["bits_per_param"] == 32
    c = doc["comparisons"]["3"]
    assert c["budget_s"] == min(r["wall_s"] for r in runs.values())
    assert c["hooks"]["fp32"]["gap"] == 0 and set(doc["goal"]) >= {"equal steps (final)", "equal wall-clock"}
    assert doc["comparisons_ema"]["3"]["hooks"]["fp32"]["final_acc"] == runs["fp32"]["curve"][-1]["test_acc_ema"]
    assert set(doc["goal_ema"]) == set(doc["goal"])
    md = (tmp_path / "study_lenet.md").read_text()
    assert "Goal, on the moving average of the parameters" in md
    assert any(line.startswith("python examples/study_ddp.py --study lenet") for line in md.splitlines()[:5])
    assert "Equal wall-clock" in md and (tmp_path / "study_lenet.png").stat().st_size > 10000


def test_interpolation_and_hook_names():
    curve = [{"step": 0, "wall_s": 0.0, "test_acc": 0.1}, {"step": 10, "wall_s": 2.0, "test_acc": 0.5},
             {"step": 20, "wall_s": 6.0, "test_acc": 0.9}]
    assert abs(study_ddp.interpolate(curve, "wall_s", 1.0) - 0.3) < 1e-12
    assert abs(study_ddp.interpolate(curve, "wall_s", 4.0) - 0.7) < 1e-12
    assert study_ddp.interpolate(curve, "wall_s", 4.0, value="step") == 15
    assert study_ddp.interpolate(curve, "wall_s", 9.0) == 0.9
    assert study_ddp.hook_spec("powersgd4") == ("powersgd", {"powersgd_rank": 4})
    assert study_ddp.hook_spec("fp32") == ("none", {})
    for bad in ("powersgd", "powersgd0", "fp8"):
        try:
            study_ddp.hook_spec(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_parameter_average_follows_tensorflows_schedule_and_swaps_back():
    import torch
    module = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in module.parameters()]
    average = study_ddp.ParameterAverage(module, 0.9)
    expected = [p.clone() for p in start]
    for t in range(1, 6):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(float(t))
        average.update()
        d = min(0.9, (1 + t) / (10 + t))
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, module.parameters())]
    trained = [p.detach().clone() for p in module.parameters()]
    with average.evaluated():
        for p, e in zip(module.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
        assert not torch.equal(next(module.parameters()).detach(), trained[0])
    assert all(torch.equal(p.detach(), t) for p, t in zip(module.parameters(), trained))
    for bad in (0.0, 1.0, -0.5):
        try:
            study_ddp.ParameterAverage(module, bad)
        except ValueError:
            continue
        raise AssertionError(bad)
