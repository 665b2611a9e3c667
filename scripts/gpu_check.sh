#!/usr/bin/env bash
# One check of a GPU machine in one call, at most 8 minutes on one GPU, printing one table
# (horovod_terngrad/operations/gpu_check/ says what each step checks):
#   CUDA tests, byte identity of the CUDA and CPU backends on GPT-2 and ResNet-50 shapes, the kernel table (each
#   codec path's bytes per element, GB/s and fraction of the device's copy), TernGrad's AdamW step against torch's,
#   one GPU's GPT-2 124M training step and what TernGrad adds to it, and 2 processes on the one GPU (gloo).
# Without a GPU (or with --dry-run) the same steps run on the CPU backends (the kernel table on the host build of
# the CUDA kernels, at small sizes) and the table says "no GPU".
# --json docs/gpu/<gpu>-<date>.json writes every figure; scripts/render_docs.py renders docs/gpu.md from it.
#   scripts/gpu_check.sh [--dry-run] [--no-tests] [--json FILE] [--pytest-log FILE]
# Exit status: 0 when every step passed (or was skipped), 1 when one failed, 124 when it ran out of time.
# Python: $PYTHON, else the repository's .venv, else python3 on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
LIMIT_S=480                      # the whole call; the steps share 420 s of it (--budget-s) and stop themselves
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# one torch thread per process unless the caller says otherwise: the 2-rank step runs two processes side by side
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec timeout --kill-after=10 "$LIMIT_S" "$PY" -m horovod_terngrad.operations.gpu_check --budget-s 420 "$@"
