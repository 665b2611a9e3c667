"""Stochastic rounding to 3 or 4 levels in the first stage (a research path of examples/study_lm_scale.py): does a
first stage with less rounding variance at the same 2 bits close the gap the ternary one leaves?

Every rank r clips its gradient at c·sigma (c = 2.5, TernGrad's), takes s = min(max|g|, c·sigma) per tensor and
rounds each clipped element c_i stochastically and unbiasedly to the nearest of

* ``levels3``: s·{-1, 0, 1} (TernGrad's ternary rounding; a control of this harness): variance s·|c| - c²;
* ``levels4``: s·{-1, -1/3, 1/3, 1} (the fourth 2-bit code, which ternary leaves unused): variance
  (s/3 - |c|)·(|c| + s/3) below s/3 and (s - |c|)·(|c| - s/3) above, at most s²/9 against ternary's s²/4; on a
  Gaussian at s = 2.5 sigma about 0.43·sigma² per element against ternary's 1.0·sigma².

The average is exact (Σ_r q_r / N in fp32, rank order: the first stage of the allgather or owner exchanges, without
a second rounding), and horovod_terngrad.optim's noise estimate is (1/N²)·Σ_r q_r² with the minibatch's share taken
out by the senders' squares (codec/squares.py's rule: scaled by max(0, 1 - Σ_r Σ_i c_i² / (N²·Σ_i ν_i))), as the
engine forms it: E[q²] = c² + Var(q), so the estimate is the rounding's variance for either level set.  The random
streams are torch generators seeded per (seed, step, tensor, rank).  With the suffix ``o`` (``levels3o``,
``levels4o``: a diagnosis, not a method) the optimizer gets the rounding's exact variance per element,
(1/N²)·Σ_r Var(q_r), instead of that estimate; with ``e`` (``levels3e``, ``levels4e``) the estimate takes each
element's own square of the mean out before the squares' rule (``per_element_estimate``), at no extra bits.
With the prefix ``c`` before those (``levels3c``, ``levels4c``) the ranks' dithers are stratified per element
(``stratified_dither``: correlated rounding, no extra bits): each rank's rounding is as unbiased and as likely to
round up as before, but the ranks' errors are negatively correlated, so their average's variance is lower; the
estimate from the payloads still describes independent draws, so it over-counts that variance.
Bits counted: the first stage sent to shard owners, (N-1)/N·2 bits per element (both level sets in 2-bit codes)
plus one fp32 scaler per shard.
"""
from __future__ import annotations

import types

import torch

from horovod_terngrad import codec
from horovod_terngrad.codec import squares
from horovod_terngrad.exchange import precision
from horovod_terngrad.exchange.stats import ExchangeStats
from horovod_terngrad.modelling.simulate import Simulator
from owner_step import OwnerStepSimulator

LEVELS = {"levels3": 3, "levels4": 4}
CORRELATED = "c"  # a suffix (levels3c, levels4c): the ranks' dithers stratified per element (stratified_dither)
ORACLE = "o"      # a suffix (levels3o, levels4o): the optimizer gets the rounding's exact variance, a diagnosis
SECOND_STAGES = ("", "ef4", "sr4")  # the owners' rounding of the average back (LevelSimulator._second_stage)
PER_ELEMENT = "e"  # a suffix (levels3e, levels4e): the estimate takes each element's own square of the mean out
SUBTRACTIVE = "s"  # a suffix (levels4s, levels4cs): the receiver subtracts the known dither (round_to_levels); the
                   # optimizer gets the rounding's variance, (1/N²)·Σ_r spacing_r²/12, exact for independent dithers


def round_to_levels(c: torch.Tensor, s: float, levels: int, gen: torch.Generator,
                    dither: torch.Tensor | None = None, subtractive: bool = False) -> tuple:
    """Unbiased stochastic rounding of ``c`` (|c| <= s) to ``levels`` evenly spaced values from -s to s; returns
    (the rounded values, each element's rounding variance).  With ``dither`` (uniform on [0, 1) per element, e.g.
    ``stratified_dither``'s) an element rounds up where dither >= 1 - frac, the same probability frac as the
    independent draw's dither < frac, but always on the dither's upper tail: that is what makes the rounding
    errors of ranks with stratified dithers negatively correlated."""
    if s <= 0:
        return torch.zeros_like(c), torch.zeros_like(c)
    steps = levels - 1
    u = (c / s + 1.0) * (steps / 2.0)                       # in [0, steps]
    low = torch.clamp(torch.floor(u), 0, steps - 1)
    frac = u - low
    if subtractive:
        # the receiver knows the dither (it recomputes the sender's stream): it decodes q - u + 1/2, whose error is
        # uniform on one step, independent of c: variance spacing²/12 everywhere, known without the values
        u = torch.rand(c.shape, generator=gen) if dither is None else dither
        q = low + (u >= 1.0 - frac).to(c.dtype)
        spacing = 2.0 * s / steps
        return s * ((q - u + 0.5) * (2.0 / steps) - 1.0), torch.full_like(c, spacing * spacing / 12.0)
    up = (torch.rand(c.shape, generator=gen) < frac) if dither is None else (dither >= 1.0 - frac)
    spacing = 2.0 * s / steps
    return s * ((low + up.to(c.dtype)) * (2.0 / steps) - 1.0), spacing * spacing * frac * (1.0 - frac)


def stratified_dither(n: int, N: int, shared: torch.Generator, own: list) -> torch.Tensor:
    """Each rank's dither for ``n`` elements, (N, n): u_r = (pi(r) + gamma_r) / N with pi a random permutation of
    the N ranks per element, drawn from the generator every rank shares (seeded without the rank), and gamma_r
    uniform from rank r's own generator.  Each u_r is uniform on [0, 1), so every rank's rounding stays unbiased;
    for any two ranks the strata differ, and two events on the dithers' upper tails then have covariance <= 0
    (Chebyshev's sum inequality over the strata): the variance of the ranks' average is never above the
    independent draws', and where the ranks' values agree it falls as 1/N² instead of 1/N."""
    strata = torch.rand((n, N), generator=shared).argsort(dim=1).T.to(torch.float32)
    gamma = torch.stack([torch.rand(n, generator=g) for g in own])
    return (strata + gamma) / N


def smallest_prime_at_least(n: int) -> int:
    p = max(2, n)
    while any(p % d == 0 for d in range(2, int(p ** 0.5) + 1)):
        p += 1
    return p


def affine_dither(n: int, N: int, shared_key: tuple, own_keys: list) -> torch.Tensor:
    """``stratified_dither`` as a kernel would draw it, per element and rank from the codec's counter-based
    streams (codec/rng.py), with no sort: P = the smallest prime >= N strata; one draw of the stream every rank
    shares picks a map x -> (a·x + b) mod P (a in 1..P-1, b in 0..P-1: the affine maps of Z_P, which take any two
    distinct ranks to any two distinct strata with equal probability, as a random permutation does); rank r's
    stratum is (a·r + b) mod P, and its own stream's 24-bit draw places it inside: u = (stratum·2^24 + draw) // P
    in 24-bit units, exactly uniform.  The pairs' joint law is the permutation's, so the average's variance is
    the same (with P strata for N ranks)."""
    P = smallest_prime_at_least(N)
    pick = codec.uniform24(shared_key, 0, n) % (P * (P - 1))   # bias under P²/2^24
    a, b = 1 + pick // P, pick % P
    out = torch.empty((N, n), dtype=torch.float32)
    for r, key in enumerate(own_keys):
        stratum = (a * r + b) % P
        u24 = (stratum * (1 << codec.rng.UNIFORM_BITS) + codec.uniform24(key, 0, n)) // P
        out[r] = u24.to(torch.float32) / float(1 << codec.rng.UNIFORM_BITS)
    return out


def per_element_estimate(squared: torch.Tensor, avg: torch.Tensor, clipped_sq: float, N: int) -> torch.Tensor:
    """The rounding variance of the mean per element from what a receiver holds: Σ_r q_r² and the average a.

    (1/N²)·Σ_r q_r² estimates Var + (1/N²)·Σ_r c_r², and Σ_r c_r² = N·c̄² + S (S: the ranks' spread about their
    mean c̄).  Each element's own share N·c̄² comes out with the average: E[a²] = c̄² + Var, so
    ν' = (1/N²)·Σ_r q_r² - a²/N has mean Var·(1 - 1/N) + S/N².  The spread's share comes out as the squares' rule
    takes the minibatch's: scaled by max(0, 1 - Q_S/Σν'), Q_S = Q - Σ a²/N the spread's part of the senders'
    squares Q = Σ_r Σ_i c_r,i²/N²; then divided by (1 - 1/N)."""
    nu = torch.clamp(squared / (N * N) - avg * avg / N, min=0.0)
    q_spread = max(0.0, clipped_sq / (N * N) - float((avg.double() ** 2).sum()) / N)
    total = float(nu.double().sum())
    factor = max(0.0, 1.0 - q_spread / total) if total > 0 else 1.0
    return nu * (factor / (1.0 - 1.0 / N))


class LevelSimulator(Simulator):
    """The simulator with the first stage rounded to ``levels`` levels (module docstring)."""

    def __init__(self, model, n_workers, config, levels: int, seed: int = 0, estimate: str = "",
                 second: str = "", second_bucket: int = 0):
        super().__init__(model, n_workers, config)
        self._set_rounding(levels, seed, estimate, second, second_bucket)

    def _set_rounding(self, levels: int, seed: int, estimate: str, second: str = "", second_bucket: int = 0) -> None:
        """The rounding's settings and counters (also LevelOwnerStepSimulator's)."""
        if second not in SECOND_STAGES:
            raise ValueError(f"second stage must be one of {SECOND_STAGES}, got {second!r}")
        self.correlated = estimate.startswith(CORRELATED)
        self.levels, self.seed, self.step_count = levels, seed, 0
        self.estimate = estimate[len(CORRELATED):] if self.correlated else estimate
        self.second, self.second_bucket, self.residual = second, int(second_bucket), {}
        self._stats = ExchangeStats()

    def _second_stage(self, j: int, avg: torch.Tensor) -> tuple:
        """The owners' rounding of the average back to every rank (``second``): (what every rank receives, the
        busiest rank's bytes for it).  ``ef4``: each owner rounds its shard plus what its last rounding left out to
        the nearest of 4 levels s·{-1, -1/3, 1/3, 1} and keeps the new remainder (error feedback at the owner: a
        buffer of 1/N of the tensor per owner); ``sr4``: stochastic unbiased rounding to those levels, no buffer.
        One fp32 scaler s per shard, or per ``second_bucket`` elements."""
        N, n = self.n, avg.numel()
        x = avg + self.residual.get(j, 0.0) if self.second == "ef4" else avg
        k = self.second_bucket if 0 < self.second_bucket < -(-n // N) else -(-n // N)
        pad = (-n) % k
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, k)
        s = blocks.abs().amax(dim=1, keepdim=True)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        pos = (blocks / safe + 1.0) * 1.5                       # in [0, 3]
        if self.second == "ef4":
            idx = torch.round(pos)
        else:
            gen = torch.Generator().manual_seed(hash((self.seed, self.step_count, j, -2)) & 0x7FFFFFFFFFFF)
            low = torch.clamp(torch.floor(pos), 0, 2)
            idx = low + (torch.rand(pos.shape, generator=gen) < pos - low).to(pos.dtype)
        q = (s * (idx / 1.5 - 1.0)).reshape(-1)[:n]
        if self.second == "ef4":
            self.residual[j] = x - q
        return q, (N - 1) / N * (n * 2 / 8) + 4 * (blocks.shape[0] - blocks.shape[0] / N)

    @property
    def stats(self) -> ExchangeStats:
        return self._stats

    def _exchange(self, per_rank: list, names: list, routes: list | None = None) -> list:
        routes = routes or [None] * len(names)
        N, outs = self.n, []
        for j, (name, route) in enumerate(zip(names, routes)):
            total = torch.zeros(per_rank[0][j].numel(), dtype=torch.float32)
            squared = torch.zeros_like(total)
            variance = torch.zeros_like(total)
            clipped_sq = 0.0
            gens = [torch.Generator().manual_seed(hash((self.seed, self.step_count, j, r)) & 0x7FFFFFFFFFFF)
                    for r in range(N)]
            dither = None
            if self.correlated:
                # the strata's stream: the same on every rank (no rank in its seed; -1 is no rank's index)
                shared = torch.Generator().manual_seed(hash((self.seed, self.step_count, j, -1)) & 0x7FFFFFFFFFFF)
                dither = stratified_dither(total.numel(), N, shared, gens)
            for r in range(N):
                g = per_rank[r][j].reshape(-1).to(torch.float32)
                thr = 2.5 * float(g.std(unbiased=False)) or float("inf")
                c = torch.clamp(g, -thr, thr)
                s = min(float(g.abs().max()), thr)
                q, var = round_to_levels(c, s, self.levels, gens[r], None if dither is None else dither[r],
                                         subtractive=self.estimate == SUBTRACTIVE)
                variance += var
                total += q
                squared += q * q
                clipped_sq += float((c.double() ** 2).sum())
            avg = total / N
            if self.second:
                avg, second_bytes = self._second_stage(j, avg)
                self._stats.bytes_received += second_bytes
            avg = avg.reshape(per_rank[0][j].shape)
            if self.estimate in (ORACLE, SUBTRACTIVE):
                noise = variance / (N * N)
            elif self.estimate == PER_ELEMENT:
                noise = per_element_estimate(squared, total / N, clipped_sq, N)
            else:
                noise = squared / (N * N)
                squares.take_out_minibatch_share(noise, torch.tensor([clipped_sq], dtype=torch.float32), N)
            precision.deliver(types.SimpleNamespace(route=route, noise=noise), avg)
            n = avg.numel()
            self._stats.elements += n
            self._stats.bytes_received += (N - 1) / N * (n * 2 / 8 + 4)
            outs.append(avg)
        self.step_count += 1
        return outs


class LevelOwnerStepSimulator(OwnerStepSimulator):
    """Owner-step (examples/owner_step.py: the owners step their shards and send ternary weight differences) with
    the first stage rounded as ``LevelSimulator`` rounds it (e.g. 4 levels, correlated) instead of the engine's
    ternary: a first stage of 2 bits per element plus a second of about 1.6-1.9, at most 4 in all.

    Bits counted: the first stage as ``LevelSimulator`` counts it, the weight differences as owner-step does."""

    def __init__(self, model, n_workers, config, levels: int, seed: int = 0, estimate: str = "",
                 rounding: str = "nearest", delta_bucket: int = 0):
        super().__init__(model, n_workers, config, rounding=rounding, delta_bucket=delta_bucket)
        self._set_rounding(levels, seed, estimate)      # no second stage: the weight differences are it

    stats = LevelSimulator.stats
    _set_rounding = LevelSimulator._set_rounding
    _exchange = LevelSimulator._exchange

    def bits_received(self) -> tuple[float, float]:
        e = max(1, self.elements)
        return 8 * self._stats.bytes_received / e, 8 * self.delta_bytes / e
