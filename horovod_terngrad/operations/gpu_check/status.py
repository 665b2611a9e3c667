"""A step's row of the check's table: its status words, and a step run with its time and its error caught."""
from __future__ import annotations

import time
from dataclasses import dataclass

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


@dataclass
class Row:
    step: str
    device: str
    result: str
    status: str
    seconds: float = 0.0


def timed_row(step: str, device: str, fn) -> Row:
    """The row of ``fn()`` (which returns (result, status)), timed; an exception is the row's FAIL."""
    t0 = time.perf_counter()
    try:
        result, status = fn()
    except Exception as e:  # noqa: BLE001 - a failing step is a FAIL row, the others still run
        result, status = f"{type(e).__name__}: {e}".splitlines()[0][:300], FAIL
    return Row(step, device, result, status, time.perf_counter() - t0)
