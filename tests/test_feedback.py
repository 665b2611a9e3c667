"""Error feedback at the sender (exchange/feedback.py): what each rank's rounding leaves out comes back the next step."""
import pytest
import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad.exchange import feedback
from horovod_terngrad.exchange.engine import Engine
from horovod_terngrad.exchange.thread_collectives import run_ranks

N, STEPS, NUMEL = 3, 30, 5000


def gradient(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def train(c, cfg, grads=None):
    """Every step the same gradient per rank; returns (the sum of the averages, the final residual)."""
    eng = Engine(c, cfg)
    total = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(STEPS):
        g = gradient(c.rank) if grads is None else grads(c.rank, step)
        total += eng.finish(eng.start(g, "w")).double()
    return total, eng.residuals.get("w")


@pytest.mark.parametrize("exchange", ["allgather", "sharded"])
def test_rounding_errors_telescope_exactly_where_the_first_stage_is_decoded_exactly(exchange):
    """allgather and sharded decode the ranks' ternary values exactly: without clipping, the sum of T averages is
    T·mean(g) minus the mean of the last residuals, to float rounding: the accumulated update's error does not grow."""
    out = run_ranks(N, train, TernGradConfig(exchange=exchange, error_feedback=True, clip_factor=0))
    mean_g = sum(gradient(r).double() for r in range(N)) / N
    total, _ = out[0]
    residual_mean = sum(res.double() for _, res in out) / N
    assert torch.allclose(total, STEPS * mean_g - residual_mean, atol=1e-3, rtol=0)
    for t, _ in out[1:]:
        assert torch.equal(t, total)                                 # every rank the same average


@pytest.mark.parametrize("exchange", ["allgather", "requantized"])
def test_feedback_makes_the_accumulated_update_closer_to_the_gradients(exchange):
    mean_g = sum(gradient(r).double() for r in range(N)) / N
    err = {}
    for ef in (False, True):
        total, residual = run_ranks(N, train, TernGradConfig(exchange=exchange, error_feedback=ef, clip_factor=0))[0]
        err[ef] = float((total / STEPS - mean_g).norm() / mean_g.norm())
        assert (residual is not None) == ef
    assert err[True] < 0.5 * err[False], err


def test_the_residual_stays_within_half_a_scaler_and_clipping_is_not_carried():
    """With clipping on, a coordinate far above c·sigma every step does not pile its cut up in the residual:
    every element's residual is at most half the step's scaler, and sigma of x = g + e stays bounded."""
    def run(c):
        eng, peaks = Engine(c, TernGradConfig(error_feedback=True)), []
        for step in range(STEPS):
            g = gradient(c.rank)
            g[0] = 50.0
            tk = eng.start(g, "w")
            eng.finish(tk)
            peaks.append((float(eng.residuals["w"].abs().max()), float(tk.prep.scalers.max()),
                          float(tk.source.std())))
        return peaks

    for peaks in run_ranks(N, run):
        assert all(res <= s / 2 + 1e-6 for res, s, _ in peaks)
        assert max(sd for _, _, sd in peaks) < 3.0         # x = g + e: sigma(g) = 1.7 with the outlier


def test_a_nonfinite_step_zeroes_the_residual_and_the_next_steps_carry_on():
    def grads(rank, step):
        g = gradient(rank)
        if step == 5 and rank == 1:
            g[7] = float("nan")
        return g

    def run(c):
        eng = Engine(c, TernGradConfig(error_feedback=True, on_nonfinite="zero"))
        seen = []
        for step in range(8):
            out = eng.finish(eng.start(grads(c.rank, step), "w"))
            seen.append((bool(torch.isfinite(out).all()), float(eng.residuals["w"].abs().max())))
        return seen

    for rank, seen in enumerate(run_ranks(N, run)):
        assert all(finite for finite, _ in seen)
        if rank == 1:
            assert seen[5][1] == 0.0
        assert all(0 < peak < float("inf") for i, (_, peak) in enumerate(seen) if not (rank == 1 and i == 5))


def test_the_payload_is_the_codecs_own_header_scalers_and_codes():
    """Nearest rounding writes what the stochastic encoder writes, but for the codes: every backend decodes it."""
    from horovod_terngrad import backends, codec
    from horovod_terngrad.codec import packing, sizes
    g = gradient(0)
    be = backends.for_device(g.device)
    for bucket in (0, 128):
        prep = be.prepare(g, bucket, 2.5)
        stochastic = be.encode(g, prep.threshold, prep.scalers, bucket, codec.stream_key(0, 0, 1, 0), "base3",
                               shape=(50, 100))
        residuals = {}
        nearest = feedback.encode(residuals, "w", g, prep.threshold, prep.scalers, bucket, "base3", shape=(50, 100))
        head = sizes.codes_offset(prep.scalers.numel())
        assert torch.equal(nearest[:head], stochastic[:head]) and nearest.numel() == stochastic.numel()
        header = packing.Header("base3", 0, bucket if bucket else 0, NUMEL)
        decoded = be.decode(nearest, [header], [0], 1)
        assert torch.allclose(decoded + residuals["w"], torch.clamp(g, -prep.threshold, prep.threshold), atol=1e-6)


def test_with_residual_drops_a_residual_of_another_size():
    residuals = {"w": torch.ones(4)}
    flat = torch.zeros(5)
    assert feedback.with_residual(residuals, "w", flat) is flat and "w" not in residuals
    residuals["w"] = torch.ones(5)
    assert torch.equal(feedback.with_residual(residuals, "w", flat), torch.ones(5))


def test_config_refuses_a_non_bool():
    with pytest.raises(ValueError, match="error_feedback"):
        TernGradConfig(error_feedback="yes")
