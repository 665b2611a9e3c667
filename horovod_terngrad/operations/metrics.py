"""Training metrics of TernGrad: traffic per step, compression against fp32, and per layer the
fraction of zeros and the scaler; the console progress bar (tqdm); optional TensorBoard scalars and histograms
of the float, clipped, ternary and averaged gradients (the paper's Fig. 2).

    metrics = TernGradMetrics(compressor, world_size=hvd.size(), log_layers=True)
    for step ...:
        ...; opt.step()
        row = metrics.step()                        # dict of this step's figures
        bar.update(1); bar.set_postfix_str(metrics.summary(row))
    metrics.to_tensorboard(writer, global_step)     # any object with add_scalar / add_histogram

Per-layer figures cost a pass over each tensor's packed codes, so they are recorded only while
``log_layers`` is on; histograms need the tensors themselves, kept only for the names passed to
``capture`` (one step at a time).
"""
from __future__ import annotations

import sys

from ..exchange import cost


def wire_bytes(n_ranks: int, payload_bytes: float, handshake_bytes: float = 0.0,
               uncompressed_elements: float = 0.0) -> float:
    """Bytes one rank puts on the wire with ring collectives: a ring allgather forwards N-1 payloads;
    the scaler handshake and uncompressed fp32 tensors are ring allreduces (2(N-1)/N of their size)."""
    return (cost.ring_allgather_bytes(payload_bytes, n_ranks)
            + cost.ring_allreduce_bytes(handshake_bytes + 4 * uncompressed_elements, n_ranks))


def epoch_report(stats, n_ranks: int, steps: int) -> tuple[float, float, str]:
    """(wire bytes per step, bits per element handed to collectives, timing text) of an epoch's stats."""
    sent = wire_bytes(n_ranks, stats.payload_bytes_sent, stats.handshake_bytes_sent) / steps
    timing = (f"  [TernGrad per step: {stats.tensors / steps:.0f} tensors, codec {1000 * stats.codec_s / steps:.1f} ms, "
              f"waiting for handshakes {1000 * stats.handshake_wait_s / steps:.1f} ms, for payloads "
              f"{1000 * stats.gather_wait_s / steps:.1f} ms]")
    return sent, stats.bits_per_element(), timing


class TernGradMetrics:
    """Per-step figures of a compressor (anything with ``stats``, ``inspection`` and
    ``uncompressed_elements``, e.g. a ``TernGradCompressor``)."""

    def __init__(self, compressor, world_size: int, log_layers: bool = True, capture=()):
        self.comp = compressor
        self.world = world_size
        self.log_layers = log_layers
        self.capture = set(capture)
        self._last = self._snapshot()
        self._apply()

    def _apply(self):
        self.comp.inspection.track_layers = self.log_layers
        self.comp.inspection.capture = set(self.capture)

    def _snapshot(self):
        st = self.comp.stats
        return (st.payload_bytes_sent, st.handshake_bytes_sent, st.bytes_received, st.elements,
                self.comp.uncompressed_elements)

    def step(self) -> dict:
        """Figures of the exchanges since the previous call."""
        now = self._snapshot()
        payload, handshake, received, elements, plain = (a - b for a, b in zip(now, self._last))
        self._last = now
        sent = payload + handshake
        N = self.world
        fp32_ring = wire_bytes(N, 0, 0, elements + plain) if N > 1 else 0.0
        wire = wire_bytes(N, payload, handshake, plain)
        row = {"bytes_sent": sent, "bytes_received": received, "elements": elements,
               "bits_per_element": 8 * sent / elements if elements else 0.0,
               "compression_vs_fp32": fp32_ring / wire if wire else float("nan"),
               "layers": {name: vars(rec) for name, rec in self.comp.inspection.layers.items()}}
        return row

    @staticmethod
    def summary(row: dict) -> str:
        return (f"sent {row['bytes_sent'] / 1024:.0f} KiB, recv {row['bytes_received'] / 1024:.0f} KiB, "
                f"{row['bits_per_element']:.2f} b/elt, {row['compression_vs_fp32']:.1f}x < fp32")

    def to_tensorboard(self, writer, global_step: int, row: dict | None = None) -> None:
        """Scalars of ``row`` (or a fresh ``step()``) and histograms of the captured tensors."""
        row = row or self.step()
        for key in ("bytes_sent", "bytes_received", "bits_per_element", "compression_vs_fp32"):
            writer.add_scalar(f"terngrad/{key}", row[key], global_step)
        for name, rec in row["layers"].items():
            writer.add_scalar(f"terngrad/zero_fraction/{name}", rec["zero_fraction"], global_step)
            writer.add_scalar(f"terngrad/scaler/{name}", rec["scaler"], global_step)
        for name, tensors in self.comp.inspection.captures.items():
            for label, t in zip(("float", "clipped", "ternary", "averaged"), tensors):
                if t is not None:
                    writer.add_histogram(f"terngrad/{name}/{label}", t.detach().float().cpu(), global_step)
        self.comp.inspection.captures.clear()


def accuracy(model, x, y, batch: int = 1000, transform=None) -> float:
    """Top-1 accuracy of ``model`` on (x, y) in eval mode, ``transform`` applied to each input batch."""
    import torch
    device = next(model.parameters()).device      # the data may stay on the CPU while the model is on a GPU
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb = x[i:i + batch]
            xb = (transform(xb) if transform else xb).to(device)
            correct += (model(xb).argmax(1) == y[i:i + batch].to(device)).sum().item()
    model.train()
    return correct / len(x)


def tensorboard_writer(logdir: str):
    """torch.utils.tensorboard.SummaryWriter, with a clear error when the package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError("TensorBoard logging needs the tensorboard package: pip install tensorboard") from e
    return SummaryWriter(logdir)


def progress_bar(total: int, desc: str = "", rank: int = 0, enabled: bool | None = None, **tqdm_kwargs):
    """The console progress bar of a training loop: tqdm (which transformers and Lightning bring anyway),
    shown on rank 0 only and, unless ``enabled`` says otherwise, only when stderr is a terminal (logs of
    batch jobs stay free of carriage returns).  ``bar.set_postfix_str(metrics.summary(row))`` adds the
    step's traffic; a disabled bar costs nothing."""
    from tqdm import tqdm
    show = (sys.stderr.isatty() if enabled is None else bool(enabled)) and rank == 0
    return tqdm(total=total, desc=desc, disable=not show, dynamic_ncols=True, leave=True, **tqdm_kwargs)
