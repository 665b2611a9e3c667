"""The ``train step`` step: one GPU's GPT-2 step (forward, backward, torch's AdamW) and the codec's share of it at
N = 8 (thread-ranks through ``exchange.Engine`` on the one device)."""
from __future__ import annotations

import math
import threading
import time

import torch

from .shapes import GPT2Size
from .timing import Timer, device_busy_s, sync


def compute_step_ms(size: GPT2Size, device, batch: int, timer: Timer, steps: int = 5) -> dict:
    """One rank's compute of a GPT-2 step: forward and backward under bf16 autocast, then torch's fused AdamW
    (foreach where fused is missing), on ``batch`` sequences of the whole context."""
    from ..models import gpt2_lm
    torch.manual_seed(0)
    model, source = gpt2_lm(size.layers, size.d, size.heads, size.vocab, size.context)
    model = model.to(device)
    try:
        opt, opt_kind = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "fused"
    except (RuntimeError, ValueError):
        opt, opt_kind = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), "foreach"
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, size.vocab, (batch, size.context + 1), device=device, generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, size.vocab), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = timer.measure(step, steps)
    n = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    return {"compute_ms": 1e3 * t["s"], "compute_wall_ms": 1e3 * t["wall_s"], "queued": t["queued"],
            "model": source, "params": n, "tensors": tensors, "batch": batch, "tokens": batch * size.context,
            "optimizer": opt_kind}


class ThreadRanks:
    """``ranks`` thread-ranks (``exchange.ThreadWorld``, buffers shared, not copied: the transport is not the
    codec's), each with its own gradients of ``shapes`` (every gradient its own allocation, as a parameter's),
    averaging them with the default settings, cut into the frontend's fused groups, through ``exchange.Engine``.
    ``digests``: per rank, the sums of its first three averages of the last step run."""

    def __init__(self, shapes, device, ranks: int, timeout_s: float):
        from ...config import TernGradConfig
        from ...exchange import Engine, ThreadWorld, fusion
        cfg = TernGradConfig()
        names = [n for n, _ in shapes]
        sizes = [math.prod(s) for _, s in shapes]
        self.plan = fusion.cut_sizes(sizes, cfg, names)
        self.grads = []
        for r in range(ranks):
            gen = torch.Generator(device=device).manual_seed(100 + r)
            self.grads.append({n: torch.randn(s, device=device, generator=gen).mul_(1e-3)
                               for n, s in zip(names, sizes)})
        self.engines = [Engine(c, cfg) for c in ThreadWorld(ranks, copy=False).ranks()]
        self.ranks, self.timeout_s = ranks, timeout_s
        self.digests: list = [None] * ranks

    def one_rank(self, r: int, n_steps: int) -> None:
        ex = self.engines[r]
        for _ in range(n_steps):
            tickets = []
            for i, grp in enumerate(self.plan.groups):
                items = [(self.grads[r][n], n) for n in grp]
                tickets += ex.start_group(items, grp[0] if len(grp) == 1 else f"fused.{i}")
            outs = [ex.finish(t) for t in tickets]
        self.digests[r] = [float(o.double().sum()) for o in outs[:3]] if n_steps else None

    def run(self, n_steps: int) -> None:
        """``n_steps`` steps on every rank at once; a rank's error is raised here."""
        errors: list = [None] * self.ranks

        def body(r):
            try:
                self.one_rank(r, n_steps)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
            if t.is_alive():
                raise TimeoutError(f"a thread-rank did not finish in {self.timeout_s:.0f} s")
        for e in errors:
            if e is not None:
                raise e


def codec_share_ms(shapes, device, timer: Timer, ranks: int = 8, steps: int = 2, timeout_s: float = 120.0) -> dict:
    """The codec's time for one rank's share of a step: :class:`ThreadRanks` average the gradients of ``shapes``;
    the device time of ``steps`` steps divided by ranks and steps.  All ranks must decode the same averages."""
    world = ThreadRanks(shapes, device, ranks, timeout_s)
    t0 = time.perf_counter()
    world.run(1)                                          # warm-up: the first step of every tensor
    sync(device)
    host_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if timer.cuda:
        gpu, queued = timer.gpu(lambda: world.run(steps), 1, host_s * steps)
    else:
        gpu, queued = None, None
        world.run(steps)
    sync(device)
    wall = time.perf_counter() - t0
    s = gpu if gpu is not None else wall
    busy = device_busy_s(lambda: world.run(1), device) if timer.cuda else None
    same = all(d == world.digests[0] for d in world.digests)
    out = {"span_ms_per_rank": 1e3 * s / (ranks * steps), "wall_ms_per_step": 1e3 * wall / steps,
           "queued": queued, "ranks": ranks, "steps": steps, "groups": len(world.plan.groups),
           "compressed_elements": sum(world.plan.numel.values()), "same_on_every_rank": same,
           "busy_ms_per_rank": None if busy is None else 1e3 * busy / ranks}
    # the device's busy time where the profiler gives it (the span also counts the device waiting for 8 threads'
    # launches), else the span of CUDA events, else (CPU) the wall time of all ranks
    if busy is not None:
        out.update(codec_ms_per_rank=out["busy_ms_per_rank"], measured="device busy time (torch.profiler)")
    else:
        out.update(codec_ms_per_rank=out["span_ms_per_rank"],
                   measured="CUDA events" if gpu is not None else "wall time of all ranks")
    return out
