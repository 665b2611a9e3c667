"""Re-pin the golden bytes of tests/test_golden.py: run every pinned case (``test_golden._all_keys()``: each
setting of ``CASES`` at 1-4 ranks, alone and fused; ``test_golden._level_keys()``: the four-level code's cases of
``LEVEL_CASES``, at the codec) and write the digests of every collective's input and of every decoded average
(and the four-level payloads and noise estimates) to ``tests/golden/exchange.json``.

    .venv/bin/python scripts/write_golden.py            # rewrite tests/golden/exchange.json
    .venv/bin/python scripts/write_golden.py --check    # exit 1, naming the cases, where a pin differs

Re-pin only for an intended change of the wire format or the arithmetic; then ``git diff tests/golden`` shows
which cases moved.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import test_golden  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed pins instead of writing them")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pins = {f"{c}/{n}/{f}": test_golden._run(c, n, f) for c, n, f in test_golden._all_keys()}
    pins.update({key: test_golden._run_levels(case) for key, case in test_golden._level_keys()})
    if args.check:
        with open(test_golden.GOLDEN) as f:
            old = json.load(f)
        moved = sorted(k for k in set(pins) | set(old) if pins.get(k) != old.get(k))
        for k in moved:
            print(f"differs: {k}")
        print(f"{len(pins) - len(moved)} of {len(pins)} pins unchanged")
        return 1 if moved else 0
    os.makedirs(os.path.dirname(test_golden.GOLDEN), exist_ok=True)
    with open(test_golden.GOLDEN, "w") as f:
        json.dump(pins, f, indent=0, sort_keys=True)
    print(f"wrote {len(pins)} pins to {os.path.relpath(test_golden.GOLDEN, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
