"""On CUDA, on_nonfinite="propagate" (the default) adds no host synchronization: GradScaler keeps found_inf on
the device so that its overflow checks cost no sync, and TernGrad must not add one per tensor or group.

Checked with ``torch.cuda.set_sync_debug_mode("error")``, which turns every synchronizing call (``.item()``,
``bool(t)``, a device-to-host copy) into an error.  Needs a GPU: skipped on CPU, where the same functions
run in tests/test_exchange.py and tests/test_horovod.py (the propagate policy, its bits, every path).

What "raise" costs there is shown too: it must read whether a full-precision result is finite on the host,
one synchronization per tensor sent at full precision.
"""
import contextlib

import pytest
import torch

from horovod_terngrad import NonFiniteGradientError, TernGradConfig
from horovod_terngrad.exchange import ExchangeStats, settle_full_precision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    from horovod_terngrad.exchange.engine import Exchange, Ticket
    from horovod_terngrad.exchange.thread_collectives import ThreadWorld
    ex = Exchange(ThreadWorld(1).ranks()[0], TernGradConfig())
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
    from horovod_terngrad.exchange.engine import Exchange
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    cfg = TernGradConfig(min_numel=0)
    grads = [torch.randn(3000, device="cuda", generator=torch.Generator("cuda").manual_seed(r)) for r in range(2)]
    if poison:
        grads[1][7] = float("nan")
    exchanges = {}

    def body(c):
        ex = exchanges[c.rank] = Exchange(c, cfg, stream_rank=c.rank)
        ex.layout_known = True
        return ex.finish(ex.start(grads[c.rank].clone(), "w"))

    run_ranks(2, body)                       # warm-up: kernels compiled, first-use allocations made
    with no_sync_allowed():
        outs = run_ranks(2, body)
    assert torch.equal(outs[0], outs[1])
    assert bool(torch.isnan(outs[0]).all()) == poison


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan"])
def test_reternarized_exchange_runs_without_a_sync(poison):
    """exchange="reternarized" with per-rank scalers (its default) on the GPU: statistics, encode, the alltoall of
    shard payloads, the owner's decode and second ternarization, the allgather and the decode of every owner's
    payload, NaN flags carried and combined on the device, under sync-debug "error" (engines as the DDP and FSDP
    frontends make them: no presence check).  Its CPU twin: tests/test_reternarized.py (bit for bit)."""
    from horovod_terngrad.exchange.engine import Exchange
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    cfg = TernGradConfig(min_numel=0, exchange="reternarized")
    grads = [torch.randn(3000, device="cuda", generator=torch.Generator("cuda").manual_seed(r)) for r in range(3)]
    if poison:
        grads[1][2990] = float("nan")

    def body(c):
        ex = Exchange(c, cfg, stream_rank=c.rank, joins=False)
        return ex.finish(ex.start(grads[c.rank].clone(), "w"))

    run_ranks(3, body)                       # warm-up: kernels compiled, first-use allocations made
    with no_sync_allowed():
        outs = run_ranks(3, body)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert bool(torch.isnan(outs[0]).all()) == poison


def test_terngrad_adamw_steps_without_a_sync():
    """horovod_terngrad.optim.AdamW on CUDA parameters, on a refresh step, then ternary steps, and the ledger's
    decision for the next exchange: no host synchronization (its step counts live on the host, as in torch's
    non-capturable Adam).  On CPU the same update runs in tests/test_optim.py (by hand, and on DDP, Horovod and
    FSDP2 ranks)."""
    from horovod_terngrad.exchange import precision
    from horovod_terngrad.optim import AdamW
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (5000, 300)]
    opt = AdamW(params, lr=1e-3, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    precision.decide(*params)            # step 0: a refresh (the schedule's warm-up)
    opt.step()
    for p in params:
        precision._records[p] = precision.TERNARY
    opt.step()                            # warm up the kernels before the check
    with no_sync_allowed():
        for _ in range(3):
            for p in params:
                precision._records[p] = precision.TERNARY
            opt.step()
        assert precision.decide(*params) in (True, False)
    assert all(int(opt.state[p]["v_steps"]) == 1 and int(opt.state[p]["step"]) == 5 for p in params)
