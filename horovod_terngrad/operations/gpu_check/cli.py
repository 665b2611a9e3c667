"""The command line: ``python -m horovod_terngrad.operations.gpu_check`` (scripts/gpu_check.sh runs it)."""
from __future__ import annotations

import argparse
import json
import time

from .check import check, table
from .status import FAIL


def main(argv=None) -> int:
    from . import __doc__ as what_it_checks
    p = argparse.ArgumentParser(prog="gpu_check", description=what_it_checks,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the CPU dry run even where a GPU is")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the pytest step")
    p.add_argument("--budget-s", type=float, default=420.0, help="time for the whole check (the steps' shares)")
    p.add_argument("--json", default=None, help="also write the rows and every measurement here (docs/gpu/*.json)")
    p.add_argument("--pytest-log", default=None, help="write the tests step's whole pytest output here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    heading, rows, info = check(args.dry_run, args.budget_s, args.tests, args.pytest_log)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(heading, rows, info), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
    return 1 if any(r.status == FAIL for r in rows) else 0
