"""Timing on the device: the timer (wall time and CUDA events), the device's copy rate (the kernel table's
yardstick) and its busy time (torch.profiler)."""
from __future__ import annotations

import time

import torch


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Seconds per call on ``device``: ``wall`` (host clock, the call and a synchronization: what a caller waits,
    host overhead included) and ``gpu`` (CUDA events; None on the CPU).  The GPU figure queues the calls behind a
    wait kernel long enough for the host to enqueue them all, so the events span only the device's work, not the
    host's launch gaps; ``queued`` says whether that held (the wait was still running when the last call was
    enqueued).  Where it did not (a call that makes the host wait for the device), the span is an upper bound."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        if not hasattr(torch.cuda, "_sleep"):
            return 0.0
        cycles = 10_000_000
        torch.cuda._sleep(cycles)                     # first launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(1e-6, start.elapsed_time(end) / 1e3)

    def wall(self, fn, repeat: int) -> float:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            sync(self.device)
            best = min(best, time.perf_counter() - t0)
        return best

    def gpu(self, fn, repeat: int, host_s: float) -> tuple[float | None, bool | None]:
        """(seconds per call from CUDA events, queued) for ``repeat`` calls in a row; ``host_s``: the wall time of
        one call (sizes the wait).  (None, None) on the CPU."""
        if not self.cuda:
            return None, None
        sync(self.device)
        if self.cycles_per_s:
            wait_s = min(10.0, 1.5 * host_s * repeat + 0.005)
            torch.cuda._sleep(int(wait_s * self.cycles_per_s))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        queued = bool(self.cycles_per_s) and not start.query()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat, queued

    def measure(self, fn, repeat: int) -> dict:
        """{"wall_s", "gpu_s", "queued", "s"}: one warm-up call, the best wall of ``repeat``, then the GPU time
        of ``repeat`` in a row; ``s`` is the GPU time where there is one, else the wall time."""
        fn()
        sync(self.device)
        wall = self.wall(fn, repeat)
        gpu, queued = self.gpu(fn, repeat, wall)
        return {"wall_s": wall, "gpu_s": gpu, "queued": queued, "s": gpu if gpu is not None else wall}


def copy_rate(device, numel: int, timer: Timer, repeat: int) -> dict:
    """The device's copy bandwidth: ``dst.copy_(src)`` of ``numel`` fp32 elements; a copy of B bytes moves 2B
    (read and write), and ``moved_gbs`` counts both."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = timer.measure(lambda: dst.copy_(src), repeat)
    return {"elements": numel, "moved_gbs": 8 * numel / t["s"] / 1e9, "s": t["s"], "wall_s": t["wall_s"]}



def device_busy_s(fn, device) -> float | None:
    """Seconds the device spent in kernels, copies and fills during ``fn()`` (torch.profiler's CUDA activity, every
    thread's), or None where the profiler cannot say."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - no CUPTI, an older profiler: the events' span stands
        return None
    return us / 1e6 if us > 0 else None
