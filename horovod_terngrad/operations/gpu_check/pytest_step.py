"""The ``tests`` step: the checkout's CUDA tests under pytest (on a GPU), or the ones that run on a CPU (dry run)."""
from __future__ import annotations

import os
import subprocess
import sys

from .status import FAIL, OK, SKIPPED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GPU_TEST_FILES = ("tests/test_kernels.py", "tests/test_backends.py", "tests/test_cuda_nosync.py",
                  "tests/test_adam_kernel.py", "tests/test_golden.py::test_cuda_tensors_reproduce_the_pins",
                  "tests/test_golden.py::test_cuda_default_above_4_ranks_matches_the_cpu")
DRY_RUN_TEST_FILES = ("tests/test_kernels.py", "tests/test_cuda_nosync.py")


def run_tests(files, timeout_s: float, root: str = ROOT, log: str | None = None) -> tuple[str, str]:
    """(result, status) of pytest over ``files`` of the checkout at ``root``; pytest's whole output goes to ``log``
    when given (the table keeps only its summary and the first failures)."""
    paths = [os.path.join(root, f) for f in files]                      # a file, or a file::test node id
    missing = [f for f, p in zip(files, paths) if not os.path.exists(p.split("::")[0])]
    if missing:
        return f"not in this tree: {', '.join(missing)} (run from a checkout)", SKIPPED
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", f"timeout={int(timeout_s)}", *paths]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=root, env=env)
    except subprocess.TimeoutExpired as e:
        if log:
            with open(log, "w") as f:
                f.write(str(e.stdout or "") + str(e.stderr or ""))
        return f"pytest did not finish in {timeout_s:.0f} s", FAIL
    if log:
        with open(log, "w") as f:
            f.write(p.stdout + p.stderr)
    lines = [x for x in p.stdout.strip().splitlines() if x.strip()]
    summary = lines[-1].strip("= ") if lines else (p.stderr.strip().splitlines() or ["no output"])[-1]
    if p.returncode == 0:
        return summary, OK
    failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))][:3]
    return summary + ("; " + "; ".join(failed) if failed else ""), FAIL
