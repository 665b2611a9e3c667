"""The senders' squares (codec/squares.py): the defined summation order, the trailer on the wire, and the
estimate they correct: after the correction the noise estimate's total is the ternary rounding's variance, no
longer that plus the ranks' own squares."""
import pytest
import torch

from horovod_terngrad import codec as C
from horovod_terngrad.codec import packing, sizes, squares
from horovod_terngrad.exchange import allgather

from helpers import minibatch_share_out, ordered_sum


@pytest.mark.parametrize("m", [1, 7, 2047, 2048, 2049, 5000, 70000])
@pytest.mark.parametrize("rows", [1, 3])
def test_row_sums_follow_the_defined_order_bit_for_bit(m, rows):
    x = torch.randn(rows, m, generator=torch.Generator().manual_seed(m)) * 1e3
    got = squares.ordered_row_sums(x)
    assert got.dtype == torch.float32
    for r in range(rows):
        assert torch.equal(got[r], ordered_sum(x[r]))


def test_clipped_square_sums_of_shards_equal_each_shard_alone():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    thr = torch.tensor(2.0)
    bounds = sizes.reternarized_bounds(1000, 7)
    got = squares.clipped_square_sums(g, thr, bounds)
    assert got.dtype == torch.float32 and got.numel() == 7
    for (lo, hi), v in zip(bounds, got):
        want = ordered_sum(g[lo:hi].clamp(-2.0, 2.0) ** 2) if hi > lo else torch.tensor(0.0)
        assert torch.equal(v, want)
    inf = squares.clipped_square_sums(g, torch.tensor(float("inf")), [(0, 1000)])
    assert torch.equal(inf[0], ordered_sum(g ** 2))
    assert torch.equal(squares.clipped_square_sums(g.bfloat16(), thr, [(0, 1000)]),
                       squares.clipped_square_sums(g.bfloat16().float(), thr, [(0, 1000)]))


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_the_trailer_travels_with_its_payload_and_is_walked_over(fmt):
    pays, sent = [], []
    for r, n in enumerate([5, 300, 64]):
        g = torch.randn(n, generator=torch.Generator().manual_seed(r))
        p = C.prepare(g, 0, 2.5)
        pay = C.ternary.ternarize(g, p.threshold, p.scalers, 0, C.stream_key(0, 0, 1, r))
        payload = C.encode(pay, fmt, p.scalers, 0)
        sent.append(squares.clipped_square_sums(g, p.threshold, [(0, n)]))
        with_sq = squares.attach(payload, sent[-1][0])
        assert with_sq.numel() == sizes.payload_size(n, fmt, 0, squares=True) == payload.numel() + 4
        h = packing.parse_header(with_sq)
        assert h.flags & packing.FLAG_SQUARES and h.total_bytes == with_sq.numel()
        assert torch.equal(packing.split(with_sq, h)[1], payload[sizes.codes_offset(1):])     # codes only
        assert torch.equal(C.decode_average([with_sq]), C.decode_average([payload]))
        pays.append(with_sq)
    buf = torch.cat(pays)
    headers, offsets = packing.walk(buf, 3)
    ends = [o + h.total_bytes for h, o in zip(headers, offsets)]
    assert torch.equal(squares.read(buf, ends), torch.cat(sent))


def test_the_factor_written_out_and_its_edges():
    nu = torch.tensor([1.0, 2.0, 3.0, 0.0])
    got = squares.take_out_minibatch_share(nu.clone(), torch.tensor([8.0, 4.0]), 2.0)    # Q = 12/4 = 3 of 6
    assert torch.equal(got, nu * 0.5)
    assert torch.equal(squares.take_out_minibatch_share(nu.clone(), torch.tensor([100.0]), 1.0), nu * 0)
    assert torch.equal(squares.take_out_minibatch_share(torch.zeros(3), torch.tensor([1.0]), 1.0), torch.zeros(3))
    assert torch.equal(squares.take_out_minibatch_share(nu.clone(), torch.tensor([float("nan")]), 1.0), nu)
    assert squares.take_out_minibatch_share(torch.empty(0), torch.tensor([1.0]), 1.0).numel() == 0
    same = torch.rand(3000, generator=torch.Generator().manual_seed(2))
    sq = torch.tensor([3.0, 5.0, 7.0])
    assert torch.equal(squares.take_out_minibatch_share(same.clone(), sq, 3.0),
                       minibatch_share_out(same, [torch.tensor([3.0]).sqrt(), torch.tensor([5.0]).sqrt(),
                                                  torch.tensor([7.0]).sqrt()], 3.0))


def test_after_the_correction_the_estimate_totals_the_rounding_variance():
    """Over many draws, the mean of Σ_i ν'_i equals (1/N²)·Σ_r Σ_i (s_r·|f(g_r,i)| - f(g_r,i)²), the variance the
    rounding adds to the average (what Adam's v carries on top of fp32's), where the uncorrected Σ_i ν_i is larger
    by (1/N²)·Σ_r Σ_i f(g_r,i)²."""
    N, n, draws = 4, 512, 400
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) * (1 + r) + 0.3 for r in range(N)]
    preps = [C.prepare(g, 0, 2.5) for g in grads]
    clipped = [torch.minimum(torch.maximum(g, -p.threshold), p.threshold) for g, p in zip(grads, preps)]
    var = sum(float((p.scalers[0] * c.abs() - c * c).sum()) for p, c in zip(preps, clipped)) / N ** 2
    extra = sum(float((c * c).sum()) for c in clipped) / N ** 2
    sent = torch.cat([squares.clipped_square_sums(g, p.threshold, [(0, n)]) for g, p in zip(grads, preps)])
    raw, fixed = [], []
    for d in range(draws):
        pays = [C.encode(C.ternary.ternarize(g, p.threshold, p.scalers, 0, C.stream_key(d, 0, 9, r)), "2bit",
                         p.scalers, 0) for r, (g, p) in enumerate(zip(grads, preps))]
        headers = [packing.parse_header(p) for p in pays]
        offsets = [sum(p.numel() for p in pays[:r]) for r in range(N)]
        nu = allgather.noise_estimate(torch.cat(pays), headers, offsets, N)
        raw.append(float(nu.sum()))
        fixed.append(float(squares.take_out_minibatch_share(nu, sent, N).sum()))
    raw_mean, fixed_mean = sum(raw) / draws, sum(fixed) / draws
    assert raw_mean == pytest.approx(var + extra, rel=0.02)
    assert fixed_mean == pytest.approx(var, rel=0.02)
    assert extra > 0.1 * var            # the share taken out is not negligible here: the test can tell them apart
