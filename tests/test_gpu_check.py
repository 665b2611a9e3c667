"""scripts/gpu_check.sh and horovod_terngrad.operations.gpu_check: the shell script parses; the model shapes are the
real models'; the identity check catches a backend that differs by one byte; and the CPU dry run (what the script
does on a machine without a GPU) runs every step and prints the table with "no GPU", exiting 0."""
import math
import os
import subprocess

import pytest
import torch

from horovod_terngrad import backends
from horovod_terngrad.operations import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def test_the_script_parses():
    p = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_gpt2_shapes_are_gpt2lmheadmodels():
    shapes = gpu_check.gpt2_shapes()
    assert len(shapes) == 76 and sum(math.prod(s) for _, s in shapes) == 27_336_704   # the DDP benchmark's GPT-2
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                   bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]     # the tied head is not listed again
    assert gpu_check.gpt2_shapes(2, 32, 100, 16) == real


def test_resnet50_shapes_are_torchvisions():
    shapes = gpu_check.resnet50_shapes()
    assert len(shapes) == 161 and sum(math.prod(s) for _, s in shapes) == 25_557_032
    assert shapes[0] == ("conv1.weight", (64, 3, 7, 7)) and shapes[-1] == ("fc.bias", (1000,))


class OneByteOff:
    """The fused CPU backend, except that the payloads of tensors of more than 1000 elements have one byte changed."""

    def __init__(self, inner):
        self.inner = inner

    def prepare(self, *a, **k):
        return self.inner.prepare(*a, **k)

    def encode(self, *a, **k):
        out = self.inner.encode(*a, **k).clone()
        if a[0].numel() > 1000:
            out[-1] ^= 1
        return out

    def decode(self, *a, **k):
        return self.inner.decode(*a, **k)


def test_identity_counts_the_cases_that_agree_and_names_those_that_do_not():
    fused = backends.cpu_fused()
    assert fused is not None
    shapes = [("small", (10, 10)), ("big", (64, 64)), ("odd", (4097,))]
    cpu = torch.device("cpu")
    assert gpu_check.identity(shapes, fused, cpu, backends.REFERENCE, cpu) == (6, 6, [])
    same, total, differ = gpu_check.identity(shapes, OneByteOff(fused), cpu, backends.REFERENCE, cpu)
    assert (same, total) == (2, 6) and differ == ["big 2bit", "big base3", "odd 2bit"]


def test_the_dry_run_runs_every_step_and_prints_the_table(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)                           # the script puts its own checkout first
    out = tmp_path / "rows.json"
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "--json", str(out)], capture_output=True, text=True,
                       timeout=400, env=env)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    heading = lines[0]
    assert heading.startswith("gpu_check: CPU dry run") and ("no GPU" in heading or "--dry-run" in heading)
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and not line.startswith("| step")]
    assert [r[0].lstrip("| ") for r in rows] == ["tests", "identity gpt2", "identity resnet50", "codec", "optimizer",
                                                 "2 ranks"]
    assert all(r[3] == "ok" for r in rows), p.stdout
    if not torch.cuda.is_available():
        assert all("no GPU" in r[1] for r in rows)
    text = p.stdout
    assert "104/104 tensor x packing cases identical" in text and "322/322" in text       # GPT-2 4x256, ResNet-50
    assert "losses finite True, parameters identical True" in text and "52 took the ternary path" in text
    assert "passed" in rows[0][2] and "skipped" in rows[0][2]                             # the CUDA tests skip here
    assert lines[-1] == "gpu_check: 6 of 6 steps passed or skipped"
    assert out.exists() and '"status": "ok"' in out.read_text()
