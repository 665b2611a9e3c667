"""Benchmarks that print figures (run them; the numbers go in docs/, not in assertions).

    python -m horovod_terngrad.operations.bench codec [--numel 25000000] [--threads 1] [--bucket-size 512]
        GB/s of the codec stages on this machine, beside a preallocated copy of the same tensor.
    python -m horovod_terngrad.operations.bench engine [--tensors 64] [--numel 65536]
        The exchange engine's own cost per step on one rank (no network), fused and unfused.
    horovodrun --gloo -np 2 -H localhost:2 python -m horovod_terngrad.operations.bench step [--model resnet50]
        Step time of a model (an MLP with 2·layers tensors, ResNet-50, a transformer, 300 tiny tensors:
        operations/models.py) under fp32 / fp16 / TernGrad settings, and where TernGrad's time goes.
        With ``--link-counters eth0`` each configuration also records the bytes that crossed each host's
        eth0 per step (read on every host around its turns: examples/emulated_cluster_benchmark.py).
    OMP_NUM_THREADS=1 python -m horovod_terngrad.operations.bench compute [--model mlp]
        One process, no Horovod, one thread: the median time of a training step of the model (forward,
        backward, SGD step), as JSON: one rank's compute alone (the calibrated regime's yardstick).
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import socket
import time

import torch


def _timeit(fn, repeat=5):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def op_chain_ternarize(g: torch.Tensor, c: float = 2.5) -> torch.Tensor:
    """What existing TernGrad implementations do: a chain of separate torch ops (the baseline)."""
    sigma = g.std()
    clipped = g.clamp(-c * sigma, c * sigma)
    a = clipped.abs()
    s = a.max()
    r = torch.empty_like(g).uniform_()
    return (torch.sign(clipped) * (r < a / s)).to(torch.int8)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_bandwidth_gbs(device) -> float | None:
    try:
        import cupy
        p = cupy.cuda.runtime.getDeviceProperties(device.index or 0)
        return 2 * p["memoryClockRate"] * 1e3 * p["memoryBusWidth"] / 8 / 1e9
    except Exception:  # noqa: BLE001 - unknown: print without the percentage
        return None


def bench_codec(args):
    from .. import backends, codec
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n, bs = args.numel, args.bucket_size
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    gb = 4 * n / 1e9

    def timed(fn):
        def run():
            fn()
            _sync(device)
        return _timeit(run, args.repeat)

    dst = torch.empty_like(g)
    t_copy = timed(lambda: dst.copy_(g))
    peak = _peak_bandwidth_gbs(device) if device.type == "cuda" else None
    print(f"codec benchmark on {device} ({n} fp32 elements, "
          + (f"one scaler per {bs} elements" if bs else "one scaler (layer-wise)")
          + f", {args.threads} CPU thread(s)); copy into a "
          f"preallocated tensor: {gb / t_copy:.2f} GB/s" + (f"; device peak {peak:.0f} GB/s" if peak else ""))
    t_chain = timed(lambda: op_chain_ternarize(g))
    print(f"  baseline op chain (std, clamp, abs, max, uniform_, compare, sign, int8): {gb / t_chain:.2f} GB/s")
    chosen = backends.for_device(device)
    candidates = [(chosen.name, chosen)]
    if args.reference and chosen is not backends.REFERENCE:
        candidates.append(("torch-reference", backends.REFERENCE))
    for name, be in candidates:
        for fmt in ("2bit", "base3"):
            prep = be.prepare(g, bs, 2.5)
            key = codec.stream_key(0, 0, 0, 0)
            t_stats = timed(lambda: be.prepare(g, bs, 2.5))
            t_tern = timed(lambda: be.encode(g, prep.threshold, prep.scalers, bs, key, fmt))
            t_comp = t_stats + t_tern
            pct = f", {100 * gb / t_comp / peak:.0f}% of peak bandwidth" if peak else ""
            print(f"  {name:14s} {fmt:5s} compress {gb / t_comp:6.2f} GB/s of fp32 input "
                  f"(statistics {gb / t_stats:.2f}, ternarize+pack {gb / t_tern:.2f}); "
                  f"{t_chain / t_comp:.1f}x the op chain, {100 * t_copy / t_comp:.0f}% of copy{pct}")
            _bench_decode(be, f"{name:14s} {fmt:5s}", be.encode(g, prep.threshold, prep.scalers, bs, key, fmt),
                          timed, gb, t_copy, dst)
        _bench_four_level(be, name, g, bs, timed, gb, t_copy, dst)


def _bench_decode(be, label: str, payload: torch.Tensor, timed, gb: float, t_copy: float, dst) -> None:
    """The decode of N = 2 and 8 copies of ``payload`` into the preallocated ``dst``."""
    from ..codec import packing
    for N in (2, 8):
        gathered = torch.cat([payload] * N)
        headers, offsets = packing.walk(gathered, N)
        t_dec = timed(lambda: be.decode(gathered, headers, offsets, N, out=dst))
        print(f"  {label} decompress N={N}: {gb / t_dec:6.2f} GB/s of fp32 output into a "
              f"preallocated tensor ({100 * t_copy / t_dec:.0f}% of copy)")


def _bench_four_level(be, name: str, g: torch.Tensor, bs: int, timed, gb: float, t_copy: float, dst) -> None:
    """The four-level code (TernGradConfig(levels=4), codec/levels.py): encode as rank 3 of groups of 1 (independent
    dithers), 16 and 512 (the strata's draw and GF(2^k) map), and the decode of N payloads."""
    from .. import codec
    prep = be.prepare(g, bs, 2.5)
    own, shared = codec.stream_key(0, 0, 0, 3), codec.levels.strata_key(0, 0, 0)
    for group in (1, 16, 512):
        rank = min(3, group - 1)
        t_enc = timed(lambda: be.encode_levels(g, prep.threshold, prep.scalers, bs, own, shared, rank, group))
        print(f"  {name:14s} 4level encode, group of {group:3d}: {gb / t_enc:6.2f} GB/s of fp32 input "
              f"({100 * t_copy / t_enc:.0f}% of copy)")
    _bench_decode(be, f"{name:14s} 4level", be.encode_levels(g, prep.threshold, prep.scalers, bs, own, shared, 3, 16),
                  timed, gb, t_copy, dst)


STEP_CONFIGS = {
    "fp32": ("fp32 (Compression.none)", lambda hvd, T: hvd.Compression.none),
    "fp16": ("fp16 (Compression.fp16)", lambda hvd, T: hvd.Compression.fp16),
    "terngrad": ("TernGrad (defaults: per-rank scalers)", lambda hvd, T: T()),
    "terngrad-unfused": ("TernGrad, no fusion", lambda hvd, T: T(fusion_numel=0)),
    "terngrad-shared": ("TernGrad shared scaler (paper)", lambda hvd, T: T(shared_scaler=True)),
    "terngrad-all": ("TernGrad, every tensor (min_numel=0)", lambda hvd, T: T(min_numel=0)),
    "terngrad-sharded": ("TernGrad sharded exchange", lambda hvd, T: T(exchange="sharded")),
    "terngrad-reternarized": ("TernGrad re-ternarized exchange", lambda hvd, T: T(exchange="reternarized")),
    "terngrad-auto": ("TernGrad exchange=auto", lambda hvd, T: T(exchange="auto")),
    "terngrad-allgather": ("TernGrad allgather exchange", lambda hvd, T: T(exchange="allgather")),
    "terngrad-requantized": ("TernGrad requantized exchange", lambda hvd, T: T(exchange="requantized")),
    # the node-aware exchange forced on / off (the defaults' hierarchical="auto" decides by the cost model)
    "terngrad-hier": ("TernGrad hierarchical=True", lambda hvd, T: T(hierarchical=True)),
    "terngrad-flat": ("TernGrad hierarchical=False", lambda hvd, T: T(hierarchical=False)),
}


def step_config(key: str):
    """The TernGradConfig a TernGrad entry of STEP_CONFIGS runs with (None for fp32 and fp16): the entry's
    own settings, read by handing it TernGradConfig in place of the compressor class."""
    if key in ("fp32", "fp16"):
        return None
    from ..config import TernGradConfig
    return STEP_CONFIGS[key][1](None, TernGradConfig)


def _times_s(fn, repeat: int, warmup: int = 1) -> list:
    """Seconds of each of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeat):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


class Calibration:
    """What the performance model needs, measured where the job runs, every rank at once (one ``measure``
    call per round; ``result`` combines the rounds):
    the compute time of a step without any exchange (so with whatever sharing of cores the job has:
    the median on this rank, and the mean over steps of the slowest rank's time),
    the time of a 4-byte allreduce (the per-collective latency, Horovod's negotiation included),
    one large instance of each collective the exchanges use, at this model's sizes (fp32
    allreduce of all gradients, submitted at once one tensor per parameter as the step does, so Horovod
    fuses them as in the step; allgather of the TernGrad payloads; alltoall of the sharded chunks), and
    the codec's per-element rates (``codec_rates.measure_codec_rates``, median run, slowest rank).
    ``exchange.cost.calibrated_efficiency`` (also ``perfmodel.calibrated_efficiency``) turns the collective
    times into per-collective efficiencies."""

    def __init__(self, hvd, make_model, x, steps: int):
        from ..codec import sizes as wire
        from ..exchange import cost
        self.hvd, self.x, self.steps = hvd, x, steps
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        sizes = [p.numel() for p in self.model.parameters()]
        self.n, N = sum(sizes), hvd.size()
        # the gradients as the step hands them to Horovod: one tensor per parameter, fused by Horovod
        self.grads = [torch.randn(s) for s in sizes]
        # the sizes the model charges (codec/sizes.py, exchange/cost.py): every tensor's 2bit payload; the
        # sharded alltoall's bytes to each peer with every tensor sharded on its own (the slowest rank's)
        self.payload = torch.zeros(sum(wire.payload_size(s, "2bit") for s in sizes), dtype=torch.uint8)
        self.chunk = cost.sharded_bytes(sizes, N, "2bit")[0]
        self.chunks = torch.zeros(self.chunk * N, dtype=torch.uint8)
        self.splits = torch.tensor([self.chunk] * N, dtype=torch.int32)
        self.times = {"compute": [], "small": [], "allreduce": [], "allgather": [], "alltoall": []}
        self.slowest = []          # per compute step: the slowest rank's seconds
        self.codec = []            # per round: seconds per element of each codec stage, slowest rank
        self.rounds = 0

    def _compute_step(self):
        _train_step(self.model, self.opt, self.x)

    def _allreduce_all(self):
        handles = [self.hvd.allreduce_async(g, name=f"bench.cal.ar.{i}", op=self.hvd.Sum) for i, g in enumerate(self.grads)]
        for h in handles:
            self.hvd.synchronize(h)

    def measure(self):
        hvd, r = self.hvd, self.rounds
        self.rounds += 1
        hvd.allreduce(torch.zeros(1), name=f"bench.cal.barrier0.{r}")
        times = _times_s(self._compute_step, max(3, self.steps // 2), warmup=2 if r == 0 else 1)
        self.times["compute"] += times
        # a synchronous step waits for its slowest rank: per step, the slowest rank's time
        per_rank = hvd.allgather(torch.tensor([times], dtype=torch.float64), name=f"bench.cal.times.{r}")
        self.slowest += per_rank.max(dim=0).values.tolist()
        hvd.allreduce(torch.zeros(1), name=f"bench.cal.barrier1.{r}")
        tiny = torch.zeros(1)
        self.times["small"] += _times_s(lambda: hvd.allreduce(tiny, name="bench.cal.small", op=hvd.Sum), 9, warmup=2)
        self.times["allreduce"] += _times_s(self._allreduce_all, 3)
        self.times["allgather"] += _times_s(lambda: hvd.allgather(self.payload, name="bench.cal.ag"), 3)
        self.times["alltoall"] += _times_s(lambda: hvd.alltoall(self.chunks, splits=self.splits, name="bench.cal.a2a"), 3)
        # the codec's stages, every rank at once (as the job runs them); a step waits for the slowest rank
        from ..modelling.codec_rates import measure_codec_rates
        hvd.allreduce(torch.zeros(1), name=f"bench.cal.barrier2.{r}")
        rates = measure_codec_rates(numel=2_000_000, repeat=3, statistic="median")
        fields = list(rates.__dataclass_fields__)
        per_rank = hvd.allgather(torch.tensor([[getattr(rates, f) for f in fields]], dtype=torch.float64),
                                 name=f"bench.cal.codec.{r}")
        self.codec.append(dict(zip(fields, per_rank.max(dim=0).values.tolist())))

    def result(self) -> dict:
        med = {k: _median(v) for k, v in self.times.items()}
        return {"compute_ms": 1000 * med["compute"], "compute_slowest_ms": 1000 * sum(self.slowest) / len(self.slowest),
                "small_allreduce_ms": 1000 * med["small"], "allreduce": [4 * self.n, med["allreduce"]],
                "allgather": [self.payload.numel(), med["allgather"]], "alltoall": [self.chunk, med["alltoall"]],
                "codec_s_per_element": {k: _median([c[k] for c in self.codec]) for k in self.codec[0]},
                "rounds": self.rounds}


def _iface_bytes(iface: str) -> list:
    """[tx_bytes, rx_bytes] of a network interface of this process's network namespace."""
    base = f"/sys/class/net/{iface}/statistics/"
    return [int(open(base + k).read()) for k in ("tx_bytes", "rx_bytes")]


def link_bytes_per_host(hosts: list, deltas: list, steps: int) -> dict:
    """{host: [tx, rx] bytes per step} from every rank's host name and counter deltas (ranks of one host
    read the same interface: the first rank of each host is taken)."""
    out = {}
    for h, d in zip(hosts, deltas):
        out.setdefault(h, [v / max(1, steps) for v in d])
    return out


def bench_compute(args):
    """One rank's compute alone: no Horovod, one thread, the benchmark's own training step."""
    import json

    from . import models
    torch.set_num_threads(1)
    model, x = models.make(args.model, args.batch, layers=args.layers, width=args.width, image=args.image,
                           context=args.context)
    optimizer = torch.optim.AdamW if getattr(args, "optim", "sgd") == "adamw" else torch.optim.SGD
    opt = optimizer(model.parameters(), lr=1e-4)
    times = _times_s(lambda: _train_step(model, opt, x), args.steps, warmup=args.warmup)
    res = {"model": args.model, "batch": args.batch, "params": sum(p.numel() for p in model.parameters()),
           "threads": torch.get_num_threads(), "compute_ms": 1000 * _median(times),
           "times_ms": [1000 * t for t in times]}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _train_step(model, opt, x):
    """One step of the benchmark's training loop (the same in the calibration and every configuration)."""
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _median(values):
    return sorted(values)[len(values) // 2]


_COUNTERS = ("elements", "payload_bytes_sent", "handshake_bytes_sent", "bytes_received", "collectives",
             "handshake_wait_s", "gather_wait_s", "codec_s")


def _make_model(args):
    """(model, input batch) of the step benchmark's ``--model`` (operations/models.py)."""
    from . import models
    return models.make(args.model, args.batch, layers=args.layers, width=args.width, image=args.image,
                       context=args.context)


def _configurations(args, hvd, compressor, make_model) -> list:
    """One entry per configuration of ``--configs``: its compressor, its own model (Horovod's hooks stay on the
    parameters) and Horovod optimizer, and what its turns record (times, page faults, TernGrad's counters, link
    bytes)."""
    setups = []
    for key in args.configs.split(","):
        label, make = STEP_CONFIGS[key]
        comp = make(hvd, compressor)
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters(), compression=comp)
        setups.append({"key": key, "label": label, "comp": comp, "model": model, "opt": opt, "times": [],
                       "faults": [], "counters": dict.fromkeys(_COUNTERS, 0), "link": [0, 0], "link_steps": 0})
    return setups


def _one_step(su: dict, x, timed: bool = True) -> None:
    """One training step of configuration ``su``; a timed one records its time and the page faults it took."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    _train_step(su["model"], su["opt"], x)
    dt = time.perf_counter() - t
    if timed:
        su["times"].append(dt)
        su["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def _turn(hvd, su: dict, x, args, r: int, rounds: int, iface: str) -> None:
    """Configuration ``su``'s turn in round ``r``: ``--steps`` timed steps (after one untimed step when rounds
    interleave), TernGrad's counters over them, and the bytes through ``iface`` over the whole turn."""
    if iface:      # every rank has finished what came before: the window holds this turn's traffic
        hvd.allreduce(torch.zeros(1), name=f"bench.link0.{su['key']}.{r}")
        link0 = _iface_bytes(iface)
    if rounds > 1:
        _one_step(su, x, timed=False)        # one untimed step whenever a configuration takes its turn
    st = getattr(su["comp"], "stats", None)
    before = {k: getattr(st, k) for k in _COUNTERS} if st is not None else None
    for _ in range(args.steps):
        _one_step(su, x)
    if st is not None:
        for k in _COUNTERS:
            su["counters"][k] += getattr(st, k) - before[k]
    hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{su['key']}.{r}")
    if iface:
        su["link"] = [a + b - c for a, b, c in zip(su["link"], _iface_bytes(iface), link0)]
        su["link_steps"] += args.steps + (1 if rounds > 1 else 0)


def _run_rounds(hvd, setups: list, cal, x, args, rounds: int, iface: str) -> None:
    """The warm-up round, then ``rounds`` rounds in which the calibration and every configuration take turns."""
    # A warm-up round: every configuration runs its warm-up steps before any is timed (first touches of
    # memory, Horovod's response cache, the fusion plan), so that no timed round is special.
    for su in setups:
        for _ in range(args.warmup):
            _one_step(su, x, timed=False)
        hvd.allreduce(torch.zeros(1), name=f"bench.warm.{su['key']}")
    for r in range(rounds):
        if cal is not None:
            cal.measure()
        for su in setups:
            _turn(hvd, su, x, args, r, rounds, iface)


def _terngrad_figures(su: dict, k: int) -> dict:
    """A TernGrad configuration's figures per step (``k`` timed steps in all): the engine it ran, its settings,
    the link "auto" measured, and its codec time, waits, collectives and bits."""
    c = su["counters"]
    # the node-aware engine (exchange/hierarchical.py) took over where the topology and config allow
    row = {"node_aware": type(su["comp"].engine()).__name__ == "HierarchicalEngine",
           "terngrad_config": dataclasses.asdict(su["comp"].config)}
    link = su["comp"].engine().link      # exchange="auto": what it measured and decided
    if link is not None:
        row["link"] = {"gbps": 8 * link.allreduce_Bps / 1e9, "measured_gbps": 8 * link.measured_Bps / 1e9,
                       "codec_ns": 1e9 * link.codec_s_per_element,
                       "compresses": link.compresses, "says": link.describe()}
    row.update(codec_ms=1000 * c["codec_s"] / k, handshake_wait_ms=1000 * c["handshake_wait_s"] / k,
               payload_wait_ms=1000 * c["gather_wait_s"] / k,
               bits_per_element=8.0 * (c["payload_bytes_sent"] + c["handshake_bytes_sent"]) / max(1, c["elements"]),
               collectives_per_step=c["collectives"] / k, bytes_received_per_step=c["bytes_received"] / k,
               received_bits_per_element=8 * c["bytes_received"] / max(1, c["elements"]))
    return row


def _step_row(hvd, su: dict, args, rounds: int, iface: str) -> dict:
    """A configuration's row: its median step (overall and by round), page faults by round, the bytes through
    each host's link per step, and a TernGrad configuration's own figures."""
    row = {"config": su["key"], "label": su["label"], "step_ms": 1000 * _median(su["times"]),
           "step_ms_by_round": [1000 * _median(su["times"][i * args.steps:(i + 1) * args.steps])
                                for i in range(rounds)],
           # page faults (this process, all threads) per step, by round: first touches of fresh memory
           "page_faults_by_round": [_median(su["faults"][i * args.steps:(i + 1) * args.steps])
                                    for i in range(rounds)]}
    if iface:
        # bytes through each host's link per step (every step of the turns, the untimed ones too, and
        # the two 4-byte barriers around each turn); a host's ranks all read its one eth0
        hosts = hvd.allgather_object(socket.gethostname(), name=f"bench.link.hosts.{su['key']}")
        deltas = hvd.allgather_object(su["link"], name=f"bench.link.bytes.{su['key']}")
        row["link_bytes_per_step"] = link_bytes_per_host(hosts, deltas, su["link_steps"])
    if hasattr(su["comp"], "stats"):
        row.update(_terngrad_figures(su, args.steps * rounds))
    return row


def _print_step_rows(rows: list, described: str, args, ranks: int, rounds: int, ntensors: int) -> None:
    """Rank 0's table: every configuration's step against the first's, TernGrad's costs, and what fusion and the
    shared scaler's handshake cost where both of a pair ran."""
    print(f"step benchmark: {described}, batch {args.batch}, "
          f"{ranks} ranks, median of {args.steps} steps" + (f" x {rounds} interleaved rounds" if rounds > 1 else ""))
    base = rows[0]["step_ms"]
    for r in rows:
        extra = ""
        if "codec_ms" in r:
            extra = (f"{r['collectives_per_step']:.0f} collectives/step, codec {r['codec_ms']:.2f} ms, waiting for handshakes {r['handshake_wait_ms']:.2f} ms, "
                     f"for payloads {r['payload_wait_ms']:.2f} ms per step; {r['bits_per_element']:.3f} bits/element sent")
        if "link" in r:
            extra += f"; {r['link']['says']}"
        rounds_txt = f" rounds: {', '.join(f'{v:.0f}' for v in r['step_ms_by_round'])}" if rounds > 1 else ""
        print(f"  {r['label']:26s} {r['step_ms']:8.2f} ms/step ({r['step_ms'] / base:.2f}x {rows[0]['config']})  {extra}{rounds_txt}")
    by = {r["config"]: r["step_ms"] for r in rows}
    if "terngrad" in by and "terngrad-unfused" in by:
        print(f"  tensor fusion saves {by['terngrad-unfused'] - by['terngrad']:+.2f} ms/step "
              f"({by['terngrad-unfused'] / by['terngrad']:.2f}x) for {ntensors} tensors")
    if "terngrad" in by and "terngrad-shared" in by:
        print(f"  handshake cost (shared - per-rank scaler): {by['terngrad-shared'] - by['terngrad']:+.2f} ms/step "
              f"for {ntensors} tensors")


def bench_step(args):
    """Step time of each configuration.  With ``--rounds R`` the configurations (and the calibration)
    take turns: every round runs each of them for ``steps`` timed steps, and the figures are medians over
    all rounds, so a slow spell of a shared machine lands on all of them, not on whichever ran then.
    Every configuration keeps its own model (Horovod's hooks stay on the parameters), so memory is about
    (configurations + 2) x the model's parameters and gradients."""
    import json

    import horovod.torch as hvd

    from .. import TernGradCompressor
    hvd.init()
    torch.set_num_threads(1)

    from . import models

    def make_model():   # a fresh model per configuration: Horovod's hooks stay on the parameters
        return _make_model(args)[0]

    model, x = _make_model(args)
    sizes = [p.numel() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    ntensors, nparams = len(sizes), sum(sizes)
    described = f"{args.model} ({models.describe(model)})"
    del model
    rounds = max(1, getattr(args, "rounds", 1))
    cal = Calibration(hvd, make_model, x, args.steps) if args.calibrate else None
    setups = _configurations(args, hvd, TernGradCompressor, make_model)
    iface = getattr(args, "link_counters", "")
    _run_rounds(hvd, setups, cal, x, args, rounds, iface)
    calibration = cal.result() if cal is not None else None
    rows = [_step_row(hvd, su, args, rounds, iface) for su in setups]
    if hvd.rank() == 0:
        _print_step_rows(rows, described, args, hvd.size(), rounds, ntensors)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": hvd.size(), "model": args.model, "params": nparams, "tensors": ntensors,
                           "sizes": sizes, "names": names, "batch": args.batch, "image": args.image,
                           "context": args.context, "layers": args.layers, "width": args.width, "steps": args.steps,
                           "rounds": rounds, "rows": rows, "calibration": calibration}, f, indent=1)
    hvd.shutdown()


def bench_engine(args):
    """The engine's own cost per step on one rank (no network): ``--tensors`` gradients, every other one
    ``--numel`` elements and the rest 256 (weights and biases), exchanged as one fused group and each alone."""
    from ..config import TernGradConfig
    from ..exchange import Engine, ThreadWorld
    torch.set_num_threads(1)
    ex = Engine(ThreadWorld(1).ranks()[0], TernGradConfig())
    grads = [(torch.randn(args.numel if i % 2 == 0 else 256), f"t{i}") for i in range(args.tensors)]

    def step(fused):
        tickets = ex.start_group(grads, "g") if fused else [ex.start(g, n) for g, n in grads]
        for t in tickets:
            ex.finish(t)

    for fused in (True, False):
        best = _timeit(lambda: step(fused), args.repeat)
        print(f"engine, {args.tensors} tensors {'fused in one group' if fused else 'each alone'}: {1e3 * best:.2f} ms/step "
              f"(best of {args.repeat})")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m horovod_terngrad.operations.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("codec")
    c.add_argument("--numel", type=int, default=25_000_000)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--reference", action="store_true", help="also time the torch reference path")
    c.add_argument("--bucket-size", type=int, default=0, help="one scaler per this many elements (0: per tensor)")
    c.add_argument("--device", default="cpu", help="cpu or cuda")
    e = sub.add_parser("engine")
    e.add_argument("--tensors", type=int, default=64)
    e.add_argument("--numel", type=int, default=65536)
    e.add_argument("--repeat", type=int, default=15)
    s = sub.add_parser("step")
    s.add_argument("--model", default="mlp", help="mlp, resnet50, transformer or tiny (operations/models.py)")
    s.add_argument("--image", type=int, default=64, help="resnet50: input height and width")
    s.add_argument("--context", type=int, default=64, help="transformer: tokens per sample")
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--width", type=int, default=256)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--steps", type=int, default=30)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--rounds", type=int, default=1,
                   help="interleave: every round runs each configuration (and the calibration) for --steps steps")
    s.add_argument("--configs", default="fp32,fp16,terngrad,terngrad-unfused,terngrad-shared",
                   help="comma list of " + ",".join(STEP_CONFIGS))
    s.add_argument("--json", default="", help="rank 0 writes the figures here")
    s.add_argument("--calibrate", action="store_true",
                   help="first measure compute alone and one large allreduce/allgather/alltoall (for the perf model)")
    s.add_argument("--link-counters", default="", metavar="IFACE",
                   help="record the bytes through each host's IFACE (e.g. eth0) per step of each configuration")
    m = sub.add_parser("compute")
    m.add_argument("--model", default="mlp", help="mlp, resnet50, transformer, tiny or gpt2 (operations/models.py)")
    m.add_argument("--image", type=int, default=64, help="resnet50: input height and width")
    m.add_argument("--context", type=int, default=64, help="transformer: tokens per sample")
    m.add_argument("--layers", type=int, default=32)
    m.add_argument("--width", type=int, default=256)
    m.add_argument("--batch", type=int, default=32)
    m.add_argument("--steps", type=int, default=7)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--optim", default="sgd", choices=("sgd", "adamw"),
                   help="the step's optimizer: SGD (the benchmark's) or torch's AdamW, both lr 1e-4")
    m.add_argument("--json", default="")
    args = p.parse_args(argv)
    {"codec": bench_codec, "engine": bench_engine, "step": bench_step, "compute": bench_compute}[args.what](args)


if __name__ == "__main__":
    main()
