"""What an exchange counts (``ExchangeStats``) and what it keeps for inspection (``Inspection``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from ..codec import packing, sizes
from ..codec.ternary import expand_scalers


@dataclass
class ExchangeStats:
    """Counters of what this rank handed to and got from collectives, and where its time went."""

    tensors: int = 0
    elements: int = 0
    payload_bytes_sent: int = 0
    handshake_bytes_sent: int = 0
    bytes_received: int = 0
    nonfinite_zeroed: int = 0
    nonfinite_propagated: int = 0     # tensors whose average was NaN on every rank (on_nonfinite='propagate')
    collectives: int = 0          # handshakes, allgathers and alltoalls launched (fusion lowers it)
    intra_node_bytes_sent: int = 0       # hierarchical exchange: fp32 bytes to the other ranks of this node
    intra_node_bytes_received: int = 0
    handshake_wait_s: float = 0.0
    gather_wait_s: float = 0.0
    codec_s: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes_sent + self.handshake_bytes_sent

    def bits_per_element(self) -> float:
        return 8.0 * self.bytes_sent / self.elements if self.elements else 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, type(f.default)(state.get(f.name, f.default)))


@dataclass
class LayerRecord:
    """One tensor's last exchange, as sent by this rank."""

    elements: int
    zero_fraction: float    # of this rank's ternary vector
    scaler: float           # the (first) scaler used to ternarize
    payload_bytes: int


@dataclass
class Inspection:
    """Per-tensor figures for metrics (operations/metrics.py), off by default because they cost a pass
    over each tensor's codes: with ``track_layers`` a ``LayerRecord`` per tensor; for the names in
    ``capture`` the float, clipped, ternary·s and averaged tensors of the last exchange."""

    track_layers: bool = False
    capture: set = field(default_factory=set)
    layers: dict = field(default_factory=dict)     # name -> LayerRecord
    captures: dict = field(default_factory=dict)   # name -> [float, clipped, ternary·s, averaged]

    def wants(self, name: str) -> bool:
        return self.track_layers or name in self.capture

    def record(self, name: str, g32: torch.Tensor, threshold: torch.Tensor, payload: torch.Tensor,
               scalers: torch.Tensor, fmt: str, bucket_size: int) -> None:
        n = g32.numel()
        ternary = packing.unpack(payload[sizes.codes_offset(scalers.numel()):], n, fmt)
        zeros = float((ternary == 0).sum()) / n if n else 0.0
        self.layers[name] = LayerRecord(n, zeros, float(scalers.reshape(-1)[0]), payload.numel())
        if name in self.capture:
            s = expand_scalers(scalers, bucket_size, n)
            self.captures[name] = [g32.clone(), torch.clamp(g32, -threshold, threshold), ternary * s, None]

    def record_average(self, name: str, out: torch.Tensor) -> None:
        if name in self.captures and self.captures[name][3] is None:
            self.captures[name][3] = out.clone()

    def clear(self) -> None:
        self.layers.clear()
        self.captures.clear()
