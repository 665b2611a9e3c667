"""Data loaders of horovod_terngrad.operations.datasets, CifarNet, the synthetic-benchmark models, and one real
2-rank Horovod (Gloo) run of examples/cifarnet.py and examples/synthetic_benchmark.py each."""
import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from horovod_terngrad.operations import datasets as D
from horovod_terngrad.operations.datasets import DatasetError
from support import forked_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import cifarnet  # noqa: E402
import synthetic_benchmark as sb  # noqa: E402

needs_fashion = pytest.mark.skipif(not os.path.isdir(D.FASHION_MNIST_DIR),
                                   reason="Debian package dataset-fashion-mnist not installed")


# -- Fashion-MNIST ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fashion():
    if not os.path.isdir(D.FASHION_MNIST_DIR):
        pytest.skip("Debian package dataset-fashion-mnist not installed")
    return D.load_fashion_mnist()


def test_fashion_mnist_shapes_dtypes_labels(fashion):
    for split, n in (("train", 60000), ("test", 10000)):
        x, y = fashion[split]
        assert x.shape == (n, 1, 28, 28) and x.dtype == torch.uint8
        assert y.shape == (n,) and y.dtype == torch.int64
        assert y.min().item() == 0 and y.max().item() == 9
        assert torch.bincount(y).tolist() == [n // 10] * 10          # Fashion-MNIST is balanced
        assert 0 < x.float().mean().item() < 255 and x.max().item() == 255
    # the train and test images are different sets
    assert not torch.equal(fashion["train"][0][:100], fashion["test"][0][:100])


@needs_fashion
def test_fashion_mnist_checksum_mismatch_names_file(tmp_path):
    for name in D.FASHION_MNIST_SHA256:
        os.symlink(os.path.join(D.FASHION_MNIST_DIR, name), tmp_path / name)
    bad = tmp_path / "train-labels-idx1-ubyte.gz"
    raw = bytearray(open(bad, "rb").read())
    bad.unlink()
    raw[len(raw) // 2] ^= 0x01
    bad.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="sha256 mismatch") as e:
        D.load_fashion_mnist(str(tmp_path))
    assert str(bad) in str(e.value)


def test_fashion_mnist_missing_dir_is_clear(tmp_path):
    with pytest.raises(DatasetError, match="dataset-fashion-mnist") as e:
        D.load_fashion_mnist(str(tmp_path / "nowhere"))
    assert "nowhere" in str(e.value)


def test_parse_idx():
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 0x08, 3]) + np.array([2, 3, 4], dtype=">u4").tobytes() + arr.tobytes()
    np.testing.assert_array_equal(D.parse_idx(raw), arr)
    ints = np.array([1, -2, 70000], dtype=">i4")
    np.testing.assert_array_equal(D.parse_idx(bytes([0, 0, 0x0C, 1, 0, 0, 0, 3]) + ints.tobytes()), [1, -2, 70000])
    with pytest.raises(DatasetError, match="after the header"):
        D.parse_idx(raw[:-1], "x.idx")
    with pytest.raises(DatasetError, match="bad magic"):
        D.parse_idx(b"\x1f\x8b\x08\x00" + raw[4:], "x.idx")


# -- CIFAR-10 --------------------------------------------------------------------------------------
def write_fake_cifar(root, n_train=7, n_test=5, seed=0):
    """A CIFAR-10 folder in the real format: python-2 style pickles of dicts with bytes keys."""
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    batches = {}
    for name in D.CIFAR10_TRAIN_BATCHES + (D.CIFAR10_TEST_BATCH,):
        n = n_test if name == D.CIFAR10_TEST_BATCH else n_train
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"img%d.png" % i for i in range(n)]}, f, protocol=2)
        batches[name] = (data, labels)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in D.CIFAR10_CLASSES], b"num_cases_per_batch": n_train,
                     b"num_vis": 3072}, f, protocol=2)
    return d, batches


def test_fake_cifar10_loads(tmp_path):
    d, batches = write_fake_cifar(tmp_path)
    for path in (tmp_path, d):                        # the folder itself or its parent
        data = D.load_cifar10(str(path))
        xtr, ytr = data["train"]
        xte, yte = data["test"]
        assert xtr.shape == (35, 3, 32, 32) and xtr.dtype == torch.uint8
        assert xte.shape == (5, 3, 32, 32) and ytr.dtype == torch.int64 and yte.dtype == torch.int64
        raw2, lab2 = batches["data_batch_2"]
        # rows are channel-major: red 32x32 plane, then green, then blue
        assert xtr[7 + 3, 1, 4, 5].item() == raw2[3, 1024 + 4 * 32 + 5]
        assert xtr[7 + 3, 2, 31, 0].item() == raw2[3, 2048 + 31 * 32]
        assert ytr[7:14].tolist() == lab2
        assert yte.tolist() == batches["test_batch"][1]
        assert 0 <= ytr.min() and ytr.max() <= 9


def test_bad_cifar10_path_names_path(tmp_path):
    missing = tmp_path / "no-such-cifar"
    with pytest.raises(DatasetError) as e:
        D.load_cifar10(str(missing))
    assert str(missing) in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="data_batch_1") as e:
        D.load_cifar10(str(empty))
    assert str(empty) in str(e.value)


def test_malformed_cifar10_batch_names_file(tmp_path):
    d, _ = write_fake_cifar(tmp_path)
    with open(d / "data_batch_3", "wb") as f:            # wrong image size (28x28 grey)
        pickle.dump({b"data": np.zeros((4, 784), np.uint8), b"labels": [0] * 4}, f, protocol=2)
    with pytest.raises(DatasetError, match=r"\[n, 3072\]") as e:
        D.load_cifar10(str(d))
    assert str(d / "data_batch_3") in str(e.value)
    (d / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DatasetError, match="data_batch_3"):
        D.load_cifar10(str(d))


# -- CifarNet --------------------------------------------------------------------------------------
def test_cifarnet_shapes_and_parameter_count():
    m = cifarnet.CifarNet(3)
    counts = {n: p.numel() for n, p in m.named_parameters()}
    assert counts == {"conv1.weight": 4800, "conv1.bias": 64, "conv2.weight": 102400, "conv2.bias": 64,
                      "fc3.weight": 2304 * 384, "fc3.bias": 384, "fc4.weight": 384 * 192, "fc4.bias": 192,
                      "logits.weight": 1920, "logits.bias": 10}
    assert sum(counts.values()) == 1068298
    assert sum(p.numel() for p in cifarnet.CifarNet(1).parameters()) == 1065098
    out = m(torch.randn(5, 3, 24, 24))
    assert out.shape == (5, 10)
    assert cifarnet.CifarNet(1)(torch.randn(2, 1, 24, 24)).shape == (2, 10)
    m.eval()
    x = torch.randn(3, 3, 24, 24)
    assert torch.equal(m(x), m(x))                     # no dropout at test time
    m.train()
    torch.manual_seed(0)
    a = m(x)
    assert not torch.equal(a, m(x))                    # dropout while training


def test_cifarnet_augmentation():
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    oy, ox = torch.tensor([0, 8, 3, 5, 0, 8]), torch.tensor([8, 0, 2, 7, 0, 8])
    flip = torch.tensor([False, True, False, True, True, False])
    c = cifarnet.crop_flip(x, oy, ox, flip)
    for i in range(6):
        ref = x[i, :, oy[i]:oy[i] + 24, ox[i]:ox[i] + 24]
        assert torch.equal(c[i], ref.flip(-1) if flip[i] else ref)
    g = torch.Generator().manual_seed(1)
    a = cifarnet.augment(x, g)
    assert a.shape == (6, 3, 24, 24) and a.dtype == torch.float32
    torch.testing.assert_close(a.flatten(1).mean(1), torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.flatten(1).std(1, unbiased=False), torch.ones(6), atol=1e-4, rtol=0)
    assert not torch.equal(a, cifarnet.augment(x, g))  # random
    t = cifarnet.center(torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8))
    assert t.shape == (2, 1, 24, 24)
    img = torch.zeros(1, 1, 28, 28, dtype=torch.uint8)
    img[0, 0, 2, 2] = 200                              # first pixel of the center crop
    img[0, 0, 0, 0] = 255                              # outside the crop
    cc = cifarnet.center(img)
    assert cc[0, 0, 0, 0] == cc.max() and (cc == cc.max()).sum() == 1


# -- synthetic benchmark models --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(sb.MODELS))
def test_synthetic_model_forward_backward(name):
    torch.manual_seed(0)
    m = sb.MODELS[name](num_classes=16)
    x = torch.randn(2, 3, sb.IMAGE, sb.IMAGE)
    out = m(x)
    assert out.shape == (2, 16)
    F.cross_entropy(out, torch.tensor([3, 7])).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


def test_synthetic_model_profiles():
    prof = {name: sb.profile(M()) for name, M in sb.MODELS.items()}
    for name in ("alexnet", "vgg"):                    # FC-heavy: communication dominates
        assert prof[name]["fc_share"] > 0.9 and prof[name]["largest"] == "classifier.0.weight"
        assert prof[name]["tensors"] < 40
    assert prof["vgg"]["largest_share"] > 0.7
    assert prof["googlenet"]["fc_share"] < 0.2 and prof["googlenet"]["tensors"] > 150
    assert prof["googlenet"]["largest_share"] < 0.2
    # compute per parameter: GoogLeNet-like far above the FC-heavy ones
    for name in ("alexnet", "vgg"):
        assert prof["googlenet"]["macs"] / prof["googlenet"]["params"] > 5 * prof[name]["macs"] / prof[name]["params"]


# -- real 2-rank runs ------------------------------------------------------------------------------------------------
# The examples' behaviour (outputs, AMP's skipped steps, benchmarks' records) on 2 ranks forked with the launcher's
# environment (tests/support/forked_ranks.py): the launchers are not what these tests test; the examples as users
# launch them are tests/test_ecosystem.py's, test_training.py's and test_ddp.py's.
def forked_example(kind, script, args, log_dir, timeout=300, what=""):
    """``examples/script args`` on 2 ranks, ``kind`` "horovod" (horovodrun --gloo's environment) or "torch"
    (torchrun's), one thread each; returns their output as horovodrun prints it: every line of rank r's stdout
    prefixed ``[r]<stdout>:``, of its stderr ``[r]<stderr>:`` (with "torch", stdout only, as torchrun passes it)."""
    logs = forked_ranks.run_scenarios(kind, 2, os.path.join(ROOT, "examples", script), [str(a) for a in args],
                                      str(log_dir), env={"OMP_NUM_THREADS": "1"}, timeout=timeout,
                                      what=what or f"{script} {' '.join(map(str, args))}")
    streams = ("stdout", "stderr") if kind == "horovod" else ("stdout",)
    return "\n".join(f"[{r}]<{name}>:{line}" for r, pair in enumerate(logs) for name, text in zip(streams, pair)
                     for line in text.splitlines())


@pytest.mark.slow
@needs_fashion
def test_cifarnet_substitute_two_ranks_terngrad(tmp_path):
    out = tmp_path / "cifarnet.json"
    log = forked_example("horovod", "cifarnet.py",
                         ["--epochs", "1", "--max-steps", "40", "--batch-size", "32", "--lr", "0.001",
                          "--test-limit", "1000", "--compression", "terngrad", "--json", str(out)], tmp_path)
    lines = [ln.split("<stdout>:", 1)[1] for ln in log.splitlines() if ln.startswith("[0]<stdout>:")]
    lines = [ln for ln in lines if ln.strip()]
    assert len(lines) >= 2, log
    for ln in lines:
        assert cifarnet.SUBSTITUTE in ln, ln
    assert not any(ln.startswith("[1]<stdout>:") and ln.split(":", 1)[1].strip() for ln in log.splitlines())
    assert "bits/element" in log and "test acc" in log and "images/s" in log
    rec = json.loads(out.read_text())[-1]
    assert rec["dataset"] == cifarnet.SUBSTITUTE and rec["substitute"] is True
    assert rec["compression"] == "terngrad" and rec["ranks"] == 2
    assert 1.9 < rec["bits_per_element"] < 2.1                 # ternary: 2 bits + headers and handshake
    assert rec["loss_last"] < rec["loss_first"], rec           # it learned ...
    assert rec["test_acc"] > 0.25, rec                         # ... well beyond chance (10%)
    assert rec["ema_decay"] == 0.9999 and 0.1 < rec["test_acc_ema"] <= 1.0 and "moving average" in log


def test_parameter_ema_follows_tensorflows_warm_up_and_restores_raw_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = model.weight.detach().clone()
    ema = cifarnet.ParameterEMA(model, 0.9999)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)                          # t = 0: decay min(0.9999, 1/10) = 0.1
    torch.testing.assert_close(ema.shadow["weight"], 0.1 * w0 + 0.9 * (w0 + 1.0))
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)                          # t = 1: decay 2/11
    want = 2 / 11 * (0.1 * w0 + 0.9 * (w0 + 1.0)) + 9 / 11 * (w0 + 2.0)
    torch.testing.assert_close(ema.shadow["weight"], want)
    seen = ema.evaluate_with(model, lambda m: m.weight.detach().clone())
    torch.testing.assert_close(seen, want)
    torch.testing.assert_close(model.weight.detach(), w0 + 2.0)   # raw weights back
    big = cifarnet.ParameterEMA(model, 0.9999)
    big.updates = 10 ** 6                      # late in training the decay is the configured one
    before = big.shadow["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    big.update(model)
    torch.testing.assert_close(big.shadow["weight"], 0.9999 * before + 0.0001 * model.weight.detach())
    with pytest.raises(ValueError, match="decay"):
        cifarnet.ParameterEMA(model, 1.0)


@pytest.mark.slow
def test_synthetic_benchmark_two_ranks_terngrad(tmp_path):
    out = tmp_path / "bench.json"
    log = forked_example("horovod", "synthetic_benchmark.py",
                         ["--model", "alexnet", "--compression", "terngrad", "--num-warmup-batches", "1",
                          "--num-batches-per-iter", "3", "--num-iters", "3", "--json", str(out)], tmp_path)
    assert "Iter #2:" in log and "Img/sec per rank:" in log and "Total img/sec on 2 rank(s):" in log
    assert "bits/element" in log
    res = json.loads(out.read_text())
    assert res["ranks"] == 2 and res["compression"] == "terngrad"
    assert 1.9 < res["bits_per_element"] < 2.1
    assert res["img_sec_total"] > 0
    assert res["loss_last"] < res["loss_first"], res           # memorizing the fixed batch


@pytest.mark.slow
def test_synthetic_benchmark_googlenet_fuses_its_173_tensors(tmp_path):
    out = tmp_path / "bench.json"
    forked_example("horovod", "synthetic_benchmark.py",
                   ["--model", "googlenet", "--compression", "terngrad", "--num-warmup-batches", "2",
                    "--num-batches-per-iter", "2", "--num-iters", "2", "--json", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert res["profile_tensors"] == 173 and res["fusion_numel"] == 1 << 22
    assert res["collectives_per_step"] == 2          # 173 tensors, 442k elements: one group (after warm-up:
    #                                                  step 1 runs unfused, step 2 plans the groups)


@pytest.mark.slow
@pytest.mark.one_process
def test_bench_codec_prints_every_stage_with_scaler_buckets():
    """bench codec --bucket-size: the fused backend's bucketed path runs end to end (statistics, encode,
    decode at N = 2 and 8) for both packings, and says which scaler layout it timed."""
    out = subprocess.run([sys.executable, "-m", "horovod_terngrad.operations.bench", "codec", "--numel", "30000",
                          "--repeat", "1", "--bucket-size", "512"], capture_output=True, text=True, check=True).stdout
    assert "one scaler per 512 elements" in out
    for fmt in ("2bit", "base3"):
        assert sum(f" {fmt} " in line and " compress " in line for line in out.splitlines()) == 1
        assert sum(f" {fmt} " in line and "decompress N=" in line for line in out.splitlines()) == 2


@pytest.mark.slow
def test_bench_step_calibration_feeds_the_emulated_cluster_prediction(tmp_path):
    """bench step --calibrate on 2 real ranks, then the emulated-cluster benchmark's prediction code
    on that result: calibrated efficiencies, a scheduled-model prediction for every configuration, and the
    TernGrad collectives per step the model schedules equal to those the real run counted."""
    import emulated_cluster_benchmark as ecb

    from horovod_terngrad.modelling.codec_rates import CodecRates
    out = tmp_path / "step.json"
    p = subprocess.run([os.path.join(BIN, "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m", "horovod_terngrad.operations.bench", "step", "--layers", "2", "--width", "300", "--batch", "4",
        "--steps", "3", "--rounds", "2", "--warmup", "1", "--configs", "fp32,terngrad,terngrad-sharded,terngrad-shared",
        "--calibrate", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    cal = res["calibration"]
    assert cal["compute_ms"] > 0 and cal["allreduce"][0] == 4 * res["params"]
    assert cal["compute_slowest_ms"] > 0 and cal["rounds"] == res["rounds"] == 2
    # the codec's rates measured in the job (every rank at once): what the scheduled model charges
    assert set(cal["codec_s_per_element"]) == set(CodecRates.__dataclass_fields__)
    assert all(0 < v < 1e-6 for k, v in cal["codec_s_per_element"].items() if k != "decode_per_payload")
    # configurations take turns: a median per round, and counters over all 2 x 3 timed steps
    assert all(len(r["step_ms_by_round"]) == 2 and min(r["step_ms_by_round"]) <= r["step_ms"] <= max(r["step_ms_by_round"])
               for r in res["rows"])
    tern = next(r for r in res["rows"] if r["config"] == "terngrad")
    assert 2.0 <= tern["bits_per_element"] < 2.2 and tern["collectives_per_step"] >= 1
    assert tern["terngrad_config"]["min_numel"] == 4096 and len(res["names"]) == len(res["sizes"]) == 4
    res.update(hosts=2, rate="none", measured_gbps=10.0, cycle_ms=ecb.HOROVOD_CYCLE_MS,
               fusion_bytes=ecb.HOROVOD_FUSION_BYTES, model="mlp")
    scheduled = ecb.predict(res)
    assert set(scheduled) == {"fp32", "terngrad", "terngrad-sharded", "terngrad-shared"}
    # a step is never shorter than its compute, and TernGrad's schedule has at least its two rounds
    assert all(v["ms"] >= cal["compute_slowest_ms"] for v in scheduled.values())
    assert scheduled["terngrad"]["ms"] >= cal["compute_slowest_ms"] + 2 * ecb.HOROVOD_CYCLE_MS
    # the two 300-element biases go by Horovod's allreduce, the weights as one group: per-rank scalers 1
    # allgather + the presence check, the shared scaler 2, sharded 3 collectives, as counted in the run
    for r in res["rows"][1:]:
        assert r["collectives_per_step"] == scheduled[r["config"]]["collectives"], r["config"]
    assert [scheduled[k]["collectives"] for k in ("terngrad", "terngrad-shared", "terngrad-sharded")] == [2, 2, 3]
    assert set(res["efficiency"]) == {"allreduce", "allgather", "alltoall"}
    assert all(v > 0 for v in res["efficiency"].values())
    res["scheduled"] = scheduled
    table = "\n".join(ecb.rows(res, "none"))
    assert table.count("| mlp | 2 | unshaped (10.0 Gbit/s measured) |") == 4 and "| 2 / 2 |" in table


def test_emulated_cluster_predict_only_reads_saved_cells_and_the_earlier_runs(tmp_path):
    """--predict-only on the documented runs: the earlier MLP driver's emulated_cluster.json (terngrad-launch,
    the TernGrad settings of then) and the cells of docs/realshapes; the model schedules the collectives per
    step that those runs counted."""
    import emulated_cluster_benchmark as ecb
    ecb.main(["--predict-only", os.path.join(ROOT, "docs", "cluster", "emulated_cluster.json"),
              os.path.join(ROOT, "docs", "realshapes"), "--out", str(tmp_path)])
    table = (tmp_path / "predicted.md").read_text()
    rows = [line for line in table.splitlines() if line.count("|") == ecb.HEADER[1].count("|")
            and not line.startswith("|---") and not line.startswith("| model")]      # not the calibration's
    assert sum(line.startswith("| mlp | 4 | 1gbit |") for line in rows) == 4
    assert sum(line.startswith("| resnet50 (repeat2) | 2 | 1gbit |") for line in rows) == 4
    # every TernGrad row: the collectives the run counted = the ones the model schedules
    counted = [line.split("|")[-2].strip() for line in rows if "| terngrad" in line]
    assert counted and all(c.split(" / ")[0] == c.split(" / ")[1] for c in counted), counted
    assert "| resnet50 | 2 | 1gbit | terngrad | 652 |" in table and "| 8 / 8 |" in table


def test_calibrated_regime_rate_from_a_measured_compute_time():
    """--regime RATIO: the link rate at which fp32's ring payload per host link, 2(N-1)/N x 4 B x parameters,
    takes RATIO x one rank's compute alone; the paper's Ethernet regime (ResNet-50, 0.1 s on a V100, 102 MB
    at 1 Gbit/s) comes out at 1 Gbit/s; the table's limit adds compute alone, codec and the busiest link
    direction at that rate."""
    import emulated_cluster_benchmark as ecb
    from horovod_terngrad.operations.bench import link_bytes_per_host
    paper = ecb.regime_rate(8, 0.1, 25_557_032, ranks=2)
    assert paper["bytes_per_host"] == 4 * 25_557_032 and abs(paper["gbps"] - 1.0223) < 1e-3
    assert paper["rate"] == "1022281kbit" and ecb.link_gbps({"rate": paper["rate"]}) == pytest.approx(1.022281)
    # 2 hosts x 2 ranks: one ring payload, 2(N-1)/N = 1.5 x the gradients, per host link; twice the compute
    # or twice the ratio halves the rate; "every-rank" counts both ranks' payloads (a ring ignoring hosts)
    r = ecb.regime_rate(8, 0.05, 10_000_000, ranks=4, ranks_per_host=2)
    assert r["bytes_per_host"] == 1.5 * 4e7 and r["gbps"] == pytest.approx(8 * 6e7 / (8 * 0.05) / 1e9)
    assert ecb.regime_rate(8, 0.1, 10_000_000, 4, 2)["gbps"] == pytest.approx(r["gbps"] / 2)
    assert ecb.regime_rate(16, 0.05, 10_000_000, 4, 2)["gbps"] == pytest.approx(r["gbps"] / 2)
    assert ecb.regime_rate(8, 0.05, 10_000_000, 4, 2, "every-rank")["gbps"] == pytest.approx(2 * r["gbps"])
    for bad in (lambda: ecb.regime_rate(8, 0.1, 10, ranks=1), lambda: ecb.regime_rate(0, 0.1, 10, 2),
                lambda: ecb.regime_rate(8, 0.0, 10, 2), lambda: ecb.regime_rate(8, 0.1, 10, 3, 2)):
        with pytest.raises(ValueError):
            bad()
    assert ecb.hierarchical_configs("fp32,terngrad", "true,false,auto") == "fp32,terngrad,terngrad-hier,terngrad-flat"
    # a host's ranks read the same eth0: the first rank's reading counts, per step
    assert link_bytes_per_host(["h0", "h0", "h1", "h1"], [[40, 20], [41, 21], [60, 80], [0, 0]], 2) == \
        {"h0": [20.0, 10.0], "h1": [30.0, 40.0]}
    cell = {"model": "mlp", "params": 10_000_000, "batch": 8, "hosts": 2, "ranks_per_host": 2, "rate": r["rate"],
            "regime": r, "compute_alone": {"compute_ms": 50.0},
            "rows": [{"config": "fp32", "step_ms": 600.0, "step_ms_by_round": [600.0],
                      "link_bytes_per_step": {"x-h0": [4e7, 4e7], "x-h1": [4e7, 4e7]}},
                     {"config": "fp16", "step_ms": 400.0, "step_ms_by_round": [400.0],
                      "link_bytes_per_step": {"x-h0": [2e7, 2e7], "x-h1": [2e7, 2e7]}},
                     {"config": "terngrad-hier", "step_ms": 100.0, "step_ms_by_round": [100.0], "codec_ms": 10.0,
                      "node_aware": True, "link_bytes_per_step": {"x-h0": [3e6, 2.5e6], "x-h1": [2.5e6, 3e6]}}]}
    table = "\n".join(ecb.host_rows(cell))
    assert "links 1.200 Gbit/s each way** (`--regime 8`" in table and "60.0 MB" in table
    # limit: 50 ms compute alone + 10 ms codec + 3 MB at 1.2 Gbit/s (20 ms)
    assert "| terngrad-hier | 100 | 100 | 320.0 | 4.00x | 6.00x | h0 3.0 / 2.5, h1 2.5 / 3.0 | 0.07x | 80 = 50 + 10 + 20 | 1.25x | yes |" in table


@pytest.mark.slow
@pytest.mark.launch_lane("hosts")     # emulated hosts and mpirun
def test_calibrated_regime_on_two_emulated_hosts_of_two_ranks(tmp_path):
    """A tiny --regime 8 run on 2 emulated hosts x 2 ranks (mpirun by slot): every configuration's bytes
    through both host links; fp32 puts at most one ring payload on a host's link (its ranks' own traffic
    stays inside the host), the node-aware exchange crosses with less than the flat one."""
    import shutil
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    import emulated_cluster_benchmark as ecb
    prefix = f"e{os.getpid() % 100000}"
    ecb.main(["--models", "mlp", "--layers", "2", "--width", "1000", "--hosts", "2", "--ranks-per-host", "2",
              "--regime", "8", "--configs", "fp32,terngrad", "--hierarchical", "true,false", "--rounds", "1",
              "--steps", "2", "--warmup", "1", "--compute-steps", "3", "--prefix", prefix, "--out", str(tmp_path)])
    assert prefix + "-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    res = json.loads((tmp_path / "mlp-n2x2-regime8.json").read_text())
    P = res["params"]
    assert res["ranks"] == 4 and res["ranks_per_host"] == 2 and res["regime"]["bytes_per_host"] == 1.5 * 4 * P
    assert res["rate"] == res["regime"]["rate"] and res["compute_alone"]["compute_ms"] > 0
    by = {r["config"]: r for r in res["rows"]}
    assert list(by) == ["fp32", "terngrad", "terngrad-hier", "terngrad-flat"]
    assert all(sorted(r["link_bytes_per_step"]) == [f"{prefix}-h0", f"{prefix}-h1"] for r in res["rows"])
    most = {k: max(max(v) for v in r["link_bytes_per_step"].values()) for k, r in by.items()}
    # any allreduce moves >= 2(H-1)/H x 4P through a host's link; a ring through every rank on eth0 would be 2x
    assert 0.95 * 4 * P <= most["fp32"] <= 1.1 * res["regime"]["bytes_per_host"], most
    assert by["terngrad-hier"]["node_aware"] and not by["terngrad-flat"]["node_aware"]
    assert most["terngrad-hier"] < most["terngrad-flat"] < most["fp32"], most
    table = (tmp_path / "table.md").read_text()
    assert f"links {res['regime']['gbps']:.3f} Gbit/s each way** (`--regime 8`" in table


def test_cifarnet_learning_curves_table_and_plot(tmp_path):
    """study_cifarnet --eval-every leaves one JSON line per evaluation; write_curves pairs fp32 and TernGrad
    epoch by epoch (gap = TernGrad - fp32) and draws them."""
    import study_cifarnet
    for comp, accs in (("none", [0.70, 0.80]), ("terngrad", [0.69, 0.785])):
        with open(tmp_path / f"cifarnet_curve_2_{comp}.jsonl", "w") as f:
            for e, a in enumerate(accs, 1):
                f.write(json.dumps({"epochs": e, "iterations": 100 * e, "test_acc": a, "test_acc_ema": a + 0.01, "workers": 2,
                                    "compression": comp, "dataset": "SUBSTITUTE: test"}) + "\n")
    variant = study_cifarnet.variant_name(("^logits",), 512)
    name = study_cifarnet.curve_filename(2, "terngrad", variant)
    assert name == "cifarnet_curve_2_terngrad_exclude-logits-bucket-512.jsonl"
    with open(tmp_path / name, "w") as f:
        f.write(json.dumps({"epochs": 1, "iterations": 100, "test_acc": 0.695, "test_acc_ema": 0.7, "workers": 2, "variant": variant,
                            "compression": "terngrad", "dataset": "SUBSTITUTE: test"}) + "\n")
    png = study_cifarnet.write_curves(str(tmp_path))
    assert os.path.getsize(png) > 10_000
    md = (tmp_path / "cifarnet_curve.md").read_text()
    assert "| 1 | 70.00% | 69.00% | -1.00 |" in md and "| 2 | 80.00% | 78.50% | -1.50 |" in md
    variant_table = md.split("TernGrad (exclude=^logits,bucket=512):")[1]
    assert "| 1 | 70.00% | 69.50% | -0.50 | 71.00% | 70.00% | -1.00 |" in variant_table
    # another variant whose file-name tag reads the same gets its own file instead of overwriting this one
    other = study_cifarnet.variant_name(("logits$",), 512)
    assert study_cifarnet.curve_filename(2, "terngrad", other) == name
    assert study_cifarnet.curve_path(str(tmp_path), 2, "terngrad", variant) == str(tmp_path / name)
    assert study_cifarnet.curve_path(str(tmp_path), 2, "terngrad", other) != str(tmp_path / name)
    assert "SUBSTITUTE" in md
    with pytest.raises(FileNotFoundError):
        study_cifarnet.write_curves(str(tmp_path / "empty"))


@pytest.mark.slow
@pytest.mark.one_process
def test_adam_second_moment_ratio_of_terngrad(tmp_path):
    """study_adam_variance: along an fp32 trajectory, TernGrad's average has a larger second moment than the
    fp32 average of the same per-worker gradients (E[t^2] = s|g| >= g^2), so every layer's median ratio is
    above 1; the measurement is a pure function of the seed; the table names each N."""
    import study_adam_variance as sav
    from cifarnet import CifarNet
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)

    def run():
        torch.manual_seed(3)
        return sav.second_moment_ratios(CifarNet(in_channels=1), x, y, 2, warm_steps=2, steps=6, per_worker=16)
    rows = run()
    assert [r["layer"] for r in rows][:2] == ["conv1.weight", "conv1.bias"] and rows[2]["numel"] == 64 * 64 * 25
    for r in rows:
        assert r["p10"] <= r["median"] <= r["p90"], r
        assert r["median"] > 1.0, r
    assert run() == rows
    md = sav.write_outputs({"2": rows, "4": rows}, str(tmp_path), {"dataset": "random", "lr": 2e-4, "steps": 6,
                                                                   "warm_steps": 2})
    text = open(md).read()
    assert "| N = 2 | N = 4 |" in text and "| conv2.weight | 102,400 |" in text
    assert json.load(open(tmp_path / "adam_variance.json"))["results"]["2"] == rows


@pytest.mark.slow
@pytest.mark.one_process
def test_node_aware_variance_study(tmp_path):
    """study_node_variance: the mean of the draws' errors is far below one draw's error (unbiased up to the
    clipping), the node-aware one ternarizes once per node, so with ranks of a node holding the same gradient its
    noise is up to G times the flat one's (V = (1/M²)·Σ_k (s|m| - m²) with m = g, s the piece's scaler); on
    different gradients the ratio is smaller; the table names each configuration."""
    import study_node_variance as snv
    from mnist_lenet import LeNet
    from horovod_terngrad import TernGradConfig
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    torch.manual_seed(0)
    model = LeNet()
    cfg = TernGradConfig(seed=1, min_numel=0, exchange="allgather")     # as the study runs it (one rounding)
    got = snv.noise(model, x, y, 8, 4, draws=12, config=cfg)
    assert 0 < got["flat"] and 0.8 < got["ratio"] < 4.5, got
    assert got["flat_bias"] < got["flat"] / 3 and got["node_bias"] < got["node"] / 3, got
    same = snv.noise(model, x[:8].repeat(8, 1, 1, 1), y[:8].repeat(8), 8, 4, draws=12, config=cfg)
    # every worker's gradient alike: G = 4 times with the same scalers, less as each local rank's piece of a
    # tensor has its own, smaller scaler (the max over the piece, not the tensor)
    assert 1.5 < same["ratio"] < 4.2 and same["ratio"] > got["ratio"], same
    rows = [{"iteration": 0, "workers": 8, "ranks_per_node": 4, "draws": 12, "minibatch_noise": 0.5, **got,
             "flat_vs_minibatch": 0.1, "node_vs_minibatch": 0.2}]
    md = snv.markdown(rows)
    assert "| 0 | 8 | 2 x 4 |" in md and f"{got['ratio']:.2f}x" in md


@pytest.mark.slow
@pytest.mark.one_process
def test_lm_scale_study_runs_an_exchange_with_scaler_buckets(tmp_path):
    """study_lm_scale: ``reternarized@b128`` is the re-ternarized exchange with one scaler per 128 elements in both
    stages (bucket_size=128): the same bytes of codes as without buckets plus a scaler per bucket, so more bits
    received per element; every run is one JSON line with its method's name and a finite held-out loss."""
    import study_lm_scale as sls
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The quick brown fox jumps over the lazy dog. " * 3000).encode())
    out = tmp_path / "runs"
    rows = sls.main(["--model", "gpt2", "--corpus", str(corpus), "--width", "32", "--layers", "1", "--seq-len", "32",
                     "--batch", "8", "--steps", "2", "--workers", "4", "--seeds", "0",
                     "--exchanges", "none,reternarized,reternarized@b128", "--out", str(out)])
    by = {r["method"]: r for r in rows}
    assert set(by) == {"none", "reternarized", "reternarized@b128"}
    assert all(np.isfinite(r["held_out"]) for r in rows)
    # 32-bit scaler per 128 elements in each stage: about 2·(N-1)/N·32/128 = 0.375 bits more at N = 4, and up
    # to about as much again on this tiny model, whose shards round up to whole buckets
    extra = by["reternarized@b128"]["bits_received"] - by["reternarized"]["bits_received"]
    assert 0.3 < extra < 1.0, (by["reternarized@b128"]["bits_received"], by["reternarized"]["bits_received"])
    assert len(open(out / "runs.jsonl").read().splitlines()) == 3
    assert "reternarized@b128" in sls.table(rows)


@pytest.mark.slow
@pytest.mark.one_process        # the simulator's ranks, in one or two study processes that never wait on each other
def test_whole_run_study_records_curves_resumes_and_finds_each_methods_best_lr(tmp_path):
    """study_lm_scale over whole runs: ``--steps 0`` is ``--epochs`` of the corpus at the global batch; each run
    records its held-out curve (the last point at the last step); ``/torch`` runs an exchange with torch's AdamW;
    two processes at once (``--jobs 2``) write the same rows as one; a second call runs nothing already in
    runs.jsonl; the best-lr table marks a best lr at the edge of the sweep as not bracketed; ``--plot`` writes a
    PNG; ``--write-corpus`` writes the bytes the study trains on."""
    import study_lm_scale as sls
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The quick brown fox jumps over the lazy dog. " * 3000).encode())
    out = tmp_path / "runs"
    common = ["--model", "gpt2", "--corpus", str(corpus), "--width", "32", "--layers", "1", "--seq-len", "32",
              "--batch", "8", "--epochs", "0.02", "--evals", "2", "--eval-windows", "16", "--workers", "2",
              "--seeds", "0", "--out", str(out)]
    rows = sls.main(common + ["--lr", "1e-3,4e-3", "--exchanges", "none,allgather,allgather/torch", "--jobs", "2"])
    train, _, _ = sls.load_corpus(str(corpus))
    steps = round(0.02 * len(train) / (8 * 32))
    assert len(rows) == 6 and {r["steps"] for r in rows} == {max(10, steps)}
    assert {(r["method"], r["optimizer"]) for r in rows} == {("none", "terngrad"), ("allgather", "terngrad"),
                                                             ("allgather", "torch")}
    for r in rows:
        assert len(r["curve"]) == 2 and r["curve"][-1][0] == r["steps"] and np.isfinite(r["held_out"])
    assert sls.main(common + ["--lr", "1e-3,4e-3", "--exchanges", "none,allgather,allgather/torch"]) == []
    assert len(open(out / "runs.jsonl").read().splitlines()) == 6
    text = sls.best_lr_table(rows)
    assert "allgather + torch AdamW" in text and "no (edge)" in text and "yes" not in text.split("\n", 2)[2]
    png = tmp_path / "curves.png"
    sls.main(["--table", str(out), "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = tmp_path / "copy.txt"
    sls.main(["--corpus", str(corpus), "--max-mb", "0.1", "--write-corpus", str(written)])
    assert written.read_bytes() == corpus.read_bytes()[:100_000]
    with pytest.raises(SystemExit, match="held-out split"):
        sls.load_corpus(str(corpus), max_mb=0.05)


@pytest.mark.slow
@pytest.mark.one_process
def test_adam_floor_study_finds_the_reternarized_estimate_pins_v_at_the_floor(tmp_path):
    """study_adam_floor: with the re-ternarized exchange the optimizer's noise estimate is the received value's own
    square, so its corrected second moment sits at the floor for (nearly) every element, where the allgather
    exchange's estimate leaves most elements above it; each result is written as a JSON line."""
    import study_adam_floor as saf
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The quick brown fox jumps over the lazy dog. " * 3000).encode())
    out = tmp_path / "floor.jsonl"
    got = saf.main(["--model", "gpt2", "--corpus", str(corpus), "--width", "32", "--layers", "1", "--seq-len", "32",
                    "--batch", "16", "--workers", "8", "--steps", "4", "--exchanges", "allgather,reternarized@b128",
                    "--out", str(out)])
    by = {r["method"]: r for r in got}
    assert by["reternarized@b128"]["share_at_floor"] > 2 * by["allgather"]["share_at_floor"], by
    assert by["reternarized@b128"]["median_v_minus_n_over_v"] <= 0.0 < by["allgather"]["median_v_minus_n_over_v"]
    assert len(out.read_text().splitlines()) == 2


def test_adam_study_table_refuses_to_compare_runs_of_another_global_batch(tmp_path):
    """adam_study_table: gaps against the baseline only for runs of its global batch and sequence length; a run
    with half the batch (a Horovod 2 x 2 run at 8 sequences per rank) gets 'not comparable' instead of a gap, and runs
    that record neither (written before the fields existed) are compared as before."""
    import adam_study_table as ast

    def run(tag, seed, loss, **extra):
        (tmp_path / f"{tag}.s{seed}.json").write_text(json.dumps({"held_out_loss": loss,
                                                                   "bits_per_element_overall": 2.0, **extra}))
    for seed in (0, 1):
        run("fp32", seed, 1.20, global_batch=64, seq_len=64)
        run("same", seed, 1.14, global_batch=64, seq_len=64)
        run("half", seed, 1.23, global_batch=32, seq_len=64)
        run("longer", seed, 1.10, global_batch=64, seq_len=128)
        run("old", seed, 1.18)
    rows = {line.split(" | ")[0].strip("| "): line for line in
            ast.table(ast.load(str(tmp_path)), "fp32").splitlines()[2:]}
    assert "-5.00%" in rows["same"] and "not comparable" not in rows["same"]
    assert "not comparable: global batch 32 vs 64" in rows["half"] and "+2.50%" not in rows["half"]
    assert "not comparable: sequence length 128 vs 64" in rows["longer"]
    assert "-1.67%" in rows["old"]


def _tiny_image_data(n_train=256, n_test=64):
    g = torch.Generator().manual_seed(5)
    return {"train": (torch.randint(0, 256, (n_train, 1, 28, 28), generator=g, dtype=torch.uint8),
                      torch.randint(0, 10, (n_train,), generator=g)),
            "test": (torch.randint(0, 256, (n_test, 1, 28, 28), generator=g, dtype=torch.uint8),
                     torch.randint(0, 10, (n_test,), generator=g))}


@pytest.mark.slow
@pytest.mark.one_process
def test_cifarnet_study_checkpoint_resumes_the_same_run(tmp_path):
    """A run stopped after 1 epoch and resumed (or extended) to 2 from its checkpoint takes exactly the steps
    of an uninterrupted 2-epoch run: same parameters, Adam state, EMA, random streams, curve; a checkpoint of
    another run is refused by name."""
    import study_cifarnet
    data = _tiny_image_data(n_train=64, n_test=32)
    kw = dict(per_worker=8, eval_every=0.5, exclude=("^logits",))
    whole = study_cifarnet.train(data, 2, "terngrad", 2, seed=3, checkpoint=str(tmp_path / "whole.pt"), **kw)
    part = study_cifarnet.train(data, 2, "terngrad", 1, seed=3, checkpoint=str(tmp_path / "part.pt"), **kw)
    assert part["iterations"] == 4 and whole["iterations"] == 8
    resumed = study_cifarnet.train(data, 2, "terngrad", 2, seed=3, checkpoint=str(tmp_path / "part.pt"), **kw)
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "part.pt", weights_only=True)
    assert a["iterations"] == b["iterations"] == 8
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for name, t in a["ema"]["shadow"].items():
        assert torch.equal(t, b["ema"]["shadow"][name]), name
    steps = a["simulator"]["engine_steps"]                       # per simulated rank (the engines' counters)
    assert a["simulator"] == b["simulator"] and all(s["conv1.weight"] == 8 for s in steps)
    assert all("logits.weight" not in s for s in steps)          # excluded: averaged in fp32, no stream drawn
    assert torch.equal(a["generator"], b["generator"])
    assert (whole["test_acc"], whole["test_acc_ema"]) == (resumed["test_acc"], resumed["test_acc_ema"])
    strip = [{k: v for k, v in p.items() if k != "seconds"} for p in whole["curve"]]
    assert strip == [{k: v for k, v in p.items() if k != "seconds"} for p in resumed["curve"]] and len(strip) == 4
    with pytest.raises(ValueError, match="part.pt is of another run"):
        study_cifarnet.train(data, 2, "terngrad", 2, seed=3, lr=3e-4, checkpoint=str(tmp_path / "part.pt"), **kw)
    with pytest.raises(ValueError, match="past the"):
        study_cifarnet.train(data, 2, "terngrad", 1, seed=3, checkpoint=str(tmp_path / "part.pt"), **kw)


@pytest.mark.slow
@pytest.mark.one_process
def test_cifarnet_study_main_resumes_curve_files(tmp_path, monkeypatch):
    """study_cifarnet's command line with --checkpoint-dir: extending a run continues its curve file without
    duplicates, lines a killed run wrote after its last checkpoint are dropped, and a checkpoint of another
    run is refused before the curve file is touched."""
    import horovod_terngrad.operations.datasets as datasets
    import study_cifarnet
    monkeypatch.setattr(datasets, "load_fashion_mnist", lambda: _tiny_image_data(n_train=256, n_test=32))
    out, ckdir = tmp_path / "out", tmp_path / "ck"
    argv = ["--workers", "2", "--eval-every", "0.5", "--compressions", "terngrad", "--out", str(out),
            "--checkpoint-dir", str(ckdir)]
    curve = out / "cifarnet_curve_2_terngrad.jsonl"

    def points():
        return [json.loads(line) for line in curve.read_text().splitlines()]
    study_cifarnet.main(argv + ["--epochs", "1"])
    assert [p["iterations"] for p in points()] == [1, 2]
    assert (ckdir / "cifarnet_curve_2_terngrad.pt").exists()
    with open(curve, "a") as f:                   # as if a killed run had logged past its checkpoint
        f.write(json.dumps(dict(points()[-1], iterations=99)) + "\n")
    study_cifarnet.main(argv + ["--epochs", "2"])
    first = points()
    assert [p["iterations"] for p in first] == [1, 2, 3, 4]
    assert all(p["variant"] == "" and p["lr"] == 2e-4 and "SUBSTITUTE" in p["dataset"] for p in first)
    with pytest.raises(ValueError, match="is of another run"):
        study_cifarnet.main(argv + ["--epochs", "2", "--seed", "9"])
    assert points() == first


@contextlib.contextmanager
def private_loopback():
    """A command prefix that runs in a network namespace of its own (root and iproute2: ``ip netns exec``, which
    also shows that namespace's /sys/class/net), so that its loopback counters count only its own traffic, not
    whatever else this machine sends over loopback meanwhile; without root, no prefix (the machine's loopback)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield []
        return
    name = f"tglo{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True,
                       capture_output=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.mark.slow
def test_ddp_benchmark_worker_horovod_rows_and_plot(tmp_path, monkeypatch):
    """examples/ddp_benchmark.py: its worker under torchrun (2 ranks, loopback) times every configuration and
    counts TernGrad's bits; Horovod's rows are read from emulated_cluster_benchmark's cell (a saved one
    here) with bits/param counting the tensors left at full precision; the plot is written."""
    import argparse

    import ddp_benchmark
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "ddp_benchmark.py"), "worker", "--model", "tiny",
           "--batch", "4", "--steps", "1", "--rounds", "2", "--warmup", "3",
           "--configs", "fp32,fp16,powersgd1,terngrad,terngrad-requantized,local",
           "--link-counters", "lo", "--json", str(out)]
    with private_loopback() as prefix:
        p = subprocess.run(prefix + cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    by = {r["config"]: r for r in res["rows"]}
    assert list(by) == ["fp32", "fp16", "powersgd1", "terngrad", "terngrad-requantized", "local"]
    assert all(len(r["step_ms_by_round"]) == 2 and r["step_ms"] > 0 for r in res["rows"])
    assert by["fp32"]["bits_per_param"] == 32 and by["fp16"]["bits_per_param"] == 16
    # tiny: 300 tensors of 64 elements, all under min_numel, so TernGrad sends every one at full precision
    assert by["terngrad"]["compressed_fraction"] == 0 and by["terngrad"]["bits_per_param"] == 32
    # the loopback's counters, one host: fp32's 2 steps carried at least its gradients once; no DDP, no bytes
    # beyond the barriers'
    (host, (sent, received)), = by["fp32"]["link_bytes_per_step"].items()
    assert sent >= 4 * res["params"] and received >= 4 * res["params"]
    assert max(by["local"]["link_bytes_per_step"][host]) < 0.1 * sent
    # the table: each row's limit from its busiest link direction, beside the shared-core limit (local row)
    res.update(ranks_per_host=2, hosts=1, regime={"compute_alone_ms": 10.0, "gbps": 1.0, "params": res["params"]})
    table = {line.split(" | ")[3]: line for line in ddp_benchmark.rows(res, "regime8")}
    wire = 1000 * 8 * max(sent, received) / 1e9
    local = by["local"]["step_ms"]
    assert f"| {10 + wire:.0f} = 10 + 0 + {wire:.0f} |" in table["DDP fp32"]
    assert f"| {local + wire:.0f} | {by['fp32']['step_ms'] / (local + wire):.2f}x |" in table["DDP fp32"]

    cell = json.load(open(os.path.join(ROOT, "docs", "cluster", "resnet50-n2-1gbit-r1.json")))
    cell["rows"] = [r for r in cell["rows"] if r["config"] in ("fp16", "terngrad")]
    monkeypatch.setattr(ddp_benchmark, "horovod_cell", lambda *a: cell)
    args = argparse.Namespace(out=str(tmp_path), tag="", horovod="fp16,terngrad", batch=8, image=64, context=64,
                              steps=3, rounds=3, warmup=2, timeout=60)
    rows = ddp_benchmark.horovod_rows("resnet50", 2, "1gbit", args)
    assert [r["config"] for r in rows] == ["horovod-fp16", "horovod-terngrad"]
    tern = next(r for r in cell["rows"] if r["config"] == "terngrad")
    small = sum(n for n in cell["sizes"] if n < 4096)
    assert rows[0]["bits_per_param"] == 16
    assert rows[1]["bits_per_param"] == pytest.approx(
        (tern["bits_per_element"] * (cell["params"] - small) + 32 * small) / cell["params"])
    assert 2.0 < rows[1]["bits_per_param"] < 2.1 and rows[1]["step_ms"] == tern["step_ms"]
    res.update(rate="none", rows=res["rows"] + rows)
    (tmp_path / "tiny-n2-none.json").write_text(json.dumps(res))
    (tmp_path / "tiny-n2-none-r2.json").write_text(json.dumps(res))     # another tag's: not in this plot
    assert [c["model"] for c in ddp_benchmark.saved_cells(str(tmp_path))] == ["tiny"]
    footer = ddp_benchmark.plot(ddp_benchmark.saved_cells(str(tmp_path)), str(tmp_path / "steps.png"))
    assert (tmp_path / "steps.png").stat().st_size > 5000 and "steps.png" in footer[-1]


@pytest.mark.slow
def test_ddp_benchmark_profile_breaks_a_terngrad_step_down(tmp_path):
    """--profile: TernGradState.trace records the hook's spans and the worker breaks TernGrad's step down
    (forward/backward to the last bucket, tail, optimizer; the worker's spans) for both AdamW rows; every row
    gets its forward+backward / optimizer split.  ``profile`` itself, on a trace written out by hand."""
    import ddp_benchmark
    out = tmp_path / "ddp.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        os.path.join(ROOT, "examples", "ddp_benchmark.py"), "worker", "--model", "tiny",
                        "--batch", "4", "--steps", "2", "--rounds", "1", "--warmup", "3", "--optim", "adamw",
                        "--profile", "--configs", "terngrad,terngrad-tgadamw,local", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    for key in ("terngrad", "terngrad-tgadamw"):
        prof = rows[key]["profile"]
        assert prof["buckets"] >= 1 and prof["step"] > 0
        split = prof["by_step"]
        assert len(split["step"]) == 2 and all(v >= 0 for k in ("tail", "optimizer") for v in split[k])
        for i, step_ms in enumerate(split["step"]):
            parts = split["forward_backward"][i] + split["tail"][i] + split["optimizer"][i]
            assert parts == pytest.approx(step_ms, rel=1e-9)
        assert min(split["step"]) <= prof["step"] <= max(split["step"])
        kinds = {s[0] for s in prof["last_step"]["spans"]}
        assert {"hook", "start", "finish"} <= kinds
        # one entry per bucket, holding every gradient element of the model once, each timed step recorded
        assert len(prof["per_bucket"]) == prof["buckets"]
        assert sum(b["elements"] for b in prof["per_bucket"]) == 300 * 64
        assert all(len(b["by_step"]["start"]) == 2 and b["ms"]["start"] > 0 for b in prof["per_bucket"])
    assert all(r["forward_backward_ms"] > 0 and r["optimizer_ms"] > 0 for r in rows.values())
    # a step begun at 0 s: buckets handed over at 0.1 and 0.3 s, backward back at 0.5, optimizer done at 0.6
    trace = [("hook", 0, 0.1, 0.1, 0, 0), ("start", 0, 0.1, 0.12, 0.01, 0),
             ("hook", 1, 0.3, 0.3, 0, 0), ("start", 1, 0.3, 0.33, 0.02, 0),
             ("finish", 0, 0.33, 0.35, 0.01, 0.005), ("copy", 0, 0.33, 0.335, 0, 0),
             ("plain", 1, 0.4, 0.45, 0, 0), ("finish", 1, 0.35, 0.49, 0.01, 0.1)]
    got = ddp_benchmark.profile(trace, [(0.0, 0.5, 0.6)])
    assert got["forward_backward"] == pytest.approx(300) and got["tail"] == pytest.approx(200)
    assert got["optimizer"] == pytest.approx(100) and got["encode"] == pytest.approx(50)
    assert got["codec"] == pytest.approx(50) and got["wait"] == pytest.approx(155)
    assert got["copies"] == pytest.approx(5) and got["worker_busy"] == pytest.approx(210)
    assert got["buckets"] == 2
    # the regime's yardstick: bench compute with the run's optimizer, on the worker's model
    import argparse
    alone = ddp_benchmark.compute_alone("tiny", argparse.Namespace(batch=2, image=64, context=64, optim="adamw"))
    assert alone["params"] == 300 * 64 and alone["compute_ms"] > 0


def test_ddp_benchmark_per_bucket_breaks_the_hook_down_by_bucket():
    """``per_bucket``: each bucket's start span, codec, wait, write-back, finish and latency per timed step,
    from a trace written out by hand (two steps; bucket 1's finish holds its full-precision allreduce's wait)."""
    import ddp_benchmark

    def step(t0, slow):     # a step begun at t0 s: buckets of 100 and 40 elements handed over at +0.1 and +0.3
        return [("hook", 0, t0 + 0.1, t0 + 0.1, 0, 0, 100), ("start", 0, t0 + 0.1, t0 + 0.12, 0.01, 0),
                ("hook", 1, t0 + 0.3, t0 + 0.3, 0, 0, 40), ("start", 1, t0 + 0.3, t0 + 0.33, 0.02, 0),
                ("finish", 0, t0 + 0.33, t0 + 0.35, 0.01, 0.005), ("copy", 0, t0 + 0.33, t0 + 0.335, 0, 0),
                ("plain", 1, t0 + 0.4, t0 + 0.45, 0, 0), ("finish", 1, t0 + 0.35, t0 + 0.49 + slow, 0.01, 0.06)]
    trace = step(0.0, 0.0) + step(1.0, 0.04)
    got = ddp_benchmark.per_bucket(trace, [(0.0, 0.5, 0.6), (1.0, 1.54, 1.6)])
    assert [(b["bucket"], b["elements"]) for b in got] == [(0, 100), (1, 40)]
    b0, b1 = got[0]["by_step"], got[1]["by_step"]
    assert b0["handed_over"] == [100, 100] and b0["start"] == [20, 20] and b0["codec"] == [20, 20]
    assert b0["wait"] == [5, 5] and b0["finish"] == [20, 20] and b0["write_back"] == [5, 5]
    assert b0["done"] == [250, 250]
    assert b1["wait"] == [110, 110] and b1["finish"] == [140, 180] and b1["write_back"] == [20, 60]
    assert b1["done"] == [190, 230] and got[1]["ms"]["finish"] == 180      # the median of two: the upper one
    lines = ddp_benchmark.bucket_table(got)
    assert len(lines) == 4 and lines[2].split()[:2] == ["0", "100"] and "write back" in lines[1]


def test_models_gpt2_is_the_ddp_benchmarks_transformers_workload():
    pytest.importorskip("transformers")
    from horovod_terngrad.operations import models
    model, x = models.make("gpt2", 2)
    sizes = [q.numel() for q in model.parameters()]
    assert len(sizes) == 76 and sum(sizes) == 27_336_704 and x.shape == (2, 64)
    assert model(x).shape == (2, 64, 16384)


# -- mixed precision (--amp) -----------------------------------------------------------------------
# A loss scale far above what these models' fp16 gradients bear: the first steps overflow, GradScaler skips them
# and halves the scale each time until a step fits, and training goes on.  Every rank must skip the same steps,
# with TernGrad (on_nonfinite="propagate", the default: the NaN/Inf reaches every rank's average) as with the
# uncompressed baseline.  Until the first step that fits, both runs hold the same parameters and see the same
# local gradients, so they must skip exactly the same steps; after it their parameters differ (TernGrad's average
# is not fp32's) and a later overflow near the scale's new level may come a few steps earlier or later in either.
# So each run stops at its first trained step: the counts compared are the ones that must be equal.
LENET_STEPS = 8          # LeNet at 2**26: steps 1-7 overflow (the scale falls to 2**19), step 8 trains
LM_STEPS = 8             # the tiny GPT-2 at 2**24: steps 1-7 overflow (to 2**17), step 8 trains
def _launch_ranks(spec, what):
    """Run ``spec`` (``_on_horovod`` / ``_on_torchrun``) on 2 forked ranks; the ranks' output (``forked_example``)."""
    import tempfile
    kind, script, args = spec
    with tempfile.TemporaryDirectory(prefix="tg-example-") as log_dir:
        return forked_example(kind, script, args, log_dir, what=what)


def _on_horovod(script, *args):
    """``examples/script args`` with horovodrun --gloo's environment (for ``_launch_ranks``)."""
    return "horovod", script, args


def _on_torchrun(script, *args):
    """``examples/script args`` with torchrun's environment (for ``_launch_ranks``)."""
    return "torch", script, args


def _result_lines(stdout):
    """The ``result: {...}`` objects printed (rank 0's), wherever they are in a line."""
    dec, out, at = json.JSONDecoder(), [], stdout.find("result: {")
    while at >= 0:
        obj, end = dec.raw_decode(stdout, at + len("result: "))
        out.append(obj)
        at = stdout.find("result: {", end)
    return out


def _check_overflowed(rec, stdout, init_scale, steps):
    """Some steps skipped, not all; the scale came down; every rank skipped alike; the count was printed."""
    assert rec["amp"] == "fp16" and rec["init_scale"] == init_scale, rec
    assert 0 < rec["skipped_steps"] < steps, rec                 # overflowed, then trained
    assert rec["skipped_at"] == list(range(1, rec["skipped_steps"] + 1)), rec
    assert rec["loss_scale"] < init_scale, rec
    assert rec["skipped_steps_per_rank"] == [rec["skipped_steps"]] * 2, rec
    assert f"amp fp16: {rec['skipped_steps']} steps skipped so far, loss scale {rec['loss_scale']:.6g}" in stdout
    assert f"steps skipped on each rank: {rec['skipped_steps_per_rank']}" in stdout


def test_mixed_precision_helper_counts_skipped_steps_and_parses_scales():
    """examples/mixed_precision.py without ranks (the DDP recipe on a plain model): a huge scale overflows the
    fp16 autocast gradients, each overflow is counted once and halves the scale, the parameters stay put while
    steps are skipped; skips go on being counted once the scale has underflowed to 0; bf16 and off need no
    scaler; '2**40' is a scale."""
    import argparse

    import mixed_precision as mp
    assert mp.scale_value("2**40") == 2.0 ** 40 and mp.scale_value("65536") == 65536.0
    for bad in ("0", "-1", "inf", "two", "10**400"):
        with pytest.raises(argparse.ArgumentTypeError):
            mp.scale_value(bad)
    p = argparse.ArgumentParser()
    mp.add_arguments(p)
    a = p.parse_args([])
    assert a.amp == "off" and a.init_scale == 2.0 ** 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = mp.MixedPrecision("fp16", "cpu", 2.0 ** 40)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    w0 = model[0].weight.detach().clone()
    taken = []
    for _ in range(40):
        opt.zero_grad()
        with amp.autocast():
            out = model(x)
            assert out.dtype == torch.float16
            loss = F.cross_entropy(out, y)
        taken.append(amp.step(loss, opt))
        if not any(taken):
            assert torch.equal(model[0].weight, w0)              # skipped: no update
    first = taken.index(True)
    assert 0 < first and not any(taken[:first]) and amp.skipped == taken.count(False) >= first
    assert amp.scale == 2.0 ** 40 / 2 ** amp.skipped              # backoff 0.5 per skip, no growth in 40 steps
    assert amp.skipped_at == [i + 1 for i, t in enumerate(taken) if not t]
    assert amp.record() == {"amp": "fp16", "init_scale": 2.0 ** 40, "skipped_steps": amp.skipped,
                            "loss_scale": amp.scale, "skipped_at": amp.skipped_at}
    assert f"{amp.skipped} steps skipped so far" in amp.summary()
    # a NaN in every step (PowerSGD's poisoned state does this): the scale halves to 0 and stays there, and the
    # steps skipped after that still count (the scale no longer goes down; opt.step() still does not run)
    nan = mp.MixedPrecision("fp16", "cpu", 2.0 ** -148)
    for _ in range(6):
        opt.zero_grad()
        with nan.autocast():
            loss = F.cross_entropy(model(x * float("nan")), y)
        assert nan.step(loss, opt) is False
    assert nan.scale == 0.0 and nan.skipped == 6 and nan.skipped_at == [1, 2, 3, 4, 5, 6]
    bf = mp.MixedPrecision("bf16", "cpu")
    with bf.autocast():
        assert model(x).dtype == torch.bfloat16
    assert bf.scaler is None and bf.record() == {"amp": "bf16"}
    assert mp.MixedPrecision().summary() == "" and mp.MixedPrecision().record() == {"amp": "off"}


@pytest.mark.slow
def test_mnist_lenet_amp_fp16_terngrad_skips_its_overflowed_steps_on_both_ranks(tmp_path):
    """Horovod frontend (examples/mnist_lenet.py): with --amp fp16 and a huge initial scale, TernGrad (defaults)
    carries the overflows into the average (NaN), so both ranks skip the same steps and the scale comes down.  That
    these are the steps Compression.none skips is test_amp.py's claim, on the same frontend's recipe."""
    init, steps = 2.0 ** 26, LENET_STEPS
    out = tmp_path / "terngrad.json"
    log = _launch_ranks(_on_horovod("mnist_lenet.py", "--epochs", 1, "--max-steps", steps, "--test-limit", 200,
                                 "--compression", "terngrad", "--amp", "fp16", "--init-scale", "2**26",
                                 "--json", out), "mnist_lenet.py --compression terngrad --amp fp16")
    rec = json.loads(out.read_text())[-1]
    _check_overflowed(rec, log, init, steps)
    assert np.isfinite(rec["loss"]) and rec["compression"] == "terngrad"
    assert rec["nonfinite_propagated"] > 0, rec          # the overflows reached the average through TernGrad's NaN


@pytest.mark.slow
def test_ddp_mnist_amp_fp16_terngrad_hook_skips_its_overflowed_steps_on_both_ranks(tmp_path):
    """DDP hook (examples/ddp_mnist.py): --amp fp16 with a huge initial scale: both ranks skip the same steps and
    end with the same parameters (plain DDP's steps: test_amp.py)."""
    init, steps = 2.0 ** 26, LENET_STEPS
    log = _launch_ranks(_on_torchrun("ddp_mnist.py", "--hook", "terngrad", "--max-steps", steps, "--test-limit", 200,
                                      "--log-every", 3, "--amp", "fp16", "--init-scale", "2**26"),
                        "ddp_mnist.py --hook terngrad --amp fp16")
    rec = _result_lines(log)[-1]
    _check_overflowed(rec, log, init, steps)
    assert rec["params_identical"] and rec["steps"] == steps and np.isfinite(rec["loss_last"])
    assert rec["terngrad"]["nonfinite_propagated"] > 0, rec


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["horovod", "ddp"])
def test_transformers_lm_amp_fp16_terngrad_skips_its_overflowed_steps_on_both_ranks(frontend):
    """examples/transformers_lm.py on either frontend, --amp fp16 with a huge initial scale: both ranks skip the same
    steps and stay identical (the uncompressed baseline's steps: test_amp.py)."""
    pytest.importorskip("transformers")
    init, steps = 2.0 ** 24, LM_STEPS
    cmd = ("transformers_lm.py", "--frontend", frontend, "--compression", "terngrad", "--steps", steps,
           "--log-every", 4, "--n-embd", 64, "--n-head", 2, "--amp", "fp16", "--init-scale", "2**24")
    log = _launch_ranks(_on_horovod(*cmd) if frontend == "horovod" else _on_torchrun(*cmd),
                        f"transformers_lm.py --frontend {frontend} --amp fp16")
    rec = _result_lines(log)[-1]
    _check_overflowed(rec, log, init, steps)
    assert rec["params_identical"] and rec["steps"] == steps and np.isfinite(rec["held_out_loss"])
    assert rec["nonfinite_propagated"] > 0, rec


@pytest.mark.slow
def test_mnist_lenet_amp_bf16_terngrad_trains(tmp_path):
    """--amp bf16 (autocast, no scaler) with TernGrad on Horovod: completes with a finite, falling loss."""
    out = tmp_path / "bf16.json"
    log = _launch_ranks(_on_horovod("mnist_lenet.py", "--epochs", 2, "--max-steps", 20, "--test-limit", 200,
                                 "--amp", "bf16", "--json", out), "mnist_lenet.py --amp bf16")
    hist = json.loads(out.read_text())
    assert [r["amp"] for r in hist] == ["bf16", "bf16"] and "skipped_steps" not in hist[-1]
    assert all(np.isfinite(r["loss"]) for r in hist) and hist[-1]["loss"] < hist[0]["loss"], hist
    assert "amp bf16" in log


@pytest.mark.slow
def test_transformers_lm_eval_every_writes_a_learning_curve(tmp_path):
    """examples/transformers_lm.py --eval-every 3 over 7 steps (DDP, 2 ranks): a curve at steps 3, 6 and the last,
    7, its training time growing, its last point the run's held-out loss, and ranks still in step (identical)."""
    pytest.importorskip("transformers")
    out = tmp_path / "lm.json"
    log = _launch_ranks(_on_torchrun("transformers_lm.py", "--frontend", "ddp", "--compression", "terngrad",
                                      "--steps", 7, "--eval-every", 3, "--log-every", 0, "--n-embd", 64,
                                      "--n-head", 2, "--json", out), "transformers_lm.py --eval-every 3")
    rec = json.loads(out.read_text())
    curve = rec["curve"]
    assert rec["eval_every"] == 3 and [c["step"] for c in curve] == [3, 6, 7], curve
    times = [c["train_s"] for c in curve]
    assert 0 < times[0] <= times[1] <= times[2], curve
    assert all(np.isfinite(c["held_out_loss"]) for c in curve)
    assert curve[-1]["held_out_loss"] == rec["held_out_loss"] and rec["params_identical"]
    assert log.count("eval step ") == 3


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_mnist.py", "mnist_lenet.py"])
def test_mnist_examples_take_optim_tg_adamw(script):
    """--optim tg-adamw on the MNIST examples (DDP hook, Horovod): trains, ranks identical."""
    if script == "ddp_mnist.py":
        log = _launch_ranks(_on_torchrun(script, "--optim", "tg-adamw", "--max-steps", 12, "--test-limit", 200,
                                          "--log-every", 6), f"{script} --optim tg-adamw")
        rec = _result_lines(log)[-1]
        assert rec["params_identical"] and rec["loss_last"] < rec["loss_first"]
    else:
        log = _launch_ranks(_on_horovod(script, "--optim", "tg-adamw", "--epochs", 1, "--max-steps", 12,
                                     "--test-limit", 200), f"{script} --optim tg-adamw")
        assert "test acc" in log


def test_docs_examples_has_an_entry_with_a_command_for_every_example():
    """docs/examples.md: a heading naming each file of examples/, and, for each one that runs, a command."""
    doc = open(os.path.join(ROOT, "docs", "examples.md")).read()
    entries = {}
    for block in doc.split("\n### ")[1:]:
        head, _, text = block.partition("\n")
        for name in re.findall(r"`examples/([\w]+\.py)`", head):
            entries[name] = text
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    assert sorted(entries) == scripts
    for name, text in entries.items():
        assert "Imported, not run." in text or f"examples/{name}" in text.split("```")[1], name


# -- --device: every example a user runs takes it, and decides it the same way (operations/devices.py) ------------
DEVICE_EXAMPLES = {"mnist_lenet.py": None, "ddp_mnist.py": None, "lightning_ddp.py": "lightning",
                   "accelerate_ddp.py": None, "hf_trainer_ddp.py": "transformers", "transformers_lm.py": None,
                   "fsdp_memory.py": None, "synthetic_benchmark.py": None, "cifarnet.py": None,
                   "fsdp_benchmark.py": None, "fsdp_benchmark.py worker": None, "fsdp_benchmark.py compute": None,
                   "ddp_benchmark.py": None, "ddp_benchmark.py worker": None}


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("command", sorted(DEVICE_EXAMPLES))
def test_every_example_a_user_runs_takes_device(command):
    """``--help`` of each example (and of the benchmarks' worker and compute commands) offers --device
    auto|cpu|cuda: the README's main job, the DDP / Lightning / Accelerate / Trainer / FSDP2 recipes, the
    benchmarks.  (examples/mixed_precision.py is the examples' helper: it takes the device type they chose.)"""
    if DEVICE_EXAMPLES[command]:
        pytest.importorskip(DEVICE_EXAMPLES[command])
    script, *sub = command.split()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *sub, "--help"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--device {auto,cpu,cuda}" in p.stdout, p.stdout[-2000:]


@pytest.mark.slow
def test_ddp_example_on_device_auto_runs_on_the_cpu_with_gloo_here():
    """No GPU here: --device auto is the CPU and gloo (the header names the backend), and trains."""
    log = _launch_ranks(_on_torchrun("ddp_mnist.py", "--device", "auto", "--max-steps", 4, "--test-limit", 100,
                                      "--epochs", 1, "--log-every", 2), "ddp_mnist.py --device auto")
    assert "DDP (gloo), 2 ranks" in log and _result_lines(log)[-1]["params_identical"]


@pytest.mark.slow
@pytest.mark.one_process
def test_device_cuda_without_a_gpu_stops_with_the_reason():
    """--device cuda on a machine without CUDA fails before any process group, naming what is missing."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ddp_mnist.py"), "--device", "cuda"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0
    assert "DeviceError: --device cuda: no CUDA device: torch.cuda.is_available() is False" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("levels", [3, 4])
def test_level_rounding_is_unbiased_on_its_levels_with_the_variance_it_reports(levels):
    """examples/level_rounding.py: every value one of the evenly spaced levels from -s to s; the mean of many draws
    is the input and their variance the one reported; 4 levels' variance is below ternary's."""
    import level_rounding
    c = torch.linspace(-2.0, 2.0, 41)
    gen = torch.Generator().manual_seed(0)
    draws, var = zip(*[level_rounding.round_to_levels(c, 2.0, levels, gen) for _ in range(4000)])
    draws = torch.stack(draws)
    grid = torch.linspace(-2.0, 2.0, levels)
    assert torch.isclose(draws.unsqueeze(-1), grid).any(-1).all()
    assert torch.allclose(draws.mean(0), c, atol=0.05)
    assert torch.allclose(draws.var(0), var[0], atol=0.05)
    assert torch.allclose(level_rounding.round_to_levels(c, 2.0, 3, gen)[1], 2.0 * c.abs() - c * c, atol=1e-5)
    # on a Gaussian clipped at s = 2.5 sigma: ternary's mean variance about sigma², four levels' under half of it
    g = torch.clamp(torch.randn(200_000, generator=gen), -2.5, 2.5)
    mean_var = float(level_rounding.round_to_levels(g, 2.5, levels, gen)[1].mean())
    assert 0.9 < mean_var < 1.1 if levels == 3 else 0.35 < mean_var < 0.5, mean_var


def test_level_rounding_per_element_estimate_follows_each_elements_variance_where_means_differ():
    """examples/level_rounding.py's ``e`` estimate: where the ranks' mean gradient differs from element to element,
    the payload estimate scaled by the squares' rule over-counts the large elements' variance and under-counts the
    small ones'; taking each element's own square of the mean out follows the exact variance far closer."""
    import level_rounding
    from horovod_terngrad.codec import squares
    N, n, trials = 16, 4000, 10
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 2
    est = {"squares": torch.zeros(n), "per_element": torch.zeros(n), "exact": torch.zeros(n)}
    for _ in range(trials):
        total, squared, variance, clipped_sq = torch.zeros(n), torch.zeros(n), torch.zeros(n), 0.0
        for _r in range(N):
            c = (mean + torch.randn(n, generator=gen)).clamp(-5, 5)
            q, var = level_rounding.round_to_levels(c, 5.0, 3, gen)
            total, squared, variance = total + q, squared + q * q, variance + var
            clipped_sq += float((c.double() ** 2).sum())
        nu = squared / N ** 2
        squares.take_out_minibatch_share(nu, torch.tensor([clipped_sq]), N)
        est["squares"] += nu / trials
        est["per_element"] += level_rounding.per_element_estimate(squared, total / N, clipped_sq, N) / trials
        est["exact"] += variance / N ** 2 / trials
    error = {k: float((est[k] - est["exact"]).norm() / est["exact"].norm()) for k in ("squares", "per_element")}
    assert error["per_element"] < 0.5 * error["squares"], error
    assert 0.9 < float(est["per_element"].sum() / est["exact"].sum()) < 1.15


@pytest.mark.parametrize("levels", [3, 4])
def test_level_rounding_stratified_dithers_keep_each_rank_unbiased_and_lower_the_averages_variance(levels):
    """examples/level_rounding.py's ``c`` rounding: each rank's dither is uniform, so each rank's rounding stays
    unbiased; the ranks' average has a lower variance than with independent draws, never a higher one: far lower
    where the ranks hold the same values, lower where they differ (pairwise errors negatively correlated)."""
    import level_rounding
    N, n, trials = 16, 2000, 200
    gen = torch.Generator().manual_seed(2)
    shared_mean = torch.empty(n).uniform_(-1.0, 1.0, generator=gen)
    for spread, most in ((0.0, 0.1), (0.5, 0.8)):
        values = (shared_mean + spread * torch.randn(N, n, generator=gen)).clamp(-1.0, 1.0)
        sums = {"independent": [], "stratified": []}
        firsts = []
        for t in range(trials):
            own = [torch.Generator().manual_seed(1000 * t + r) for r in range(N)]
            dither = level_rounding.stratified_dither(n, N, torch.Generator().manual_seed(t), own)
            strat = torch.stack([level_rounding.round_to_levels(values[r], 1.0, levels, own[r], dither[r])[0]
                                 for r in range(N)])
            ind = torch.stack([level_rounding.round_to_levels(values[r], 1.0, levels, own[r])[0] for r in range(N)])
            sums["stratified"].append(strat.mean(0))
            sums["independent"].append(ind.mean(0))
            firsts.append(strat[0])
        assert torch.allclose(torch.stack(firsts).mean(0), values[0], atol=0.25)         # rank 0 alone: unbiased
        exact = values.mean(0)
        mse = {k: float(((torch.stack(v) - exact) ** 2).mean()) for k, v in sums.items()}
        assert abs(float((torch.stack(sums["stratified"]).mean(0) - exact).mean())) < 0.01
        assert mse["stratified"] < most * mse["independent"], (spread, mse)


def test_level_rounding_affine_dither_is_uniform_and_lowers_the_variance_as_the_permutation_does():
    """examples/level_rounding.py's ``affine_dither`` (what a kernel would draw: a shared affine map of the ranks to
    P >= N strata, from the codec's streams): each rank's dither uniform, and the ranks' average as far below the
    independent draws' variance as with a full random permutation."""
    import level_rounding
    from horovod_terngrad import codec
    N, n, trials = 16, 2000, 120
    gen = torch.Generator().manual_seed(3)
    d = level_rounding.affine_dither(50_000, N, codec.stream_key(1, 2, 3, 2**32 - 1),
                                     [codec.stream_key(1, 2, 3, r) for r in range(N)])
    assert abs(float(d.mean()) - 0.5) < 0.005 and abs(float(d.var()) - 1 / 12) < 0.002
    assert all(abs(float(d[r].mean()) - 0.5) < 0.01 for r in range(N))
    values = (torch.empty(n).uniform_(-1.0, 1.0, generator=gen) + 0.3 * torch.randn(N, n, generator=gen)).clamp(-1, 1)
    exact = values.mean(0)
    mse = {"affine": 0.0, "permutation": 0.0, "independent": 0.0}
    for t in range(trials):
        own = [torch.Generator().manual_seed(1000 * t + r) for r in range(N)]
        dithers = {"affine": level_rounding.affine_dither(n, N, codec.stream_key(0, t, 0, 2**32 - 1),
                                                          [codec.stream_key(0, t, 0, r) for r in range(N)]),
                   "permutation": level_rounding.stratified_dither(n, N, torch.Generator().manual_seed(t), own),
                   "independent": torch.rand((N, n), generator=gen)}
        for k, dk in dithers.items():
            avg = torch.stack([level_rounding.round_to_levels(values[r], 1.0, 4, own[r], dk[r])[0]
                               for r in range(N)]).mean(0)
            mse[k] += float(((avg - exact) ** 2).mean()) / trials
    assert mse["affine"] < 0.8 * mse["independent"], mse
    assert 0.85 < mse["affine"] / mse["permutation"] < 1.2, mse


@pytest.mark.parametrize("second", ["ef4", "sr4"])
def test_level_rounding_second_stage_lands_on_four_levels_and_returns_the_average_over_steps(second):
    """examples/level_rounding.py's owners' second stage: every value one of s·{-1, -1/3, 1/3, 1} per block; with
    error feedback (ef4) the remainder stays within half a level's spacing and the outputs' running sum follows the
    inputs'; the stochastic rounding (sr4) is unbiased."""
    import level_rounding
    from horovod_terngrad import TernGradConfig
    sim = level_rounding.LevelSimulator(torch.nn.Linear(4, 4), 4, TernGradConfig(exchange="allgather"), 4,
                                        estimate="c", second=second, second_bucket=64)
    gen = torch.Generator().manual_seed(4)
    avg = torch.randn(1000, generator=gen)
    outs = []
    for step in range(300):
        q, nbytes = sim._second_stage(0, avg)
        sim.step_count += 1
        blocks = q[:960].view(-1, 64).abs()       # whole blocks: each |q| is its block's s or s/3
        top = blocks.amax(dim=1, keepdim=True)
        assert (torch.isclose(blocks, top) | torch.isclose(blocks, top / 3)).all()
        outs.append(q)
        if second == "ef4":        # the block's largest |q| is its scaler: the remainder within s/3
            pad = (0, (-q.numel()) % 64)
            s = torch.nn.functional.pad(q, pad).view(-1, 64).abs().amax(dim=1, keepdim=True)
            assert (torch.nn.functional.pad(sim.residual[0], pad).view(-1, 64).abs() <= s / 3 + 1e-5).all()
    assert nbytes == pytest.approx(3 / 4 * 1000 * 2 / 8 + 4 * (16 - 16 / 4))
    mean = torch.stack(outs).mean(0)
    assert torch.allclose(mean, avg, atol=0.02 if second == "ef4" else 0.3), float((mean - avg).abs().max())


@pytest.mark.one_process
def test_lm_scale_study_runs_the_level_rounding_exchanges_under_four_bits(tmp_path):
    """study_lm_scale's level-rounding research paths: correlated 4 levels alone (``levels4c``: the first stage's 2-bit
    codes), with the owners' error-feedback second stage (``levels4c+ef4@b128``) and under owner-step
    (``owner-step-nearest:levels4c@b128``): finite runs, each below 4 bits per element received in all."""
    import study_lm_scale as sls
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The quick brown fox jumps over the lazy dog. " * 3000).encode())
    rows = sls.main(["--model", "gpt2", "--corpus", str(corpus), "--width", "32", "--layers", "1", "--seq-len", "32",
                     "--batch", "8", "--steps", "2", "--evals", "0", "--eval-windows", "8", "--workers", "4",
                     "--seeds", "0", "--exchanges", "levels4c,levels4c+ef4@b128,owner-step-nearest:levels4c@b128",
                     "--out", str(tmp_path / "runs")])
    by = {r["method"]: r for r in rows}
    assert all(np.isfinite(r["held_out"]) for r in rows)
    assert by["levels4c"]["bits_received"] < 2.0 < by["levels4c+ef4@b128"]["bits_received"] <= 4.0
    owner = by["owner-step-nearest:levels4c@b128"]
    assert owner["bits_received"] == pytest.approx(owner["bits_gradient"] + owner["bits_weights"])
    assert owner["bits_gradient"] < 2.0 and owner["bits_received"] <= 4.0
