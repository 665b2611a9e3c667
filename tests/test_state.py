"""State in one object: a compressor's step counters, engines, fusion state and counters can be saved,
restored and reset as a whole, and a resumed run draws the random streams an uninterrupted run draws."""
import json

import pytest
import torch

from horovod_terngrad import TernGradCompressor, TernGradConfig
from horovod_terngrad.exchange import run_ranks
from horovod_terngrad.frontends.state import CompressorState, process_set_key


def _grads(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(300, generator=gen), "w"), (torch.randn(7, generator=gen), "b")]


def _steps(c, state, config, steps):
    eng = state.engine(None, config, lambda ps: c)
    outs = []
    for step in steps:
        tickets = eng.start_group(_grads(c.rank, step), "g")
        outs.append([eng.finish(t) for t in tickets])
    return outs


@pytest.mark.parametrize("N,exchange", [(2, "default"), (2, "requantized"), (5, "default")])
def test_a_resumed_state_continues_the_same_random_streams(N, exchange):
    """Also on the requantized exchange (the default beyond 4 ranks): its owners' second rounding draws from
    streams keyed by the same step counters."""
    cfg = TernGradConfig(seed=3, exchange=exchange)

    def body(c):
        straight = CompressorState()
        whole = _steps(c, straight, cfg, range(4))
        first = CompressorState()
        head = _steps(c, first, cfg, range(2))
        saved = json.loads(json.dumps(first.state_dict()))      # plain values: a checkpoint
        resumed = CompressorState()
        resumed.load_state_dict(saved)
        tail = _steps(c, resumed, cfg, range(2, 4))
        fresh = _steps(c, CompressorState(), cfg, range(2, 4))   # without the counters: other streams
        return whole, head + tail, fresh, saved, resumed.stats.tensors

    for whole, resumed, fresh, saved, tensors in run_ranks(N, body):
        assert all(torch.equal(a, b) for x, y in zip(whole, resumed) for a, b in zip(x, y))
        assert not all(torch.equal(a, b) for x, y in zip(whole[2:], fresh) for a, b in zip(x, y))
        assert saved["steps"] == {"global": {"w": 2, "b": 2}}
        assert tensors == 8                    # counters travel with the state too


def test_reset_forgets_everything_but_the_settings():
    comp = TernGradCompressor(seed=5, packing="base3")

    def body(c):
        st = comp.state if c.rank == 0 else CompressorState()
        _steps(c, st, comp.config, range(2))
        return None

    run_ranks(2, body)
    assert comp.state_dict()["steps"]["global"] == {"w": 2, "b": 2} and comp.stats.tensors == 4
    assert comp.engines()
    comp.reset()
    assert comp.engines() == [] and comp.stats.tensors == 0 and comp.state_dict()["steps"]["global"] == {}
    assert comp.config == TernGradConfig(seed=5, packing="base3")


def test_load_state_dict_refuses_another_version():
    st = CompressorState()
    bad = dict(st.state_dict(), version=99)
    try:
        st.load_state_dict(bad)
    except ValueError as e:
        assert "version 99" in str(e)
    else:
        raise AssertionError("a state of another version was accepted")


def test_process_set_keys_are_what_every_rank_agrees_on():
    class PS:
        process_set_id = 3
    assert process_set_key(None) == "global" and process_set_key(PS()) == "process_set.3"
