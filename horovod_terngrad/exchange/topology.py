"""Which ranks share a node, learned from what every rank reports, and the hierarchical exchange's plan.

No torch at import (only :func:`discover` and :func:`encode_identity` use it): the runtime cost model (cost.py),
the performance model, the timeline and the simulator read the same plan the hierarchical transport
(hierarchical.py) runs.

Topology.  Every rank reports a host identity (:func:`host_identity`: its host name, or
``HOROVOD_TERNGRAD_HOST`` where names lie); one allgather (:func:`discover`) gives every rank the same list, so
every rank derives the same ``Topology``:

* nodes, in the order of their lowest global rank; a node's ranks in global rank order (its local ranks
  0..G-1), so placement need not be contiguous (``mpirun --map-by node`` interleaves ranks);
* local groups: the ranks of one node; cross groups: local rank j of every node, in node order.

The hierarchy applies only where every node has the same number G >= 2 of ranks and there are M >= 2
nodes; otherwise :meth:`Topology.flat_reason` says why and the exchange stays flat.

Plan of one fused group (:func:`shard_plan`).  The group's members (n_1..n_k elements, in member order)
are laid end to end and cut into G contiguous shards of near-equal size (the first ``total % G`` shards
one element longer); local rank j owns shard j.  A member that straddles a cut is split into pieces; each
piece is ternarized across nodes as a tensor of its own (its own layer-wise scaler and random stream).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of member ``member`` of a group, owned by one local rank."""

    member: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_bounds(total: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each of ``shards`` near-equal contiguous shards of ``total`` elements."""
    base, extra = divmod(int(total), int(shards))
    out, at = [], 0
    for j in range(shards):
        n = base + (1 if j < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def shard_plan(numels: Sequence[int], shards: int) -> list[list[Piece]]:
    """Per local rank (shard), the pieces of the members it owns, in member order (see module docstring)."""
    starts, at = [], 0
    for n in numels:
        starts.append(at)
        at += int(n)
    plan = []
    for lo, hi in shard_bounds(at, shards):
        pieces = []
        for i, (s, n) in enumerate(zip(starts, numels)):
            a, b = max(lo, s), min(hi, s + int(n))
            if a < b:
                pieces.append(Piece(i, a - s, b - s))
        plan.append(pieces)
    return plan


def intra_node_bytes(numels: Sequence[int], shards: int, width: int = 4) -> tuple[int, int]:
    """(c, P) of the intra-node stages for the slowest local rank: the bytes it sends each local peer in the
    reduce-scatter alltoall (that peer's shard), and the bytes it contributes to the allgather (its averaged
    shard plus one status word per piece), at ``width`` bytes per element (4: fp32, 2: bf16; the config's
    ``intra_node_width``).  The transport sends exactly these (without the noise estimate it may carry too)."""
    plan = shard_plan(numels, shards)
    c = width * max((sum(p.numel for p in pieces) for pieces in plan), default=0)
    P = max((width * (sum(p.numel for p in pieces) + len(pieces)) for pieces in plan), default=0)
    return c, P


def piece_name(name: str, piece: Piece, whole: int) -> str:
    """The name a piece travels under across nodes (its random stream's tensor id and its step counter):
    the member's own name when the piece is the whole member, else ``name[start:stop]``."""
    return name if piece.start == 0 and piece.stop == whole else f"{name}[{piece.start}:{piece.stop}]"


@dataclass(frozen=True)
class Topology:
    """Nodes as tuples of global ranks (see module docstring)."""

    nodes: tuple

    @classmethod
    def from_hosts(cls, hosts: Sequence[str]) -> "Topology":
        """From each global rank's host identity (index = rank)."""
        order: dict = {}
        for rank, host in enumerate(hosts):
            order.setdefault(host, []).append(rank)
        return cls(tuple(tuple(r) for r in order.values()))

    @classmethod
    def contiguous(cls, world: int, ranks_per_node: int) -> "Topology":
        """Ranks 0..G-1 on the first node, G..2G-1 on the next, ..."""
        return cls(tuple(tuple(range(s, min(s + ranks_per_node, world))) for s in range(0, world, ranks_per_node)))

    @property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        """G when every node has the same count, else 0."""
        counts = {len(n) for n in self.nodes}
        return counts.pop() if len(counts) == 1 else 0

    def flat_reason(self) -> str | None:
        """Why the hierarchy cannot apply (None: it can)."""
        counts = sorted({len(n) for n in self.nodes})
        if len(self.nodes) < 2:
            return f"all {self.size} ranks are on one node"
        if len(counts) > 1:
            return f"nodes have different rank counts ({', '.join(map(str, counts))})"
        if counts[0] < 2:
            return "every node has one rank"
        return None

    def single_node_or_rank(self) -> bool:
        """One node, or one rank per node: nothing for a node-aware exchange to be aware of (its fallback
        is expected, not worth a warning)."""
        return len(self.nodes) < 2 or all(len(n) == 1 for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is in no node of {self.nodes}")

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def local_groups(self) -> list[tuple]:
        """The ranks of each node (the intra-node groups), in node order."""
        return [tuple(n) for n in self.nodes]

    def cross_groups(self) -> list[tuple]:
        """Local rank j of every node, for j = 0..G-1 (the inter-node groups), each in ascending rank order
        (a rank's position in it is its rank in the group, as Horovod's process sets and
        torch.distributed's subgroups number their members)."""
        G = self.ranks_per_node
        return [tuple(sorted(n[j] for n in self.nodes)) for j in range(G)]

    def local_ranks_of(self, rank: int) -> tuple:
        return self.nodes[self.node_of(rank)]

    def cross_ranks_of(self, rank: int) -> tuple:
        return self.cross_groups()[self.local_rank(rank)]

    def describe(self) -> str:
        G = self.ranks_per_node
        shape = f"{self.num_nodes} nodes x {G} ranks" if G else f"{self.num_nodes} nodes"
        contiguous = all(list(n) == list(range(n[0], n[0] + len(n))) for n in self.nodes)
        return f"{shape}{'' if contiguous else ' (interleaved placement)'}: {list(map(list, self.nodes))}"


# -- topology from what every rank reports ------------------------------------------------------------
HOST_SLOTS = 64        # int32 words of a host identity in the topology allgather


def host_identity() -> str:
    """This rank's node: ``HOROVOD_TERNGRAD_HOST`` if set (where host names lie, or to emulate nodes), else
    the host name (the emulated cluster gives each network namespace its own, launch/netns-cluster.sh)."""
    import os
    import socket
    return os.environ.get("HOROVOD_TERNGRAD_HOST") or socket.gethostname()


def encode_identity(identity: str):
    """A fixed-size int32 tensor: the UTF-8 bytes (the tail of a long name replaced by its CRC-32)."""
    import zlib

    import torch
    raw = identity.encode()
    if len(raw) > HOST_SLOTS - 1:
        raw = raw[:HOST_SLOTS - 5] + zlib.crc32(raw).to_bytes(4, "little")
    return torch.tensor(list(raw) + [0] * (HOST_SLOTS - len(raw)), dtype=torch.int32)


def discover(coll, identity: str | None = None, name: str = "terngrad.topology") -> Topology:
    """Every rank's node, by one allgather of host identities on ``coll`` (a ``Collectives``; every rank gets the
    same list, so every rank derives the same topology)."""
    from .collectives import CollectiveError
    mine = encode_identity(host_identity() if identity is None else identity)
    try:
        every = coll.synchronize(coll.allgather_async(mine, name))
    except CollectiveError as e:
        raise e.detailed("TernGrad: learning which ranks share a node failed")
    hosts = [bytes(int(v) for v in row if int(v)).decode(errors="replace")
             for row in every.view(coll.size, HOST_SLOTS).tolist()]
    return Topology.from_hosts(hosts)
