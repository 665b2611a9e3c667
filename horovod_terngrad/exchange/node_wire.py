"""The node-aware exchange's intra-node wire (hierarchical.py, stages 1 and 3) and the buffers it reuses.

``intra_node_dtype="bfloat16"`` sends fp32 values rounded to bf16 (to nearest even) as their bytes: bytes, because
Horovod and gloo move uint8 everywhere and reduce nothing here.  The node sum adds the G local ranks' shards in
local-rank order, the same bits on every node and in the reference.

On the CPU the buffers each group sends are kept from one step to the next (:class:`BufferPool`): a fresh one costs
its page faults every step (tens of MB for an embedding), on the cores that compute.  On a GPU the caching allocator
makes a fresh bf16 buffer cheap, and keeping it would hold half the gradients' bytes through the forward pass.
"""
from __future__ import annotations

import torch


def to_wire(values: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values as the bytes of their bf16 rounding (to nearest even), for the intra-node collectives.
    ``into``: a bf16 buffer of as many elements to round into (the same rounding as ``.to``)."""
    if into is None:
        return values.to(torch.bfloat16).view(torch.uint8)
    return into.copy_(values).view(torch.uint8)


def wire_values(raw: torch.Tensor) -> torch.Tensor:
    """``to_wire``'s bytes as bf16 values, no copy; read into fp32 tensors, they widen exactly.  An odd byte count
    (ranks that disagree): NaN values, which the callers' size checks then report."""
    if raw.numel() % 2:
        return torch.full((raw.numel() // 2 + 1,), float("nan"), dtype=torch.float32, device=raw.device)
    return raw.view(torch.bfloat16)


def node_sum(parts: torch.Tensor, out: torch.Tensor, average: bool) -> None:
    """The G local ranks' shards ``parts`` ([G, shard], fp32 or the wire's bf16) added into ``out`` (fp32) in
    local-rank order, the same bits on every node and in the reference; / G when averaging.  bf16 parts are widened
    as they are read, so each addition is in fp32 without an fp32 copy of everything received
    (torch.add(bf16, bf16, out=fp32) would add in bf16)."""
    out.copy_(parts[0])
    for r in range(1, parts.shape[0]):
        out += parts[r]
    if average:
        out /= parts.shape[0]


def spare(pool: dict, key, numel: int, dtype, device) -> torch.Tensor:
    """The buffer ``pool`` kept under ``key`` from the last step, taken out of it, where it fits; else a fresh one."""
    kept = pool.pop(key, None)
    if kept is not None and kept.numel() == numel and kept.dtype == dtype and kept.device == device:
        return kept
    return torch.empty(numel, dtype=dtype, device=device)


class BufferPool:
    """Each group's send buffers of its last step, by group name: ``outboxes`` (the fp32 buffer the intra-node
    allgather sends: the shard, its noise estimate, the status words) and ``wires`` (the bf16 send buffers of the
    alltoall, "a2a", and of the allgather, "ag", keyed (group, stage)).  A group takes its buffers out while in
    flight and hands them back (:meth:`keep`) once both collectives that read them are complete."""

    def __init__(self):
        self.outboxes: dict = {}
        self.wires: dict = {}

    def outbox(self, group: str, numel: int, device) -> torch.Tensor:
        """An fp32 buffer of ``numel`` elements for ``group``'s allgather: last step's where it fits."""
        return spare(self.outboxes, group, numel, torch.float32, device)

    def wire(self, held: dict, group: str, stage: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` rounded to bf16 as bytes.  On the CPU, written into the buffer ``group``'s ``stage`` sent
        last step where it fits, which ``held`` (the group's own) then holds until :meth:`keep`; on a GPU a
        fresh one (see the module docstring)."""
        if values.device.type != "cpu":
            return to_wire(values)
        buf = held[stage] = spare(self.wires, (group, stage), values.numel(), torch.bfloat16, values.device)
        return to_wire(values, into=buf)

    def keep(self, group: str, outbox: torch.Tensor, held: dict) -> None:
        """``group``'s buffers back into the pool, for its next step."""
        self.outboxes[group] = outbox
        self.wires.update(((group, stage), buf) for stage, buf in held.items())

    def clear(self) -> None:
        self.outboxes, self.wires = {}, {}
