"""horovod_terngrad.optim (Adam/AdamW with the second moment from full-precision refreshes only) and the refresh
schedule (codec/schedule.py) and ledger (exchange/precision.py) it rests on.

One process: bit for bit torch.optim.Adam/AdamW wherever TernGrad is not in use (flags, param groups, lr
schedulers, state_dict), the schedule's arithmetic, the update's math on a ternary step.  Real ranks
(tests/workers/optim_scenarios.py): DDP (2 ranks), Horovod (2 ranks, Gloo), FSDP2 (a (2, 2) mesh, 4
ranks): the exchange and the optimizer agree on every step, a refresh carries the exact fp32 average, parameters
sent at full precision take torch's update bit for bit, ranks (replicas) identical, accumulation, a GradScaler's
skipped steps, resume from a torch.load'ed checkpoint.
"""
import copy
import io
import os
import sys

import pytest
import torch

from support import forked_ranks
from test_ddp import load

from horovod_terngrad.codec.schedule import RefreshSchedule
from horovod_terngrad.exchange import precision
from horovod_terngrad.optim import Adam, AdamW

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "optim_scenarios.py")
sys.path.insert(0, os.path.dirname(WORKER))
import optim_scenarios as osc  # noqa: E402


# -- the schedule --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sched", [RefreshSchedule(), RefreshSchedule(warmup=0),
                                   RefreshSchedule(warmup=3, interval=2, per_phase=2, max_interval=8),
                                   RefreshSchedule(warmup=1, interval=5, per_phase=1, max_interval=5)])
def test_count_is_the_number_of_refreshes_among_the_first_n_exchanges(sched):
    marks = [sched.full_precision(k) for k in range(1200)]
    assert all(sched.count(n) == sum(marks[:n]) for n in range(1200))
    assert marks[0]                                   # the first exchange is always exact: v starts from it
    at = [k for k, m in enumerate(marks) if m]
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps == sorted(gaps) and max(gaps) == sched.max_interval      # spacing grows, then settles


def test_the_default_schedule_and_its_bits():
    s = RefreshSchedule()
    assert [k for k in range(40) if s.full_precision(k)] == [0, 1, 2, 3, 4, 5, 6, 7, 11, 15, 19, 23, 31, 39]
    assert s.bits_per_element(1000, 2.0) == pytest.approx((s.count(1000) * 32 + (1000 - s.count(1000)) * 2) / 1000)
    assert s.steady_bits_per_element(2.0) == pytest.approx(2.0 + 30 / s.max_interval)
    assert s.bits_per_element(10 ** 6, 2.0) == pytest.approx(s.steady_bits_per_element(2.0), abs=0.01)


@pytest.mark.parametrize("bad", [dict(warmup=-1), dict(interval=0), dict(max_interval=2, interval=4),
                                 dict(per_phase=1.5)])
def test_a_bad_schedule_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="RefreshSchedule"):
        RefreshSchedule(**bad)


# -- one process: torch's optimizer, bit for bit ---------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 3))


def _train(model, opt, steps=6, sched=None):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 10, generator=gen)).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("ours,theirs,kw", [
    (AdamW, torch.optim.AdamW, {}),
    (AdamW, torch.optim.AdamW, dict(foreach=False, amsgrad=True, weight_decay=0.3, maximize=True)),
    (AdamW, torch.optim.AdamW, dict(fused=True, betas=(0.8, 0.95), eps=1e-6)),
    (Adam, torch.optim.Adam, dict(weight_decay=0.1)),
    (Adam, torch.optim.Adam, dict(decoupled_weight_decay=True, weight_decay=0.1, foreach=True)),
])
def test_without_terngrad_it_is_torchs_optimizer_bit_for_bit(ours, theirs, kw):
    a, b = _model(), _model()
    groups = lambda m: [{"params": [m[0].weight, m[2].weight]},                       # noqa: E731
                        {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "lr": 3e-3, "weight_decay": 0.0}]
    oa, ob = theirs(groups(a), lr=1e-2, **kw), ours(groups(b), lr=1e-2, **kw)
    sa = torch.optim.lr_scheduler.OneCycleLR(oa, max_lr=2e-2, total_steps=20)
    sb = torch.optim.lr_scheduler.OneCycleLR(ob, max_lr=2e-2, total_steps=20)
    _train(a, oa, sched=sa)
    _train(b, ob, sched=sb)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # state_dict round trip through torch.save / torch.load(weights_only=True), then on in step
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    b2 = copy.deepcopy(b)
    ob2 = ours(groups(b2), lr=1e-2, **kw)
    ob2.load_state_dict(torch.load(buf, weights_only=True))
    _train(a, oa, steps=3)
    _train(b2, ob2, steps=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b2.parameters()))
    assert set(ob.state_dict()["param_groups"][0]) - set(oa.state_dict()["param_groups"][0]) == {"refresh", "v_floor"}


def test_the_signature_and_defaults_are_torchs():
    import inspect
    for ours, theirs in ((Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)):
        mine = inspect.signature(ours.__init__).parameters
        torch_params = inspect.signature(theirs.__init__).parameters
        assert list(mine)[:len(torch_params)] == list(torch_params) or set(torch_params) <= set(mine)
        for name, p in torch_params.items():
            assert mine[name].default == p.default, name
        assert list(mine)[-2:] == ["refresh", "v_floor"]


def test_a_ternary_step_updates_the_first_moment_only():
    """The ledger says 'ternary' for one parameter: m moves, v and its count do not; the update divides by
    v's refresh-count bias correction.  Recomputed here by hand."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = AdamW([w], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5, refresh=RefreshSchedule(warmup=1))
    w.grad = torch.tensor([0.5, 0.5, -1.0])
    opt.precision_ledger.set_record(w, precision.REFRESH)
    opt.step()                                       # torch's update (no ternary gradient yet)
    m, v = opt.state[w]["exp_avg"].clone(), opt.state[w]["exp_avg_sq"].clone()
    assert int(opt.state[w]["v_steps"]) == int(opt.state[w]["step"]) == 1     # v updated with m so far
    w0 = w.detach().clone()
    g = torch.tensor([0.25, 0.0, -0.25])
    w.grad = g.clone()
    opt.precision_ledger.set_record(w, precision.TERNARY)
    opt.step()
    st = opt.state[w]
    assert int(st["step"]) == 2 and int(st["v_steps"]) == 1
    assert torch.equal(st["exp_avg_sq"], v)
    m2 = m * 0.9 + 0.1 * g
    assert torch.allclose(st["exp_avg"], m2)
    expect = w0 * (1 - 0.1 * 0.5) - 0.1 * (m2 / (1 - 0.9 ** 2)) / ((v / (1 - 0.99)).sqrt() + 1e-8)
    assert torch.allclose(w.detach(), expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "foreach"])
@pytest.mark.parametrize("cls,amsgrad", [(AdamW, False), (AdamW, True), (Adam, False)])
def test_the_default_mode_divides_by_v_less_the_noise_floored_recomputed_by_hand(cls, amsgrad, fused, monkeypatch):
    """Default mode on ternary steps: n = β2·n + (1-β2)·ν·(|g|²/|average|² at the exchange), v as AdamW's, and the
    step divides by sqrt(max(v - n, v_floor·v) / (1 - β2^t)).  The gradient is scaled by 0.5 after the exchange (a
    norm clip), so the noise must come in at 0.25x; with Adam's L2 term the factor is taken from the gradient as
    it came, not from g + λ·w.  Written out here over three steps, one element's estimate all noise (the floor)."""
    from horovod_terngrad.optim import adam as adam_module
    monkeypatch.setattr(adam_module, "FUSED_CPU", fused)
    b1, b2, lr, wd, floor, eps = 0.9, 0.99, 0.1, 0.3, 0.1, 1e-8
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = cls([w], lr=lr, betas=(b1, b2), weight_decay=wd, amsgrad=amsgrad, v_floor=floor)
    assert opt.precision_ledger.wants_noise(w)                  # the default mode asks for the estimate
    ref = w.detach().clone()
    m, v, n, vmax = (torch.zeros(4) for _ in range(4))
    for t, (avg, nu) in enumerate([([0.5, -1.0, 0.25, 0.0], [0.1, 0.3, 0.05, 0.2]),
                                   ([0.4, 0.2, -0.5, 1.0], [0.2, 0.1, 0.4, 0.0]),
                                   ([-0.3, 0.6, 0.1, 0.0], [0.1, 0.5, 0.02, 9.0])], start=1):
        avg, nu = torch.tensor(avg), torch.tensor(nu)
        opt.precision_ledger.set_record(w, precision.TERNARY)
        opt.precision_ledger.put_noise(w, nu.clone(), avg)
        w.grad = avg * 0.5                                       # clipped after the exchange
        opt.step()
        g = avg * 0.5
        if cls is Adam:
            g_eff = g + wd * ref
        else:
            g_eff = g
            ref = ref * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g_eff
        v = b2 * v + (1 - b2) * g_eff * g_eff
        n = b2 * n + (1 - b2) * nu * 0.25
        v_hat = torch.maximum(v - n, floor * v)
        if amsgrad:
            vmax = torch.maximum(vmax, v_hat)
            v_hat = vmax
        ref = ref - lr * (m / (1 - b1 ** t)) / ((v_hat / (1 - b2 ** t)).sqrt() + eps)
        assert torch.allclose(opt.state[w]["exp_avg_noise"], n, rtol=1e-6, atol=0), t
        assert torch.allclose(opt.state[w]["exp_avg_sq"], v, rtol=1e-6, atol=0), t
        assert torch.allclose(w.detach(), ref, rtol=1e-6, atol=1e-7), (t, w.detach(), ref)
    assert float(n[3]) > float((1 - floor) * v[3])               # the floor was what bound element 3


@pytest.mark.parametrize("kw", [dict(), dict(amsgrad=True), dict(maximize=True, v_floor=0.01),
                                dict(weight_decay=0.0, v_floor=1.0)], ids=["plain", "amsgrad", "maximize-lowfloor",
                                                                          "floor1-nowd"])
def test_the_fused_cpu_pass_is_the_foreach_update(kw, monkeypatch):
    """The default mode on a CPU in fp32 takes one C pass per tensor (kernels/terngrad_cpu.c,
    tg_adam_corrected); the foreach ops (every other device and dtype) are the same update: 20 steps of GPT-2-like
    shapes (a norm clip after the exchange on some steps, no estimate on others), within fp32 rounding."""
    from horovod_terngrad.optim import adam as adam_module
    shapes = [(256, 128), (128,), (1000,), (64, 3, 5)]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(20)]
    noises = [[torch.rand(s, generator=gen) * 1e-4 for s in shapes] for _ in range(20)]
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(adam_module, "FUSED_CPU", fused)
        ws = [torch.nn.Parameter(torch.ones(s) * 0.5) for s in shapes]
        opt = AdamW(ws, lr=3e-3, betas=(0.9, 0.95), **kw)
        for k in range(20):
            for j, w in enumerate(ws):
                assert opt.precision_ledger.wants_noise(w)                  # the default mode asks for the estimate
                opt.precision_ledger.set_record(w, precision.TERNARY)
                if k % 5 != 4:                           # every fifth step comes without an estimate
                    opt.precision_ledger.put_noise(w, noises[k][j].clone(), grads[k][j])
                w.grad = grads[k][j] * (0.7 if k % 3 == 0 else 1.0)     # a clip after the exchange
            opt.step()
        out[fused] = ([w.detach().clone() for w in ws], [opt.state[w]["exp_avg_noise"].clone() for w in ws])
    for a, b in zip(out[True][0] + out[True][1], out[False][0] + out[False][1]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)
    assert not torch.equal(out[True][0][0], torch.ones(256, 128) * 0.5)


def test_fused_or_capturable_with_a_ternary_gradient_is_refused_with_a_reason():
    w = torch.nn.Parameter(torch.ones(4))
    opt = AdamW([w], fused=True)
    w.grad = torch.ones(4)
    opt.precision_ledger.set_record(w, precision.TERNARY)
    with pytest.raises(ValueError, match="fused=True is not supported.*shape \\(4,\\)"):
        opt.step()


def test_a_bad_refresh_argument_is_a_clear_error():
    with pytest.raises(TypeError, match="refresh must be a RefreshSchedule"):
        AdamW([torch.nn.Parameter(torch.ones(2))], refresh=64)


def test_the_ledger_decides_from_the_optimizers_own_step():
    w = torch.nn.Parameter(torch.ones(3))
    sched = RefreshSchedule(warmup=1, interval=2, per_phase=1, max_interval=2)   # refreshes at steps 0, 2, 4, ...
    opt = AdamW([w], refresh=sched)
    assert opt.precision_ledger.schedule_of(w) == sched
    seen = []
    for _ in range(6):
        verdict = precision.route([w], True)
        seen.append((verdict.ternary, opt.precision_ledger.record_of(w)))
        w.grad = torch.ones(3)
        opt.step()
    R, T = (False, precision.REFRESH), (True, precision.TERNARY)
    assert seen == [R, T, R, T, R, T]
    assert not precision.route([w], False).ternary and opt.precision_ledger.record_of(w) == precision.FULL
    assert precision.route([None], True).ternary            # a direct allreduce: no parameter, never refreshed
    other = torch.nn.Parameter(torch.ones(3))
    assert precision.route([other], True).ternary and precision.ledger_of(other) is None   # unclaimed: untouched


def test_each_optimizer_owns_its_ledger_and_the_last_to_claim_a_parameter_wins():
    """The ledger is the optimizer's, found from the parameter (ledger_of); a second optimizer over the same
    parameter takes it over, and the first one's ledger lets go; a copy or pickle of a parameter is nobody's;
    a parameter whose optimizer is gone is exchanged as if never claimed."""
    import gc
    import pickle
    w = torch.nn.Parameter(torch.ones(3))
    first = AdamW([w])
    assert precision.ledger_of(w) is first.precision_ledger and first.precision_ledger.wants_noise(w)
    second = AdamW([w], refresh=RefreshSchedule())
    assert precision.ledger_of(w) is second.precision_ledger
    assert not first.precision_ledger.holds(w) and first.precision_ledger.record_of(w) is None
    assert not precision.route([w], True).ternary                 # the second one's schedule: step 0 is a refresh
    assert second.precision_ledger.record_of(w) == precision.REFRESH
    assert precision.ledger_of(copy.deepcopy(w)) is None
    assert precision.ledger_of(pickle.loads(pickle.dumps(w))) is None
    with pytest.raises(ValueError, match="record must be one of"):
        second.precision_ledger.set_record(w, "half")
    with pytest.raises(KeyError, match="not claimed"):
        first.precision_ledger.set_record(w, precision.TERNARY)
    del second
    gc.collect()
    assert precision.ledger_of(w) is None and precision.route([w], True).ternary


@pytest.mark.parametrize("exchange", ["allgather", "reternarized"])
def test_exchanges_before_one_step_keep_each_parameters_own_estimate(exchange):
    """Two parameters whose gradients travel under one name (two models' "weight" through one engine) and a
    second, accumulating exchange of one of them, all before one optimizer step: each parameter's estimate is
    its own last exchange's, in the CPU buffer its ledger entry reuses, handed to the step once.  (An estimate
    held in a buffer of the engine keyed by tensor name is overwritten by the next exchange of that name.)"""
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, run_ranks
    cfg = TernGradConfig(exchange=exchange)
    n = 3000

    def grad(rank, k):
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * k + rank))

    def exchange_of(ex, param, g):
        tk = ex.start(g, "weight", route=precision.route([param], True))
        out = ex.finish(tk)
        assert tk.want_noise and tk.noise is not None
        made = tk.noise.clone()                 # what this exchange estimated, as it was delivered
        precision.deliver(tk, out)
        return made

    def body(c):
        ex = Engine(c, cfg)
        a, b = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
        opt = AdamW([a, b])
        ledger = opt.precision_ledger
        first_a = exchange_of(ex, a, grad(c.rank, 0))
        buffer = ledger.noise_of(a)[0].data_ptr()
        want_b = exchange_of(ex, b, grad(c.rank, 1))
        kept_a = torch.equal(ledger.noise_of(a)[0], first_a) and not torch.equal(first_a, want_b)
        want_a = exchange_of(ex, a, grad(c.rank, 2))          # accumulation: a's last exchange is the one kept
        got_a, got_b = ledger.noise_of(a)[0].clone(), ledger.noise_of(b)[0].clone()
        reused = ledger.noise_of(a)[0].data_ptr() == buffer
        a.grad, b.grad = torch.ones(n), torch.ones(n)
        ledger.set_record(a, precision.TERNARY)
        ledger.set_record(b, precision.TERNARY)
        opt.step()
        taken = ledger.noise_of(a) is None and ledger.noise_of(b) is None
        return kept_a, torch.equal(got_a, want_a), torch.equal(got_b, want_b), reused, taken

    for r, res in enumerate(run_ranks(2, body)):
        assert res == (True, True, True, True, True), (r, res)


# -- real ranks -------------------------------------------------------------------------------------------------------

def _agrees(steps, sched, ternarized, plain):
    """The exchange's record and the optimizer's counts agree with the schedule at every step."""
    for k, s in enumerate(steps):
        for name in ternarized:
            rec, step, _ = s["before"][name]
            assert rec == (precision.REFRESH if sched.full_precision(step) else precision.TERNARY), (k, name)
            _, step_after, v_after = s["after"][name]
            assert step_after == step + 1
            assert v_after == sched.count(step_after), (k, name)   # v counts the refreshes, never the rest
        for name in plain:
            _, step_after, v_after = s["after"][name]
            assert s["before"][name][0] == precision.FULL and v_after == step_after, (k, name)


# a test that uses one of these launches (module fixtures) is slow (conftest.py)
SLOW_FIXTURES = ("ddp_runs", "hvd_runs", "fsdp_runs")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_ddp")
    scenarios = ["train", "nosync", "twice", "amp", "resume", "plain", "corrected", "resume_corrected"]
    forked_ranks.run_scenarios("torch", 2, WORKER, [str(out), "ddp"] + scenarios, str(out))
    return {sc: load(out, sc) for sc in scenarios}


TERNARIZED = ["0.weight", "3.weight"]          # the MLP's weights of 5120 and 10240 elements
PLAIN = ["0.bias", "1.weight", "1.bias", "3.bias", "5.weight", "5.bias"]


@pytest.mark.parametrize("scenario", ["train", "nosync", "twice"])
def test_ddp_exchange_and_optimizer_agree_and_ranks_are_identical(ddp_runs, scenario):
    ranks = ddp_runs[scenario]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for r in ranks:
        _agrees(r["steps"], osc.SCHEDULE, TERNARIZED, PLAIN)
        assert all(s["shadow_equal"] for s in r["steps"])      # full-precision parameters: torch's AdamW, bit for bit
        assert sorted(r["small"]) == sorted(PLAIN)


def test_ddp_a_refresh_carries_the_exact_average_and_a_ternary_step_does_not(ddp_runs):
    for r in ddp_runs["train"]:
        kinds = set()
        for s in r["steps"]:
            for name in TERNARIZED:
                rec = s["before"][name][0]
                kinds.add(rec)
                assert s["refresh_exact"][name] == (rec == precision.REFRESH), name
            assert all(s["refresh_exact"][n] for n in PLAIN)
        assert kinds == {precision.REFRESH, precision.TERNARY}


def test_gradscaler_skips_the_steps_it_skips_without_compression_and_no_refresh_is_lost(ddp_runs):
    for r in ddp_runs["amp"]:
        assert r["tg"]["skipped"] == r["tgc"]["skipped"] == r["baseline"]["skipped"] == [3, 7]
        assert all(int(s["0.weight"][1]) == k + 1 - sum(1 for x in (3, 7) if x <= k)
                   for k, s in enumerate(r["tgc"]["snapshots"]))
        snaps = r["tg"]["snapshots"]
        for k, snap in enumerate(snaps):
            _, step, v_steps = snap["0.weight"]
            assert step == k + 1 - sum(1 for s in (3, 7) if s <= k)     # skipped steps do not count
            if v_steps is not None:
                assert v_steps == osc.SCHEDULE.count(step)              # a skipped refresh is taken next time
    assert ddp_runs["amp"][0]["tg"]["checksum"] == ddp_runs["amp"][1]["tg"]["checksum"]
    assert ddp_runs["amp"][0]["tgc"]["checksum"] == ddp_runs["amp"][1]["tgc"]["checksum"]


def test_ddp_resume_from_a_torch_load_checkpoint_is_bit_identical(ddp_runs):
    for r in ddp_runs["resume"]:
        assert r["resumed"] == r["straight"]
        assert r["refresh"] == {"warmup": 2, "interval": 2, "per_phase": 2, "max_interval": 4}


def test_ddp_default_mode_gets_the_exact_noise_estimate_with_every_ternary_average(ddp_runs):
    """The default (v corrected by the noise estimate): the estimate the DDP hook hands over equals
    (1/N^2)·Σ_r (s_r·t_r)^2 recomputed from every rank's gradient bit for bit, with the exact average and its
    squared norm; full-precision tensors get none and take torch's AdamW bit for bit; ranks identical."""
    ranks = ddp_runs["corrected"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for r in ranks:
        for s in r["steps"]:
            assert all(s["checks"].values()), s["checks"]
            assert s["shadow_equal"]
            for name in TERNARIZED:
                rec, step, v_steps = s["after"][name]
                assert rec == precision.TERNARY and v_steps == step          # v updated every step
        assert {n for n, nz in r["noise_nonzero"].items() if nz} == set(TERNARIZED)


def test_ddp_default_mode_resume_from_a_torch_load_checkpoint_is_bit_identical(ddp_runs):
    for r in ddp_runs["resume_corrected"]:
        assert r["resumed"] == r["straight"] and r["refresh"] is None


def test_ddp_without_a_hook_it_is_torch_adamw_bit_for_bit(ddp_runs):
    assert all(r["equal"] for r in ddp_runs["plain"])


@pytest.fixture(scope="module")
def hvd_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_hvd")
    scenarios = ["train", "bpps2", "none", "corrected"]
    forked_ranks.run_scenarios("horovod", 2, WORKER, [str(out), "horovod"] + scenarios, str(out))
    return {sc: load(out, sc) for sc in scenarios}


@pytest.mark.parametrize("scenario", ["train", "bpps2"])
def test_horovod_distributed_optimizer_with_synchronize_and_skip_synchronize(hvd_runs, scenario):
    ranks = hvd_runs[scenario]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for r in ranks:
        _agrees(r["steps"], osc.SCHEDULE, TERNARIZED, PLAIN)
        if scenario == "train":
            for s in r["steps"]:
                for name in TERNARIZED:
                    assert s["refresh_exact"][name] == (s["before"][name][0] == precision.REFRESH)


def test_horovod_default_mode_with_fusion_trains_identically_and_takes_the_noise_out(hvd_runs):
    ranks = hvd_runs["corrected"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for r in ranks:
        assert {n for n, nz in r["noise_nonzero"].items() if nz} == set(TERNARIZED)
        assert all(s["before"][n][0] == precision.TERNARY for s in r["steps"] for n in TERNARIZED)


def test_horovod_with_compression_none_it_is_torch_adamw_bit_for_bit(hvd_runs):
    for r in hvd_runs["none"]:
        assert r["twin_equal"]
        assert all(s["after"]["0.weight"][0] is None for s in r["steps"])     # nothing recorded


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_fsdp")
    forked_ranks.run_scenarios("torch", 4, WORKER, [str(out), "fsdp", "train", "resume", "corrected",
                                                    "resume_corrected"], str(out))
    return {sc: load(out, sc, nproc=4) for sc in ("train", "resume", "corrected", "resume_corrected")}


@pytest.mark.parametrize("scenario", ["resume", "resume_corrected"])
def test_fsdp2_resume_through_dcp_is_bit_identical(fsdp_runs, scenario):
    for r in fsdp_runs[scenario]:
        assert r["resumed"] == r["straight"]
        assert r["refresh"] == (None if scenario == "resume_corrected" else
                                {"warmup": 2, "interval": 2, "per_phase": 2, "max_interval": 4})


def test_fsdp2_default_mode_replicas_identical_and_the_noise_taken_out(fsdp_runs):
    ranks = fsdp_runs["corrected"]
    for shard in (0, 1):
        assert len({r["checksum"] for r in ranks if r["shard"] == shard}) == 1
    for r in ranks:
        assert {n for n, nz in r["noise_nonzero"].items() if nz} == set(TERNARIZED)


def test_fsdp2_dtensor_parameters_replicas_identical_and_agreeing(fsdp_runs):
    ranks = fsdp_runs["train"]
    for shard in (0, 1):
        codes = {r["checksum"] for r in ranks if r["shard"] == shard}
        assert len(codes) == 1, f"replicas of shard {shard} differ"
    for r in ranks:
        assert set(r["layout"].values()) == {"params"}
        # min_numel=2048 on the shards (half of each weight): the two weights ternarized, the rest full precision
        _agrees(r["steps"], osc.SCHEDULE, TERNARIZED, PLAIN)


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
@pytest.mark.parametrize("bucket", [0, 64])
def test_the_noise_estimate_is_the_sum_of_squared_ternary_values_on_every_backend(fmt, bucket):
    """exchange/allgather.noise_estimate (payloads with squared scalers and |t| codes through the backend's own
    decode) equals (1/N^2)·Σ_r (s_r·t_r)^2 written out, bit for bit, on the fused CPU path and the reference."""
    from horovod_terngrad import backends, codec
    from horovod_terngrad.exchange import allgather
    gen = torch.Generator().manual_seed(3)
    for n in (1, 7, 1000, 4099):
        N = 3
        ts = [torch.randint(-1, 2, (n,), dtype=torch.int8, generator=gen) for _ in range(N)]
        ss = [torch.rand(codec.sizes.num_buckets(n, bucket), generator=gen) + 0.1 for _ in range(N)]
        pays = [codec.packing.encode(t, fmt, s, bucket) for t, s in zip(ts, ss)]
        offsets = [sum(p.numel() for p in pays[:r]) for r in range(N)]
        headers = [codec.packing.parse_header(p) for p in pays]
        acc = None
        for t, s in zip(ts, ss):
            x = (t.float() * codec.expand_scalers(s, bucket, n)) ** 2
            acc = x if acc is None else acc + x
        for backend in (backends.for_device(torch.device("cpu")), backends.reference.ReferenceBackend()):
            orig = backends.for_device
            backends.for_device = lambda device, b=backend: b
            try:
                got = allgather.noise_estimate(torch.cat(pays), headers, offsets, N)
            finally:
                backends.for_device = orig
            assert torch.equal(got, acc / N ** 2), (fmt, bucket, n, type(backend).__name__)


class _WithoutNoiseDecode:
    """The fused CPU backend with no optional capability: noise_estimate takes its mapped-copies path."""

    capabilities = frozenset()

    def __init__(self, inner):
        self.inner = inner

    def decode(self, *args, **kwargs):
        return self.inner.decode(*args, **kwargs)


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
@pytest.mark.parametrize("bucket", [0, 64])
@pytest.mark.parametrize("shared", [False, True])
def test_the_fused_noise_decode_equals_the_mapped_copies_bit_for_bit(fmt, bucket, shared):
    """The fused CPU backend's decode_noise (one pass over the gathered payloads, NOISE_DECODE) gives the bits
    of the mapped-copies path (squared scalers, |t| codes, the backend's decode) for every byte a payload can
    hold, the invalid ones too (2-bit code 3, base-3 bytes >= 243), with equal scalers (the decode's shared
    path) and per-rank ones, for 1-4 payloads."""
    from horovod_terngrad import backends, codec
    from horovod_terngrad.exchange import allgather
    fused = backends.for_device(torch.device("cpu"))
    if not backends.has_capability(fused, backends.NOISE_DECODE):
        pytest.fail("the fused CPU backend should declare NOISE_DECODE")
    gen = torch.Generator().manual_seed(11)
    for N in (1, 2, 3, 4):
        for n in (1, 5, 1283, 6401):
            nb = codec.sizes.num_buckets(n, bucket)
            common = torch.rand(nb, generator=gen) + 0.1
            pays = []
            for _ in range(N):
                s = common if shared else torch.rand(nb, generator=gen) + 0.1
                p = codec.packing.encode(torch.zeros(n, dtype=torch.int8), fmt, s, bucket)
                start = codec.sizes.codes_offset(nb)
                p[start:] = torch.randint(0, 256, (p.numel() - start,), dtype=torch.uint8, generator=gen)
                pays.append(p)
            buf = torch.cat(pays)
            offsets = [sum(p.numel() for p in pays[:r]) for r in range(N)]
            headers = [codec.packing.parse_header(p) for p in pays]
            got = allgather.noise_estimate(buf, headers, offsets, N)
            orig = backends.for_device
            backends.for_device = lambda device: _WithoutNoiseDecode(fused)
            try:
                want = allgather.noise_estimate(buf, headers, offsets, N)
            finally:
                backends.for_device = orig
            assert torch.equal(got, want), (fmt, bucket, shared, N, n)
