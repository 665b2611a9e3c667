"""On CUDA, on_nonfinite="propagate" (the default) adds no host synchronization: GradScaler keeps found_inf on
the device so that its overflow checks cost no sync, and TernGrad must not add one per tensor or group.

Checked with ``torch.cuda.set_sync_debug_mode("error")``, which turns every synchronizing call (``.item()``,
``bool(t)``, a device-to-host copy) into an error.  Needs a GPU: skipped on CPU, where the same functions
run in tests/test_exchange.py and tests/test_horovod.py (the propagate policy, its bits, every path).

What "raise" costs there is shown too: it must read whether a full-precision result is finite on the host,
one synchronization per tensor sent at full precision.
"""
import collections
import contextlib
import os
import threading
import traceback
import warnings

import pytest
import torch

from horovod_terngrad import NonFiniteGradientError, TernGradConfig
from horovod_terngrad.exchange import ExchangeStats, settle_full_precision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def same_bits(a, b):
    """Bit for bit (torch.equal says NaN != NaN, and a poisoned average is all NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@contextlib.contextmanager
def no_sync_allowed():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_full_precision_results_pass_through_without_a_sync():
    out = torch.randn(1000, device="cuda")
    out[7] = float("inf")
    with no_sync_allowed():
        got = settle_full_precision(out, "w", TernGradConfig(), ExchangeStats(), set())
    assert got is out and torch.isinf(got[7]).item()


def test_raise_reads_the_result_on_the_host_once():
    out = torch.randn(1000, device="cuda")
    out[7] = float("inf")
    with no_sync_allowed(), pytest.raises(RuntimeError, match="synchroniz"):
        settle_full_precision(out, "w", TernGradConfig(on_nonfinite="raise"), ExchangeStats(), set())
    with pytest.raises(NonFiniteGradientError):
        settle_full_precision(out, "w", TernGradConfig(on_nonfinite="raise"), ExchangeStats(), set())


def test_horovod_frontend_passthrough_adds_no_sync(monkeypatch):
    """decompress of a tensor Horovod allreduced at full precision (under min_numel): no sync under the default."""
    from horovod_terngrad.frontends.horovod import Passthrough, TernGradCompressor
    comp = TernGradCompressor()
    reduced = torch.full((100,), float("nan"), device="cuda", dtype=torch.float32)
    with no_sync_allowed():
        out = comp.decompress(reduced, Passthrough(torch.float16, "b", checked=True))
    assert out.dtype == torch.float16 and torch.isnan(out).all().item()


def test_a_poisoned_member_is_filled_on_the_device():
    """The result of a member flagged NaN/Inf (from host values the exchange read anyway: handshake or payload
    headers) is made on the device, without a sync."""
    from horovod_terngrad.exchange.engine import Engine, Ticket
    from horovod_terngrad.exchange.thread_collectives import ThreadWorld
    ex = Engine(ThreadWorld(1).ranks()[0], TernGradConfig())
    g = torch.randn(50, device="cuda")
    tk = Ticket(ex, "w", g.shape, g.dtype, g, None, None, 1, True, False)
    with no_sync_allowed():
        ex.nonfinite(tk, "w holds NaN")
        out = ex.finish(tk)
    assert torch.isnan(out).all().item() and ex.stats.nonfinite_propagated == 1


@pytest.mark.parametrize("poison", [False, True])
def test_fsdp_engine_decodes_without_a_sync(poison):
    """The FSDP frontend's engines (``layout_known``: payloads decoded at offsets known from this rank's own sizes,
    NaN/Inf flags combined on the device): a whole exchange, statistics, encode, allgather (two thread-ranks, the
    tensors on the GPU) and decode, runs under sync-debug "error".  Its CPU twin, bit for bit against the header
    walk: tests/test_exchange.py::test_known_layout_decodes_the_bits_the_header_walk_decodes."""
    from horovod_terngrad.exchange.engine import Engine
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    cfg = TernGradConfig(min_numel=0)
    grads = [torch.randn(3000, device="cuda", generator=torch.Generator("cuda").manual_seed(r)) for r in range(2)]
    if poison:
        grads[1][7] = float("nan")
    exchanges = {}

    def body(c):
        ex = exchanges[c.rank] = Engine(c, cfg, stream_rank=c.rank)
        ex.layout_known = True
        return ex.finish(ex.start(grads[c.rank].clone(), "w"))

    run_ranks(2, body)                       # warm-up: kernels compiled, first-use allocations made
    with no_sync_allowed():
        outs = run_ranks(2, body)
    assert same_bits(outs[0], outs[1])
    assert bool(torch.isnan(outs[0]).all()) == poison


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan"])
def test_reternarized_exchange_runs_without_a_sync(poison):
    """exchange="reternarized" with per-rank scalers (its default) on the GPU: statistics, encode, the alltoall of
    shard payloads, the owner's decode and second ternarization, the allgather and the decode of every owner's
    payload, NaN flags carried and combined on the device, under sync-debug "error" (engines as the DDP and FSDP
    frontends make them: no presence check).  Its CPU twin: tests/test_reternarized.py (bit for bit)."""
    from horovod_terngrad.exchange.engine import Engine
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    cfg = TernGradConfig(min_numel=0, exchange="reternarized")
    grads = [torch.randn(3000, device="cuda", generator=torch.Generator("cuda").manual_seed(r)) for r in range(3)]
    if poison:
        grads[1][2990] = float("nan")

    def body(c):
        ex = Engine(c, cfg, stream_rank=c.rank, joins=False)
        return ex.finish(ex.start(grads[c.rank].clone(), "w"))

    run_ranks(3, body)                       # warm-up: kernels compiled, first-use allocations made
    with no_sync_allowed():
        outs = run_ranks(3, body)
    assert same_bits(outs[0], outs[1]) and same_bits(outs[0], outs[2])
    assert bool(torch.isnan(outs[0]).all()) == poison


@pytest.mark.parametrize("refresh", [False, True], ids=["noise-corrected", "refresh-schedule"])
def test_terngrad_adamw_steps_without_a_sync(refresh):
    """horovod_terngrad.optim.AdamW on CUDA parameters, in both modes, with what an exchange hands over (its record,
    and in the default mode the noise estimate with each ternary average), and the ledger's decision for the next
    exchange: no host synchronization (its step counts live on the host, as in torch's non-capturable Adam).  The
    same steps run on CPU in tests/test_optim.py (by hand, and on DDP, Horovod and FSDP2 ranks)."""
    from horovod_terngrad.codec.schedule import RefreshSchedule
    from horovod_terngrad.exchange import precision
    from horovod_terngrad.optim import AdamW
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (5000, 300)]
    opt = AdamW(params, lr=1e-3, weight_decay=0.1, refresh=RefreshSchedule(warmup=1, interval=1000, max_interval=1000) if refresh else None)

    ledger = opt.precision_ledger

    def exchange():                          # what a frontend does: decide, record, hand over average (+ noise)
        verdicts = [precision.route([p], True) for p in params]
        for p, verdict in zip(params, verdicts):
            p.grad = torch.randn_like(p)
            if verdict.noise:
                ledger.put_noise(p, p.grad.abs() * 0.1, p.grad)

    for _ in range(2):                       # step 0 (a refresh where scheduled), then a ternary one: warm-up
        exchange()
        opt.step()
    with no_sync_allowed():
        for _ in range(3):
            exchange()
            opt.step()
    want_v = 1 if refresh else 5             # refresh mode: v only from the one full-precision step
    assert all(int(opt.state[p]["v_steps"]) == want_v and int(opt.state[p]["step"]) == 5 for p in params)
    if not refresh:
        assert all(bool(opt.state[p]["exp_avg_noise"].gt(0).any()) for p in params)   # the estimate was taken in


# -- every exchange the defaults pick, one sweep -----------------------------------------------------------------------

def sync_sites(fn):
    """Run ``fn()`` under sync-debug "warn" and return (its result, how often each place synchronized): a place is
    the innermost three frames in horovod_terngrad ("file:function:line < caller < ..."), so one run on a GPU names
    every site, not only the first."""
    sites, lock = collections.Counter(), threading.Lock()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if f"{os.sep}horovod_terngrad{os.sep}" in f.filename]
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.name}:{f.lineno}" for f in reversed(frames[-3:]))
        with lock:
            sites[where or f"{os.path.basename(filename)}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sites


def _flat(n_ranks, cfg, joins, layout_known):
    from horovod_terngrad.exchange.engine import Engine
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    shapes = [(3000,), (64, 33), (7,), (20011,)]
    grads = {(r, i): torch.randn(s, device="cuda", generator=torch.Generator("cuda").manual_seed(10 * r + i))
             for r in range(n_ranks) for i, s in enumerate(shapes)}

    def body(c):
        ex = Engine(c, cfg, stream_rank=c.rank, joins=joins)
        ex.layout_known = layout_known
        tickets = ex.start_group([(grads[c.rank, i].clone(), f"w{i}") for i in range(len(shapes))], "g0")
        for tk in tickets:
            tk.want_noise = True             # as horovod_terngrad.optim.AdamW asks
        return [ex.finish(tk) for tk in tickets], [tk.noise for tk in tickets]

    return lambda: run_ranks(n_ranks, body)


def _node_aware(per_node, nodes, cfg, ddp=False):
    from helpers import run_hier
    from horovod_terngrad.exchange import Engine
    from horovod_terngrad.exchange.hierarchical import HierarchicalEngine
    from horovod_terngrad.exchange.topology import Topology
    topo = Topology.contiguous(per_node * nodes, per_node)
    shapes = [(3000,), (64, 33), (20011,)]
    grads = {(r, i): torch.randn(s, device="cuda", generator=torch.Generator("cuda").manual_seed(10 * r + i))
             for r in range(topo.size) for i, s in enumerate(shapes)}

    def body(c, local, cross):
        ex = HierarchicalEngine(Engine(c, cfg, stream_rank=c.rank, joins=False), local, cross, topo)
        if ddp:                      # as the DDP frontend makes it (frontends/ddp.py, _node_aware)
            ex.flat.layout_known = ex.cross_engine.layout_known = True
        tickets = ex.start_group([(grads[c.rank, i].clone(), f"w{i}") for i in range(len(shapes))], "g0")
        return [ex.finish(tk) for tk in tickets]

    def run():
        results, errors = run_hier(topo, body)
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)
        return results
    return run


# (runner, {site allowed: at most this many times in the run}).  Designed reads on the host, once per fused group
# and rank: the allgather exchange's walk of the gathered headers on the Horovod and DDP engines (packing.walk,
# where the engine checks that ranks agree), and the node-aware exchange's status words (a peer's failure or
# disagreement must raise on every rank of the node).  FSDP2 (layout known) and the flat two-stage exchanges (the
# default above 4 ranks) read nothing on the host.  Each run below is one group, one step, on every rank.
WALK = "packing.py:walk:"
STATUSES = "hierarchical.py:_read_statuses:"
SWEEP = {
    "allgather, FSDP2 engine (layout known)": (lambda: _flat(2, TernGradConfig(min_numel=0), False, True), {}),
    "allgather, Horovod engine (presence check)": (lambda: _flat(2, TernGradConfig(min_numel=0), True, False),
                                                    {WALK: 2}),
    "allgather, DDP engine (layout known)": (lambda: _flat(4, TernGradConfig(min_numel=0), False, True), {}),
    "allgather, header walk (DDP with on_nonfinite='raise')": (
        lambda: _flat(4, TernGradConfig(min_numel=0), False, False), {WALK: 4}),
    "default above 4 (requantized), DDP engine": (lambda: _flat(6, TernGradConfig(min_numel=0), False, False),
                                                          {}),
    "default above 4 (requantized), Horovod engine": (lambda: _flat(6, TernGradConfig(min_numel=0), True,
                                                                           False), {}),
    "requantized": (lambda: _flat(3, TernGradConfig(min_numel=0, exchange="requantized"), False, False), {}),
    "node-aware 3 nodes x 2, re-ternarized across": (
        lambda: _node_aware(2, 3, TernGradConfig(min_numel=0, hierarchical=True, exchange="reternarized")),
        {STATUSES: 6}),
    "node-aware 6 nodes x 2, defaults": (
        lambda: _node_aware(2, 6, TernGradConfig(min_numel=0, hierarchical=True)), {STATUSES: 12}),
    "node-aware 2 nodes x 2 (allgather across), DDP engines": (
        lambda: _node_aware(2, 2, TernGradConfig(min_numel=0, hierarchical=True), ddp=True), {STATUSES: 4}),
    "node-aware 2 nodes x 2 (allgather across), Horovod engines": (
        lambda: _node_aware(2, 2, TernGradConfig(min_numel=0, hierarchical=True)), {STATUSES: 4, WALK: 4}),
}


@pytest.mark.parametrize("case", list(SWEEP))
def test_every_exchange_the_defaults_pick_synchronizes_only_where_designed(case):
    make, allowed = SWEEP[case]
    run = make()
    run()                                    # warm-up: kernels compiled, first-use allocations and constants made
    _, sites = sync_sites(run)
    counts = collections.Counter()
    unexpected = []
    for site, n in sites.items():
        a = next((a for a in allowed if site.startswith(a)), None)
        if a is None:
            unexpected.append(f"{site} ({n}x)")
        else:
            counts[a] += n
    assert not unexpected, f"{case}: synchronizing calls at " + "; ".join(unexpected)
    over = {a: n for a, n in counts.items() if n > allowed[a]}
    assert not over, f"{case}: designed reads more often than once per group and rank: {over}"
