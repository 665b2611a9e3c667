"""TernGrad's per-step figures in the frameworks' own logs (horovod_terngrad.integrations): the arithmetic of
``StepFigures`` on counters set by hand, then each framework on 2 CPU processes (gloo) through its example, as
users launch it: Lightning's ``CSVLogger`` (examples/lightning_ddp.py --log-dir), the transformers Trainer's
``log_history`` and the callbacks after ours (examples/hf_trainer_ddp.py), an Accelerate tracker
(examples/accelerate_ddp.py --log-jsonl).
"""
import csv
import glob
import json
import os
import sys

import pytest

from horovod_terngrad.exchange import ExchangeStats
from horovod_terngrad.integrations import FIGURE_KEYS, StepFigures, stats_of
from test_ecosystem import EXAMPLES, launch, results, torchrun

# Linear(32, 256) and Linear(256, 256) of examples/lightning_ddp.py are the tensors TernGrad ternarizes
LIGHTNING_ELEMENTS = 32 * 256 + 256 * 256


class Holder:
    """A frontend state's shape: anything with ``.stats``."""

    def __init__(self):
        self.stats = ExchangeStats()


def test_step_figures_are_the_counters_difference_per_step():
    src = Holder()
    st = src.stats
    st.elements, st.payload_bytes_sent, st.codec_s = 1000, 300, 5.0        # before the figures are made: not counted
    fig = StepFigures(src)
    assert fig.read() == {}                                                  # nothing exchanged since
    st.elements += 2 * 4096
    st.payload_bytes_sent += 2 * 1044
    st.handshake_bytes_sent += 2 * 8
    st.codec_s += 0.006
    st.handshake_wait_s += 0.001
    st.gather_wait_s += 0.003
    got = fig.read(steps=2)
    assert set(got) == set(FIGURE_KEYS)
    assert got["terngrad/bits_per_element"] == 8 * (1044 + 8) / 4096
    assert got["terngrad/bytes_sent"] == 1052
    assert got["terngrad/bytes_saved_vs_fp32"] == 4 * 4096 - 1052
    assert got["terngrad/bytes_saved_vs_bf16"] == 2 * 4096 - 1052
    assert got["terngrad/codec_ms"] == pytest.approx(3.0) and got["terngrad/wait_ms"] == pytest.approx(2.0)
    assert fig.read() == {}
    assert StepFigures(src, since_start=True).read()["terngrad/bytes_sent"] == 300 + 2 * 1052


def test_a_source_without_terngrad_counters_is_refused_clearly():
    assert stats_of(None) is None
    with pytest.raises(TypeError, match="Linear has no TernGrad counters"):
        import torch
        StepFigures(torch.nn.Linear(2, 2))


def exchange(stats, elements=4096, payload=1040):
    """What one step's exchange adds to the counters (one tensor of ``elements``, 2-bit payload)."""
    stats.tensors += 1
    stats.elements += elements
    stats.payload_bytes_sent += payload
    stats.codec_s += 0.002


def test_lightning_callback_in_one_process_logs_the_sources_figures_and_warns_without_ddp(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from horovod_terngrad.integrations.lightning import TernGradLoggingCallback
    src = Holder()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            exchange(src.stats)                  # the exchange a frontend would have made for this step
            return self.lin(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)
    common = dict(accelerator="cpu", devices=1, max_steps=3, log_every_n_steps=1, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(callbacks=[TernGradLoggingCallback(src)], logger=CSVLogger(tmp_path, name="one"), **common)
    trainer.fit(Module(), data)
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "one" / "**" / "metrics.csv"), recursive=True)[0])))
    assert [float(r["terngrad/bits_per_element"]) for r in rows] == [8 * 1040 / 4096] * 3
    assert {float(r["terngrad/bytes_saved_vs_fp32"]) for r in rows} == {4 * 4096 - 1040}
    # without a source and without DDP: a warning, nothing logged, training goes on
    trainer = pl.Trainer(callbacks=[TernGradLoggingCallback()], logger=CSVLogger(tmp_path, name="none"), **common)
    with pytest.warns(UserWarning, match="has no DDP model"):
        trainer.fit(Module(), data)
    assert trainer.global_step == 3
    # (the module logs nothing itself: the logger writes a metrics.csv only if something was logged)
    assert all("terngrad/" not in open(f).read()
               for f in glob.glob(str(tmp_path / "none" / "**" / "metrics.csv"), recursive=True))


def test_trainer_callback_divides_by_the_steps_since_the_last_log_and_fills_only_its_own_entry():
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from horovod_terngrad.integrations.transformers import TernGradTrainerCallback
    src = Holder()
    cb = TernGradTrainerCallback(lambda: src)           # a callable source: the state made at on_train_begin
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    for _ in range(3):                                    # 3 steps, then a log as Trainer.log makes it
        cb.on_step_begin(args, state, control)
        exchange(src.stats)
        state.global_step += 1
    logs = {"loss": 1.5}
    state.log_history.append({**logs, "step": state.global_step})
    cb.on_log(args, state, control, logs=logs)
    assert logs["terngrad/bytes_sent"] == 1040 and logs["terngrad/codec_ms"] == pytest.approx(2.0)
    assert state.log_history[-1]["terngrad/bytes_saved_vs_bf16"] == 2 * 4096 - 1040
    # a log whose entry is not the last of the history (a callback's own log): the logs get the figures, no entry does
    exchange(src.stats)
    state.global_step += 1
    state.log_history.append({"eval_loss": 2.0, "step": state.global_step})
    other = {"custom": 1.0}
    cb.on_log(args, state, control, logs=other)
    assert other["terngrad/bytes_sent"] == 1040 and "terngrad/bytes_sent" not in state.log_history[-1]
    cb.on_log(args, state, control, logs={"x": 0.0})    # nothing exchanged since: nothing added
    assert all("terngrad/bytes_sent" not in e for e in state.log_history[-1:])


def test_figures_read_any_frontends_counters():
    from horovod_terngrad import TernGradCompressor
    comp = TernGradCompressor()
    fig = StepFigures(comp)
    exchange(comp.stats)
    assert fig.read()["terngrad/bytes_sent"] == 1040


def plausible(row, elements_per_step=None):
    bits = row["terngrad/bits_per_element"]
    assert 1.5 < bits < 32, row
    assert row["terngrad/bytes_saved_vs_fp32"] > row["terngrad/bytes_saved_vs_bf16"] > 0, row
    assert row["terngrad/codec_ms"] > 0 and row["terngrad/wait_ms"] >= 0, row
    if elements_per_step is not None:
        # saved against fp32 minus saved against bf16 is 2 bytes per ternarized element; bytes sent agree with bits
        assert row["terngrad/bytes_saved_vs_fp32"] - row["terngrad/bytes_saved_vs_bf16"] == 2 * elements_per_step
        assert row["terngrad/bytes_sent"] == pytest.approx(bits * elements_per_step / 8, rel=1e-6)


@pytest.mark.slow
def test_lightning_callback_logs_every_step_to_the_csv_logger(tmp_path):
    pytest.importorskip("lightning")
    steps = 8
    stdout = launch([sys.executable, os.path.join(EXAMPLES, "lightning_ddp.py"), "--out", str(tmp_path / "out"),
                     "--log-dir", str(tmp_path / "logs"), "--max-steps", str(steps)], "lightning_ddp.py --log-dir",
                    cwd=tmp_path)
    files = glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)
    assert len(files) == 1, files                      # rank 0's logger only
    with open(files[0]) as f:
        rows = [r for r in csv.DictReader(f) if r.get("terngrad/bits_per_element")]
    print("".join(open(files[0]).readlines()[:4]))
    assert [int(r["step"]) for r in rows] == list(range(steps))
    for r in rows:
        # Lightning logs float32 tensors: the byte figures come back rounded to float32
        plausible({k: float(r[k]) for k in FIGURE_KEYS})
        assert float(r["terngrad/bytes_saved_vs_fp32"]) - float(r["terngrad/bytes_saved_vs_bf16"]) == \
            pytest.approx(2 * LIGHTNING_ELEMENTS, rel=1e-6)
        assert 2.0 <= float(r["terngrad/bits_per_element"]) < 2.02
    assert "bytes saved" in stdout and "16.0x fewer" in stdout


@pytest.mark.slow
def test_trainer_callback_fills_log_history_and_the_callbacks_after_it():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    steps, every = 6, 2
    r0, r1 = results(launch(torchrun(os.path.join(EXAMPLES, "hf_trainer_ddp.py"), "--max-steps", steps,
                                     "--logging-steps", every), "hf_trainer_ddp.py --logging-steps 2"))
    for r in (r0, r1):
        assert r["optimizer"] == "horovod_terngrad.optim.adam"          # the example's default optimizer
        history = r["log_history"]
        assert [e["step"] for e in history] == [2, 4, 6]
        per_step = r["elements"] / steps
        for entry in history:
            plausible(entry, elements_per_step=per_step)
        # the Losses callback, after ours, received the same figures the history holds
        assert r["terngrad_seen_by_callback"] == [{k: e[k] for k in FIGURE_KEYS} for e in history]
    print(json.dumps(r0["log_history"][:2], indent=1))


@pytest.mark.slow
def test_accelerate_logger_hands_the_figures_to_the_trackers(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    steps, out = 5, tmp_path / "tg.jsonl"
    r0, _ = results(launch(torchrun(os.path.join(EXAMPLES, "accelerate_ddp.py"), "--steps", steps, "--log-jsonl",
                                    out), "accelerate_ddp.py --log-jsonl"))
    lines = [json.loads(x) for x in open(out)]
    assert [x["step"] for x in lines] == list(range(steps))           # the main process's tracker, once per step
    for x in lines:
        plausible(x, elements_per_step=r0["elements"] / steps)
    assert r0["optim"] == "horovod_terngrad.optim.adam"
