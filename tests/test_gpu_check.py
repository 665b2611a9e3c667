"""scripts/gpu_check.sh and horovod_terngrad.operations.gpu_check: the shell script parses; the model shapes are the
real models'; the identity check catches a backend that differs by one byte; the kernel table's bytes per element
and rates; and the CPU dry run (what the script does on a machine without a GPU) runs every step, prints the table
with "no GPU", exits 0 and writes a JSON that docs/gpu.md's blocks render."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from horovod_terngrad import backends
from horovod_terngrad.modelling.gpu_profile import GpuCodecProfile
from horovod_terngrad.operations import gpu_check, models

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


def test_gpt2_124m_has_148_tensors_and_the_plain_torch_gpt2_has_them():
    shapes = gpu_check.GPT2_124M.shapes()
    assert len(shapes) == 148 and sum(math.prod(s) for _, s in shapes) == 124_439_808
    with torch.device("meta"):
        plain = models.GPT2()
    assert [(n, tuple(p.shape)) for n, p in plain.named_parameters()] == shapes
    assert len(gpu_check.GPT2_DRY_RUN.shapes()) == 148


def test_the_plain_torch_gpt2_computes_transformers_logits():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    plain = models.GPT2(2, 32, 2, 100, 16).eval()
    plain.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(plain(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceed the context of 16"):
        plain(torch.zeros(1, 17, dtype=torch.long))
    model, source = models.gpt2_lm(2, 32, 2, 100, 16, prefer_transformers=False)
    assert isinstance(model, models.GPT2) and "plain-torch" in source


def test_the_traffic_formula_and_the_kernels_own_agree():
    f = gpu_check.traffic_formula
    assert f("compress") == 8.25 and f("compress", fmt="base3") == 8.2            # two passes over fp32 + the codes
    assert f("compress", in_bytes=2) == 4.25 and f("compress", in_bytes=2, fmt="base3") == 4.2
    assert f("decode", payloads=2) == 4.5 and f("decode", payloads=8) == 6.0     # the codes read + fp32 written
    assert f("decode", fmt="base3", payloads=8) == pytest.approx(5.6)
    with pytest.raises(ValueError, match="op must be"):
        f("copy")
    with pytest.raises(ValueError, match="fmt must be"):
        f("decode", fmt="3bit")
    from horovod_terngrad.backends import cuda
    own = getattr(cuda, "traffic", None)
    for op in ("compress", "decode"):
        for in_bytes in (2, 4):
            for fmt in ("2bit", "base3"):
                for payloads in (1, 2, 8):
                    want = f(op, in_bytes=in_bytes, fmt=fmt, payloads=payloads)
                    assert gpu_check.traffic(op, in_bytes=in_bytes, fmt=fmt, payloads=payloads) == pytest.approx(want)
                    if own is not None:
                        assert own(op, in_bytes=in_bytes, fmt=fmt, payloads=payloads) == pytest.approx(want)


def test_model_targets_are_the_frontends_fused_groups():
    t = gpu_check.model_target("GPT-2 124M", gpu_check.GPT2_124M.shapes())
    assert t.tensors == 148 and "148 tensors" in t.name
    small = sum(1 for _, s in gpu_check.GPT2_124M.shapes() if math.prod(s) < 4096)   # min_numel: not compressed
    assert len(t.members) == 148 - small and t.elements == 124_439_808 - sum(
        math.prod(s) for _, s in gpu_check.GPT2_124M.shapes() if math.prod(s) < 4096)
    assert all(sum(g) <= 1 << 22 for g in t.groups if len(g) > 1)                  # fusion_numel
    assert t.members[0] == 768 * 50257 or t.members[-1] == 768 * 50257             # wte travels alone
    assert len(gpu_check.model_target("ResNet-50", gpu_check.resnet50_shapes()).members) < 161


def test_kernel_rows_charge_the_bytes_per_element_and_compare_with_the_copy():
    cpu = torch.device("cpu")
    timer = gpu_check.Timer(cpu)
    fused = backends.cpu_fused()
    targets = [gpu_check.size_target(1 << 14), gpu_check.model_target("tiny", [("a", (64, 128)), ("b", (5000,))])]
    rows = gpu_check.kernel_rows(fused, cpu, targets, timer, copy_gbs=10.0, repeat=1, budget_s=600)
    assert len(rows) == len(gpu_check.KERNEL_PATHS) * 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["gpu_ms"] is None and r["wall_ms"] > 0                              # no CUDA events on the CPU
        assert r["gbs"] == pytest.approx(r["bytes_per_element"] * r["elements"] / r["wall_ms"] * 1e-6)
        assert r["of_copy"] == pytest.approx(r["gbs"] / 10.0)
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    assert bf16 and all(r["bytes_per_element"] in (4.25, 4.2) for r in bf16)
    assert all(r["path"] == "cast to fp32 first" for r in bf16) == (not gpu_check.reads_bf16(fused))
    assert rows[-1]["elements"] == 64 * 128 + 5000 and rows[-1]["payloads"] == 8
    prof = gpu_check.codec_profile(rows, "cpu")
    one = {r["kernel"]: r for r in rows if r["tensors"] == 1}
    assert prof["compress_elements_per_s"] == pytest.approx(1e9 * one["compress fp32 2bit"]["gelem_s"])
    assert prof["decode_elements_per_s"] == pytest.approx(1e9 * one["decode N=2 2bit"]["gelem_s"])
    late = gpu_check.kernel_rows(fused, cpu, targets[:1], timer, copy_gbs=10.0, repeat=1, budget_s=0)
    assert [r["status"] for r in late] == ["skipped"] * len(gpu_check.KERNEL_PATHS)   # past the step's budget
    assert "past the step" in gpu_check.kernel_table(late)


def test_the_gpu_profile_is_the_committed_h100_runs():
    with open(os.path.join(ROOT, "docs", "gpu", "h100-2026-11-27.json")) as f:
        d = json.load(f)
    prof = GpuCodecProfile.from_check(d)
    assert prof.compress_elements_per_s == pytest.approx(146.64e9 / 4)              # GB/s of fp32 read / 4 bytes
    assert prof.decode_elements_per_s == pytest.approx(411.00e9 / 4)
    assert prof.codec_elements_per_s == prof.compress_elements_per_s                  # the slower of the two
    with pytest.raises(ValueError, match="no 'codec_profile'"):
        GpuCodecProfile.from_check({"device": "cpu"})
    with pytest.raises(ValueError, match="positive"):
        GpuCodecProfile("x", 0.0, 1.0)


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


@pytest.mark.slow
@pytest.mark.one_process        # one command at a time (the script, then its pytest of the CUDA tests): no ranks
def test_the_dry_run_runs_every_step_and_prints_the_table(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)      # this interpreter: torch is there
    env.pop("PYTHONPATH", None)                           # the script puts its own checkout first
    out = tmp_path / "rows.json"
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, env=env)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    heading = lines[0]
    assert heading.startswith("gpu_check: CPU dry run") and ("no GPU" in heading or "--dry-run" in heading)
    steps = lines[:lines.index(next(x for x in lines if x.startswith("Kernels (")))]
    rows = [line.split(" | ") for line in steps if line.startswith("| ") and not line.startswith("| step")]
    assert [r[0].lstrip("| ") for r in rows] == list(gpu_check.STEPS)
    assert all(r[3] == "ok" for r in rows), p.stdout
    if not torch.cuda.is_available():
        assert all("no GPU" in r[1] for r in rows)
    text = p.stdout
    assert "104/104 tensor x packing cases identical" in text and "322/322" in text       # GPT-2 4x256, ResNet-50
    assert "losses finite True, parameters identical True" in text and "148 took the ternary path" in text
    assert "averages identical on the 8 ranks True" in text
    assert "passed" in rows[0][2] and "skipped" in rows[0][2]                             # the CUDA tests skip here
    assert "host build of the CUDA kernels: 32 rows (8 paths x 4 targets)" in text
    assert "| kernel | target | elements | bytes/element | GPU ms | wall ms | Gelem/s | GB/s moved | of copy | ≥ 70% |" \
        in text
    assert lines[-1] == f"gpu_check: {len(gpu_check.STEPS)} of {len(gpu_check.STEPS)} steps passed or skipped"
    d = json.loads(out.read_text())
    assert d["gpu"] is False and d["schema"] == 2 and "codec_profile" not in d          # a profile is a GPU's
    assert [r["step"] for r in d["rows"]] == list(gpu_check.STEPS)
    assert sum(d["step_budget_s"].values()) <= d["budget_s"]
    assert len(d["kernels"]) == 32 and all(r["status"] == "ok" for r in d["kernels"])
    assert {"tg_ms", "fused_ms", "foreach_ms", "params", "elements"} <= set(d["optimizer"]) and d["optimizer"][
        "params"] == 148
    t = d["train_step"]
    assert t["tensors"] == 148 and t["ranks"] == 8 and t["same_on_every_rank"]
    assert t["added_ms"] == pytest.approx(t["codec_ms_per_rank"] + t["optimizer_added_ms"], rel=1e-4)   # 6 digits
    assert t["added_fraction"] == pytest.approx(t["added_ms"] / t["compute_ms"], rel=1e-4)
    # what the check writes, dropped in as a GPU's, renders docs/gpu.md's blocks and the model's GPU rows
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import render_docs
    d.update(gpu=True, file="gpu/dry.json", cuda="none", codec_profile=gpu_check.codec_profile(d["kernels"], "cpu"))
    goals = render_docs.block_gpu_goals(d)
    assert "not run on a GPU yet" not in goals and goals.count("| yes |") + goals.count("| **no** |") == 4
    steps_block = render_docs.block_gpu_steps(d)
    assert "not run on a GPU yet" not in steps_block and all(f"| {s} |" in steps_block for s in gpu_check.STEPS)
    assert "of the 40 rows" in render_docs.block_gpu_kernels(d)
    assert "TernGrad adds" in render_docs.block_gpu_train_step(d)
    assert "codec charged" in render_docs.block_gpu_codec_512(d)


def test_docs_gpu_says_which_steps_no_gpu_ran_yet():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import render_docs
    current = render_docs.gpu_checks()[-1]
    assert current["gpu"] and current["date"] >= "2026-11-27"
    if "train_step" not in current:
        assert "| one GPU's GPT-2 124M step: TernGrad adds ≤ 5% | not run on a GPU yet |" in \
            render_docs.block_gpu_goals(current)
        assert "| train step | not run on a GPU yet |" in render_docs.block_gpu_steps(current)
