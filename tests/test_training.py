"""TernGrad trains as well as fp32: LeNet on real MNIST, 2 Horovod ranks (Gloo), same seed and data.

Stated margin: after 300 steps (batch 32 per rank, momentum SGD lr 0.01) the test accuracy with TernGrad
is within 1.0 percentage point of the fp32 run, and both learned (> 90%).
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow       # trains on 2 ranks (horovodrun)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
MARGIN = 0.010


def train(tmp_path, compression):
    out = tmp_path / f"{compression}.json"
    cmd = [os.path.join(BIN, "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           os.path.join(ROOT, "examples", "mnist_lenet.py"), "--epochs", "1", "--max-steps", "300",
           "--compression", compression, "--json", str(out)]
    # one thread per rank: two ranks of two threads each on a 2-core machine spend their time switching
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())[-1], p.stdout


def test_terngrad_matches_fp32_accuracy(tmp_path):
    fp32, _ = train(tmp_path, "none")
    tern, log = train(tmp_path, "terngrad")
    assert "test acc" in log and "bits/element" in log
    assert fp32["test_acc"] > 0.90 and tern["test_acc"] > 0.90
    assert abs(tern["test_acc"] - fp32["test_acc"]) <= MARGIN, (tern["test_acc"], fp32["test_acc"])
    assert tern["bits_per_element"] < 2.1
