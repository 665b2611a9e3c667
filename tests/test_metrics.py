"""Metrics: per-step traffic, per-layer zeros and scaler, histograms (with a stand-in writer), progress bar."""
import io
import types

import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad.exchange import Engine, run_ranks
from horovod_terngrad.operations.metrics import TernGradMetrics, progress_bar


class Writer:
    def __init__(self):
        self.scalars, self.hists = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = value

    def add_histogram(self, tag, values, step):
        self.hists[tag] = values


def test_metrics_per_step_and_layer():
    sizes = {"fc.weight": 4000, "fc.bias": 40}

    def body(c):
        eng = Engine(c, TernGradConfig(shared_scaler=True))
        comp = types.SimpleNamespace(stats=eng.stats, inspection=eng.inspection, uncompressed_elements=0)
        m = TernGradMetrics(comp, world_size=c.size, log_layers=True, capture=("fc.weight",))
        gen = torch.Generator().manual_seed(c.rank)
        tks = [eng.start(torch.randn(n, generator=gen), name) for name, n in sizes.items()]
        outs = [eng.finish(t) for t in tks]
        row = m.step()
        w = Writer()
        m.to_tensorboard(w, 0, row)
        return row, w, outs

    for row, w, outs in run_ranks(2, body):
        from horovod_terngrad.codec import payload_size
        sent = payload_size(4000, "2bit", 0) + payload_size(40, "2bit", 0) + 2 * 8 * 9   # + 2 handshakes
        assert row["elements"] == 4040 and row["bytes_sent"] == sent
        assert row["bits_per_element"] == 8 * sent / 4040
        assert row["compression_vs_fp32"] == (2 * 1 / 2 * 4 * 4040) / sent
        fc = row["layers"]["fc.weight"]
        assert 0.3 < fc["zero_fraction"] < 0.95 and fc["scaler"] > 0 and fc["elements"] == 4000
        assert {"terngrad/fc.weight/float", "terngrad/fc.weight/clipped", "terngrad/fc.weight/ternary",
                "terngrad/fc.weight/averaged"} <= set(w.hists)
        tern = w.hists["terngrad/fc.weight/ternary"]
        assert set((tern / fc["scaler"]).round().unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert torch.equal(w.hists["terngrad/fc.weight/averaged"], outs[0])
        assert w.hists["terngrad/fc.weight/clipped"].abs().max() <= w.hists["terngrad/fc.weight/float"].abs().max()
        assert "terngrad/zero_fraction/fc.bias" in w.scalars


def test_progress_bar_is_tqdm_on_rank_0_and_only_on_a_terminal():
    from tqdm import tqdm
    out = io.StringIO()
    bar = progress_bar(4, "epoch 1", file=out, enabled=True)
    assert isinstance(bar, tqdm)
    for _ in range(4):
        bar.update(1)
        bar.set_postfix_str("12 KiB sent")
    bar.close()
    text = out.getvalue()
    assert "epoch 1" in text and "4/4" in text and "12 KiB sent" in text
    for kwargs in ({"rank": 1, "enabled": True}, {"enabled": False}, {}):   # {}: stderr here is not a terminal
        quiet = io.StringIO()
        bar = progress_bar(4, "epoch 1", file=quiet, **kwargs)
        bar.update(4)
        bar.close()
        assert bar.disable and quiet.getvalue() == "", kwargs
