"""Allgather exchange: every rank receives every rank's packed ternary payload and decodes the mean.

Flow for one tensor of n elements on N ranks (shared scaler, the default):

1. ``start`` (called from the backward hook, never blocks on the network):
   one pass of statistics -> clip threshold c·σ and the local scaler(s); an asynchronous
   allreduce-max of a small fp64 *handshake* vector
       [bad_rank+1, -(bad_rank+1), n, -n, shape_code, -shape_code, dtype_code, -dtype_code, s_1..s_B]
   Max of x and of -x yields both max and min, so one reduction tells every rank whether all ranks
   agree on size/shape/dtype, which ranks saw NaN/Inf, and the shared scaler s = max_r s_r (Eq. 4).
   Handshakes of earlier tensors that have completed are turned into payload allgathers right away.
2. Payload: ternarize with the shared scaler, pack, ``allgather`` (uint8).  Horovod fuses concurrent
   handshakes and concurrent allgathers, so a model with L layers costs a few round trips, not 2L.
3. ``finish`` (from the optimizer's synchronize): turn every outstanding handshake into a payload
   allgather first (so none waits behind another), then wait for this tensor's allgather and decode
   (Σ_r s·t_r)/N.  Every rank decodes the same bytes in the same order, so all get identical bits.

With ``shared_scaler=False`` there is no handshake: the payload is sent from ``start`` and its header
carries the rank's scaler and NaN flag, checked by every rank after the allgather.

Tensor fusion (``start_group``): several tensors share one handshake and one allgather.  The group's
handshake is [c, -c, M, -M] (c: CRC-32 of the members' sizes, shapes and dtypes, so ranks that disagree
are caught), two NaN/Inf slots per member, then every member's scalers; its payload is the members'
payloads back to back.  A sharded group sends every member's shard r to rank r in one alltoall and
the owners' sums of every member in one allgather.  Each member's result is bit-identical to
exchanging it alone.

Cost per rank and tensor: sends 20 + 4B + n/4 bytes (2bit) or n/5 (base3), receives N-1 times that,
plus 8·(8+B) bytes of handshake alone, or 16 + 8B in a fused group (+32 per group).  Received traffic grows with N (see the sharded exchange for large N).
Errors (NaN/Inf, ranks that disagree) are decided from data every rank has, so every rank raises (or
zeroes) together and no collective is left waiting on a rank that gave up.
"""
from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field

import torch

from .. import backends, codec
from ..config import NonFiniteGradientError, RankMismatchError, TernGradConfig, TernGradError
from . import sharded
from .collectives import CollectiveError, Collectives

log = logging.getLogger("horovod_terngrad")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_HS_FIXED = 8


@dataclass
class ExchangeStats:
    """Counters of what this rank handed to and got from collectives (reset when you like)."""

    tensors: int = 0
    elements: int = 0
    payload_bytes_sent: int = 0
    handshake_bytes_sent: int = 0
    bytes_received: int = 0
    nonfinite_zeroed: int = 0
    collectives: int = 0          # handshakes, allgathers and alltoalls launched (fusion lowers it)
    handshake_wait_s: float = 0.0
    gather_wait_s: float = 0.0
    codec_s: float = 0.0
    # filled only while ``AllgatherExchange.track_layers`` is on (see horovod_terngrad/metrics.py):
    layers: dict = field(default_factory=dict)     # name -> LayerRecord of the last exchange
    captures: dict = field(default_factory=dict)   # name -> (float, clipped, ternary·s, averaged) tensors

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes_sent + self.handshake_bytes_sent

    def bits_per_element(self) -> float:
        return 8.0 * self.bytes_sent / self.elements if self.elements else 0.0

    def reset(self):
        self.__init__()


def check_gradient(tensor: torch.Tensor, name: str) -> None:
    """Reject what cannot be ternarized, naming the tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"TernGrad: '{name}' is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_sparse:
        raise TypeError(f"TernGrad: gradient '{name}' is sparse; use sparse_as_dense=True")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"TernGrad: gradient '{name}' has dtype {tensor.dtype}; ternary compression "
                        "needs a floating-point tensor (float16, bfloat16, float32 or float64)")


@dataclass
class LayerRecord:
    """One tensor's last exchange, as sent by this rank."""

    elements: int
    zero_fraction: float    # of this rank's ternary vector
    scaler: float           # the (first) scaler used to ternarize
    payload_bytes: int


@dataclass(eq=False)      # identity, not field-wise (tensor) comparison
class Ticket:
    """One tensor in flight."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    g32: torch.Tensor
    threshold: torch.Tensor
    key: tuple
    average: bool
    in_place: bool = False   # the average may be written into the input's memory (it is fp32 contiguous)
    owner: object = None   # the AllgatherExchange that started it
    mode: str = "allgather"  # or "sharded"
    shared: torch.Tensor | None = None   # the agreed scalers (sharded decode)
    group: "Group | None" = None   # the collectives it travels in (alone, or fused with others)
    nb: int = 1                    # number of scalers (handshake slots after the fixed ones)
    sent: bool = False             # its payload is in the group's allgather
    slot: int = 0                  # its position among the group's sent payloads
    payload_bytes: int = 0
    error: Exception | None = None
    zero: bool = False
    done: bool = False


@dataclass(eq=False)
class Group:
    """Tensors that share one handshake and one payload allgather: one tensor, or several small ones
    fused (``AllgatherExchange.start_group``).  Each member keeps its own statistics, clip threshold,
    scaler and random stream, and its payload (header included) is the one it would send alone; the
    group's payload is the members' payloads back to back.  So fusing changes how many collectives
    run, never a bit of any result."""

    name: str
    members: list
    hs: object = None
    a2a: object = None                          # sharded: the alltoall of the members' chunks
    a2a_own: int = 0                            # bytes of it addressed to this rank itself
    shard_members: list = field(default_factory=list)
    ag: object = None
    sent: list = field(default_factory=list)   # members whose payloads are in the allgather, in order
    bytes_sent: int = 0
    gathered: torch.Tensor | None = None
    walked: tuple | None = None
    gather_error: Exception | None = None

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


class AllgatherExchange:
    """Ternarize, allgather and average tensors over ``collectives`` (see module docstring)."""

    def __init__(self, collectives: Collectives, config: TernGradConfig | None = None,
                 stats: ExchangeStats | None = None):
        self.coll = collectives
        self.config = config or TernGradConfig()
        self.stats = stats if stats is not None else ExchangeStats()
        self._steps: dict[str, int] = {}
        self._pending: list[Group] = []         # waiting for their handshake
        self._pending_a2a: list[Group] = []     # sharded: waiting for their alltoall
        self._warned_nonfinite: set = set()
        self.track_layers = False          # record zero fraction and scaler per tensor (costs a pass over the codes)
        self.capture: set = set()          # tensor names whose float/clipped/ternary/averaged values to keep

    # -- public -------------------------------------------------------------------------------
    def start(self, tensor: torch.Tensor, name: str, average: bool = True, in_place: bool = False) -> Ticket:
        """Begin averaging ``tensor``.  With ``in_place`` the result may be written into ``tensor``
        itself (the Horovod frontend allows it: the gradient is replaced by the result anyway), which
        saves allocating and page-faulting a new buffer per step."""
        return self.start_group([(tensor, name)], name, average, in_place)[0]

    def start_group(self, items: list, group: str, average: bool = True, in_place: bool = False) -> list:
        """Begin averaging several tensors ``[(tensor, name), ...]`` with one handshake and one payload
        allgather named after ``group`` (tensor fusion; every rank must form the same groups, in the
        same member order).  Results are bit-identical to starting each tensor alone.  A fused group
        always uses the allgather exchange (fusion is for small tensors; sharding pays for large
        ones).  Returns one ticket per item, each finished with ``finish``."""
        cfg = self.config
        t0 = time.perf_counter()
        tickets, preps = [], []
        backend = backends.for_device(items[0][0].device) if items else None
        for tensor, name in items:
            check_gradient(tensor, name)
            step = self._steps.get(name, 0)
            self._steps[name] = step + 1
            g32 = tensor.detach().reshape(-1).to(torch.float32).contiguous()
            if g32.device != items[0][0].device:
                raise TernGradError(f"TernGrad: fused group '{group}' mixes devices ({g32.device} for '{name}')")
            prep = backend.prepare(g32, cfg.bucket_size, cfg.clip_factor)
            tickets.append(Ticket(
                name=name, shape=tensor.shape, dtype=tensor.dtype, g32=g32, threshold=prep.threshold,
                key=codec.stream_key(cfg.seed, step, codec.tensor_id(name), self.coll.rank), average=average,
                in_place=in_place and g32.data_ptr() == tensor.data_ptr() and tensor.dtype == torch.float32,
                owner=self, nb=prep.scalers.numel()))
            preps.append(prep)
        grp = Group(group, tickets)
        mode = self._mode([tk.g32.numel() for tk in tickets] if len(tickets) > 1 else tickets[0].g32.numel()) \
            if tickets else "allgather"
        for tk in tickets:
            tk.group, tk.mode = grp, mode
        if cfg.shared_scaler:
            hs = (self._handshake_vector(preps[0], items[0][0]) if len(items) == 1
                  else self._fused_handshake_vector(preps, [t for t, _ in items]))
            self.stats.codec_s += time.perf_counter() - t0
            grp.hs = self.coll.allreduce_max_async(hs, f"terngrad.hs.{group}")
            self.stats.collectives += 1
            self.stats.handshake_bytes_sent += hs.numel() * 8
            self._progress(block=False)   # earlier tensors whose handshake is back go out now
            self._pending.append(grp)
        else:
            sends = []
            for tk, prep, (tensor, _) in zip(tickets, preps, items):
                host_flag = isinstance(prep.nonfinite, bool)
                payload = backend.encode(
                    tk.g32, prep.threshold, prep.scalers, cfg.bucket_size, tk.key, cfg.packing,
                    flags=int(prep.nonfinite) if host_flag else 0, shape=tensor.shape)
                if not host_flag:
                    payload[3:4] = prep.nonfinite.to(torch.uint8).reshape(1)
                self._record_tensor(tk, payload, prep.scalers)
                sends.append((tk, payload))
            self.stats.codec_s += time.perf_counter() - t0
            self._send(grp, sends)
        return tickets

    def finish(self, tk: Ticket) -> torch.Tensor:
        try:
            self._progress(block=True)
            if tk.error is not None:
                raise tk.error
            out = self._receive(tk) if (tk.sent and not tk.zero) else None
            if out is None:   # agreed empty, or zeroed by on_nonfinite='zero'
                out = torch.zeros(tk.g32.numel(), dtype=torch.float32, device=tk.g32.device)
            if tk.name in self.stats.captures and self.stats.captures[tk.name][3] is None:
                self.stats.captures[tk.name][3] = out.clone()
            return out.view(tk.shape).to(tk.dtype)
        finally:
            tk.done = True

    def allreduce(self, tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
        return self.finish(self.start(tensor, name, average))

    def flush(self) -> None:
        """Send every payload whose handshake is outstanding (waiting for the handshakes).  ``finish``
        does this itself; a driver that plays several ranks from one thread calls it on every rank
        before finishing any (see simulate.py)."""
        self._progress(block=True)

    # -- internals ----------------------------------------------------------------------------
    def _handshake_vector(self, prep: codec.Prepared, tensor: torch.Tensor) -> torch.Tensor:
        n = float(prep.numel)
        sc = float(codec.packing.shape_code(tensor.shape))
        dc = float(_DTYPE_CODES[tensor.dtype])
        rank, size = self.coll.rank, self.coll.size
        if isinstance(prep.nonfinite, bool):          # host scalars: build it in one go
            bad = float(rank + 1) if prep.nonfinite else 0.0
            fixed = [bad, -bad if bad else -float(size + 1), n, -n, sc, -sc, dc, -dc]
            if prep.scalers.numel() == 1:
                return torch.tensor(fixed + [prep.scalers.item()], dtype=torch.float64)
            return torch.cat([torch.tensor(fixed, dtype=torch.float64), prep.scalers.to(torch.float64)])
        dev = prep.scalers.device                     # device scalars: no host synchronization
        fixed = torch.tensor([0.0, 0.0, n, -n, sc, -sc, dc, -dc], dtype=torch.float64, device=dev)
        bad = torch.where(prep.nonfinite, float(rank + 1), 0.0).to(torch.float64).reshape(1)
        fixed[0:1] = bad
        fixed[1:2] = torch.where(bad > 0, -bad, torch.full_like(bad, -float(size + 1)))
        return torch.cat([fixed, prep.scalers.to(torch.float64)])

    def _fused_handshake_vector(self, preps: list, tensors: list) -> torch.Tensor:
        """A fused group's handshake: [c, -c, M, -M] with c the CRC-32 of the members' (numel, shape,
        dtype) list, then two NaN/Inf slots per member (as in the single-tensor vector), then every
        member's scalers: 32 + 16 per member + 8 per scaler bytes instead of 72 per member."""
        layout = [(p.numel, codec.packing.shape_code(t.shape), _DTYPE_CODES[t.dtype]) for p, t in zip(preps, tensors)]
        c, m = float(zlib.crc32(repr(layout).encode())), float(len(tensors))
        rank, size = self.coll.rank, self.coll.size
        if all(isinstance(p.nonfinite, bool) for p in preps):
            flags = []
            for p in preps:
                bad = float(rank + 1) if p.nonfinite else 0.0
                flags += [bad, -bad if bad else -float(size + 1)]
            scalers = [v for p in preps for v in p.scalers.tolist()]
            return torch.tensor([c, -c, m, -m] + flags + scalers, dtype=torch.float64)
        dev = preps[0].scalers.device                 # device scalars: no host synchronization
        bad = torch.stack([torch.as_tensor(p.nonfinite, device=dev) for p in preps]).to(torch.float64) * (rank + 1)
        flags = torch.stack([bad, torch.where(bad > 0, -bad, torch.full_like(bad, -float(size + 1)))], 1).reshape(-1)
        return torch.cat([torch.tensor([c, -c, m, -m], dtype=torch.float64, device=dev), flags]
                         + [p.scalers.to(torch.float64) for p in preps])

    def _mode(self, n) -> str:
        ex = self.config.exchange
        if ex == "auto":
            from .choice import choose_exchange
            return choose_exchange(n, self.coll.size, self.config.packing)
        return ex

    def _progress(self, block: bool) -> None:
        """Turn completed (or, if block, all) handshakes into payload exchanges, then completed (or
        all) alltoalls of the sharded exchange into allgathers of the owners' sums, in start order."""
        self._pending = self._advance(self._pending, lambda grp: grp.hs, self._after_handshake, block)
        # (the first stage may have queued new alltoalls; they are advanced here too)
        self._pending_a2a = self._advance(self._pending_a2a, lambda grp: grp.a2a, self._after_alltoall, block)

    def _advance(self, queue: list, handle_of, step, block: bool) -> list:
        """Run ``step`` on the tickets whose collective completed (all, if block); return the rest."""
        waiting = []
        for tk in queue:
            if block or self.coll.poll(handle_of(tk)):
                step(tk)
            else:
                waiting.append(tk)
        return waiting

    def _after_handshake(self, grp: Group) -> None:
        t0 = time.perf_counter()
        try:
            v = self.coll.synchronize(grp.hs)
        except CollectiveError as e:
            for tk in grp.members:
                tk.error = RankMismatchError(
                    f"TernGrad: ranks disagree on gradient '{tk.name}' (shape {tuple(tk.shape)}, "
                    f"{tk.g32.numel()} elements on rank {self.coll.rank}"
                    + (f", fused in group '{grp.name}'" if grp.fused else "") + f"): {e}")
            return
        finally:
            self.stats.handshake_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        values = v.tolist()
        sends = []
        if not grp.fused:
            tk = grp.members[0]
            fixed = values[:_HS_FIXED]
            if fixed[2] != -fixed[3] or fixed[4] != -fixed[5] or fixed[6] != -fixed[7]:
                what = ("element counts range over [%d, %d]" % (-fixed[3], fixed[2]) if fixed[2] != -fixed[3]
                        else "shapes differ" if fixed[4] != -fixed[5] else "dtypes differ")
                tk.error = RankMismatchError(
                    f"TernGrad: ranks disagree on gradient '{tk.name}': {what} (this rank {self.coll.rank}: "
                    f"shape {tuple(tk.shape)}, dtype {tk.dtype})")
            else:
                payload = self._agreed(tk, fixed[0], -fixed[1], values[_HS_FIXED:])
                if payload is not None:
                    sends.append((tk, payload))
        elif values[0] != -values[1]:
            for tk in grp.members:
                tk.error = RankMismatchError(
                    f"TernGrad: ranks disagree on the gradients fused in group '{grp.name}' (sizes, shapes or "
                    f"dtypes differ), among them '{tk.name}' (this rank {self.coll.rank}: shape {tuple(tk.shape)}, "
                    f"dtype {tk.dtype})")
        else:
            m = len(grp.members)
            pos = 4 + 2 * m
            for j, tk in enumerate(grp.members):
                payload = self._agreed(tk, values[4 + 2 * j], -values[5 + 2 * j], values[pos:pos + tk.nb])
                pos += tk.nb
                if payload is not None:
                    sends.append((tk, payload))
        self.stats.codec_s += time.perf_counter() - t0
        if not sends:
            return
        if grp.members[0].mode == "sharded":
            self._send_shards(grp, sends)
        else:
            self._send(grp, sends)

    def _agreed(self, tk: Ticket, bad_hi: float, bad_lo: float, scalers: list) -> torch.Tensor | None:
        """One tensor's part of the reduced handshake (ranks agree on its size): its payload, if sent."""
        bad_hi, bad_lo = int(bad_hi), int(bad_lo)
        if bad_hi > 0:
            msg = (f"TernGrad: gradient '{tk.name}' (shape {tuple(tk.shape)}) contains NaN or Inf on "
                   f"rank {bad_lo - 1}" + (f" (and up to rank {bad_hi - 1})" if bad_hi != bad_lo else ""))
            self._nonfinite(tk, msg)
            return None
        if tk.g32.numel() == 0:
            tk.zero = True   # agreed empty: nothing to send, the result is the empty tensor
            return None
        cfg = self.config
        shared = torch.tensor(scalers, dtype=torch.float32, device=tk.g32.device)
        tk.shared = shared
        payload = backends.for_device(tk.g32.device).encode(
            tk.g32, tk.threshold, shared, cfg.bucket_size, tk.key, cfg.packing, shape=tk.shape)
        self._record_tensor(tk, payload, shared)
        return payload

    def _send_shards(self, grp: Group, sends: list) -> None:
        """Alltoall: to rank r, shard r of every member's packed codes (members in order)."""
        N, fmt = self.coll.size, self.config.packing
        to_rank = [[] for _ in range(N)]
        for tk, payload in sends:
            codes = payload[codec.HEADER_BYTES + 4 * tk.nb:]
            for r, (lo, hi) in enumerate(sharded.shard_bounds(tk.g32.numel(), N)):
                b0, b1 = sharded.code_byte_range(lo, hi, fmt)
                to_rank[r].append(codes[b0:b1])
        splits = [sum(c.numel() for c in chunks) for chunks in to_rank]
        data = (sends[0][1][codec.HEADER_BYTES + 4 * sends[0][0].nb:] if len(sends) == 1
                else torch.cat([c for chunks in to_rank for c in chunks]))
        grp.shard_members = [tk for tk, _ in sends]
        grp.a2a_own = splits[self.coll.rank]
        self.stats.payload_bytes_sent += data.numel()
        grp.a2a = self.coll.alltoall_async(data, splits, f"terngrad.a2a.{grp.name}")
        self.stats.collectives += 1
        self._pending_a2a.append(grp)

    def _after_alltoall(self, grp: Group) -> None:
        """Owner step: per member, add the N chunks of this rank's shard; allgather all members' sums."""
        t0 = time.perf_counter()
        try:
            received = self.coll.synchronize(grp.a2a)
        except CollectiveError as e:
            for tk in grp.shard_members:
                tk.error = RankMismatchError(f"TernGrad: sharded exchange of '{tk.name}' failed: {e}")
            return
        finally:
            self.stats.gather_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        N, me, fmt = self.coll.size, self.coll.rank, self.config.packing
        self.stats.bytes_received += received.numel() - grp.a2a_own
        members = grp.shard_members
        bounds = [sharded.shard_bounds(tk.g32.numel(), N)[me] for tk in members]
        sizes = [b1 - b0 for b0, b1 in (sharded.code_byte_range(lo, hi, fmt) for lo, hi in bounds)]
        block = sum(sizes)
        if received.numel() != N * block:
            err = RankMismatchError(f"TernGrad: sharded exchange of group '{grp.name}': received "
                                    f"{received.numel()} bytes, expected {N}x{block}")
            for tk in members:
                tk.error = err
            return
        sums, pre = [], 0
        for tk, (lo, hi), size in zip(members, bounds, sizes):
            mine = received if len(members) == 1 else \
                torch.cat([received[s * block + pre:s * block + pre + size] for s in range(N)])
            sums.append(sharded.owner_sums(mine, N, lo, hi, fmt))
            tk.payload_bytes = sums[-1].numel()
            pre += size
        self.stats.codec_s += time.perf_counter() - t0
        data = sums[0] if len(sums) == 1 else torch.cat(sums)
        self._launch_allgather(grp, members, data, f"terngrad.sg.{grp.name}")

    def _nonfinite(self, tk: Ticket, msg: str) -> None:
        if self.config.on_nonfinite == "raise":
            tk.error = NonFiniteGradientError(msg)
        else:
            tk.zero = True
            self.stats.nonfinite_zeroed += 1
            if tk.name not in self._warned_nonfinite:
                self._warned_nonfinite.add(tk.name)
                log.warning("%s; its averaged gradient is set to zero on every rank this step "
                            "(on_nonfinite='zero'; warned once per tensor)", msg)

    def _record_tensor(self, tk: Ticket, payload: torch.Tensor, scalers: torch.Tensor) -> None:
        self.stats.tensors += 1
        self.stats.elements += tk.g32.numel()
        if self.track_layers or tk.name in self.capture:
            n = tk.g32.numel()
            codes = payload[codec.HEADER_BYTES + 4 * scalers.numel():]
            ternary = codec.unpack(codes, n, self.config.packing)
            zeros = float((ternary == 0).sum()) / n if n else 0.0
            self.stats.layers[tk.name] = LayerRecord(n, zeros, float(scalers.reshape(-1)[0]), payload.numel())
            if tk.name in self.capture:
                s = scalers if scalers.numel() == 1 else scalers.repeat_interleave(self.config.bucket_size)[:n]
                thr = tk.threshold if isinstance(tk.threshold, torch.Tensor) else torch.tensor(tk.threshold)
                self.stats.captures[tk.name] = [tk.g32.clone(), torch.clamp(tk.g32, -thr, thr), ternary * s, None]

    def _send(self, grp: Group, sends: list) -> None:
        for tk, payload in sends:
            tk.payload_bytes = payload.numel()
        data = sends[0][1] if len(sends) == 1 else torch.cat([p for _, p in sends])
        self._launch_allgather(grp, [tk for tk, _ in sends], data, f"terngrad.ag.{grp.name}")

    def _launch_allgather(self, grp: Group, members: list, data: torch.Tensor, name: str) -> None:
        for j, tk in enumerate(members):
            tk.sent, tk.slot = True, j
        grp.sent = members
        grp.bytes_sent = data.numel()
        self.stats.payload_bytes_sent += data.numel()
        grp.ag = self.coll.allgather_async(data, name)
        self.stats.collectives += 1

    def _gathered(self, tk: Ticket) -> torch.Tensor:
        """The group's allgather result (waited for once, by whichever member finishes first)."""
        grp = tk.group
        if grp.gathered is None and grp.gather_error is None:
            t0 = time.perf_counter()
            try:
                grp.gathered = self.coll.synchronize(grp.ag)
                self.stats.bytes_received += grp.gathered.numel() - grp.bytes_sent
            except CollectiveError as e:
                grp.gather_error = e
            finally:
                self.stats.gather_wait_s += time.perf_counter() - t0
        if grp.gather_error is not None:
            raise RankMismatchError(f"TernGrad: exchange of gradient '{tk.name}'"
                                    + (f" (fused in group '{grp.name}')" if grp.fused else "")
                                    + f" failed: {grp.gather_error}") from grp.gather_error
        return grp.gathered

    def _member_sums(self, grp: Group, tk: Ticket, gathered: torch.Tensor) -> torch.Tensor:
        """One member's packed sums, every owner's in rank order, out of a sharded group's allgather
        (rank r's block holds the sums of shard r of every member, in member order)."""
        N, L = self.coll.size, sharded.sum_bits(self.coll.size)
        nbytes = [[-(-(hi - lo) * L // 8) for lo, hi in sharded.shard_bounds(m.g32.numel(), N)] for m in grp.sent]
        parts, off = [], 0
        for r in range(N):
            for j, m in enumerate(grp.sent):
                if m is tk:
                    parts.append(gathered[off:off + nbytes[j][r]])
                off += nbytes[j][r]
        if off != gathered.numel():
            raise RankMismatchError(f"TernGrad: sharded exchange of group '{grp.name}': gathered "
                                    f"{gathered.numel()} bytes of sums, expected {off}")
        return torch.cat(parts)

    def _receive(self, tk: Ticket) -> torch.Tensor | None:
        gathered = self._gathered(tk)
        t0 = time.perf_counter()
        grp = tk.group
        if tk.mode == "sharded":
            # (float(k)·s)/N: the allgather exchange's decode for a shared scaler, so the same bits
            mine = gathered if len(grp.sent) == 1 else self._member_sums(grp, tk, gathered)
            out = sharded.decode_gathered(mine, tk.g32.numel(), self.coll.size, tk.shared,
                                          self.config.bucket_size, self.coll.size if tk.average else 1,
                                          out=tk.g32 if tk.in_place else None)
            self.stats.codec_s += time.perf_counter() - t0
            return out
        m = len(grp.sent)
        if grp.walked is None:
            try:
                grp.walked = codec.packing.walk(gathered, self.coll.size * m, f"gathered payloads of '{grp.name}'",
                                                period=[t.payload_bytes for t in grp.sent])
            except codec.PayloadError as e:
                raise TernGradError(f"TernGrad: {e}") from e
        headers, offsets = grp.walked[0][tk.slot::m], grp.walked[1][tk.slot::m]
        if any(h.numel != tk.g32.numel() for h in headers):
            raise RankMismatchError(
                f"TernGrad: ranks disagree on gradient '{tk.name}': element counts "
                f"{[h.numel for h in headers]} by rank")
        if len({h.shape_code for h in headers}) != 1:
            raise RankMismatchError(
                f"TernGrad: ranks disagree on gradient '{tk.name}': shapes differ (this rank "
                f"{self.coll.rank}: {tuple(tk.shape)})")
        if len({(h.fmt, h.bucket_size) for h in headers}) != 1:
            raise RankMismatchError(f"TernGrad: ranks use different packing or bucket settings for '{tk.name}': "
                                    f"{[(h.fmt, h.bucket_size) for h in headers]}")
        bad = [r for r, h in enumerate(headers) if h.flags & codec.packing.FLAG_NONFINITE]
        if bad:
            self._nonfinite(tk, f"TernGrad: gradient '{tk.name}' (shape {tuple(tk.shape)}) contains "
                                f"NaN or Inf on rank(s) {bad}")
            if tk.error is not None:
                raise tk.error
            return None
        out = backends.for_device(gathered.device).decode(gathered, headers, offsets,
                                                          len(headers) if tk.average else 1,
                                                          out=tk.g32 if tk.in_place else None)
        self.stats.codec_s += time.perf_counter() - t0
        return out
