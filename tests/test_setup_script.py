"""scripts/setup.sh --dry-run: the decisions of the GPU install (--cuda) on fake machines, and the CPU install's
plan, without installing anything.

Each case puts a fake ``nvidia-smi`` (a driver's header with its "CUDA Version"), a fake ``nvcc`` (its release
line) and, where the case has NCCL, a directory with ``nccl.h`` and ``libnccl.so*`` in front of a PATH without
the machine's own CUDA, and reads the script's ``decision:`` lines and the commands it prints as ``[dry-run]``.
"""
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "scripts", "setup.sh")
INDEX = "https://download.pytorch.org/whl"

SMI_HEADER = """Sat Nov 28 00:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def _script(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)


def dry_run(tmp_path, *args, driver=None, nvcc=None, nccl=None, smi_fails=False):
    """Runs setup.sh --dry-run ARGS on a fake machine: ``driver`` = the CUDA version nvidia-smi reports (None: no
    nvidia-smi), ``nvcc`` = nvcc's release (None: no nvcc), ``nccl`` = "system" (nccl.h + libnccl.so under a
    searched prefix), "home" (HOROVOD_NCCL_HOME with only libnccl.so.2, like the nvidia-nccl wheel) or None.
    Returns (returncode, the decision lines, the [dry-run] commands as argument lists, the whole output)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if driver is not None:
        _script(fake / "nvidia-smi", f"cat <<'EOF'\n{SMI_HEADER.format(cuda=driver)}EOF\n")
    elif smi_fails:
        _script(fake / "nvidia-smi", "echo 'NVIDIA-SMI has failed because it couldn'\"'\"'t communicate with "
                                     "the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and "
                                     "running.'\nexit 9\n")
    cuda_home = tmp_path / "cuda"
    if nvcc is not None:
        (cuda_home / "bin").mkdir(parents=True)
        _script(cuda_home / "bin" / "nvcc", f"echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                                            f"echo 'Cuda compilation tools, release {nvcc}, V{nvcc}.0'\n")
        os.symlink(cuda_home / "bin" / "nvcc", fake / "nvcc")
    env = {"HOME": str(tmp_path), "PATH": f"{fake}:/usr/bin:/bin", "PYTHON": sys.executable,
           "HOROVOD_TERNGRAD_VENV": str(tmp_path / "venv"), "HOROVOD_TERNGRAD_CACHE": str(tmp_path / "cache"),
           "CUDA_HOME": str(cuda_home), "HOROVOD_TERNGRAD_NCCL_PREFIXES": str(tmp_path / "sys"), "LANG": "C.UTF-8"}
    if nccl == "system":
        for d in ("sys/include", "sys/lib64"):
            (tmp_path / d).mkdir(parents=True)
        (tmp_path / "sys/include/nccl.h").write_text("#define NCCL_MAJOR 2\n")
        (tmp_path / "sys/lib64/libnccl.so").write_text("")
    elif nccl == "home":
        for d in ("nccl/include", "nccl/lib"):
            (tmp_path / d).mkdir(parents=True)
        (tmp_path / "nccl/include/nccl.h").write_text("#define NCCL_MAJOR 2\n")
        (tmp_path / "nccl/lib/libnccl.so.2").write_text("")
        env["HOROVOD_NCCL_HOME"] = str(tmp_path / "nccl")
    p = subprocess.run(["bash", SETUP, "--dry-run", *args], env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    decisions = [ln.split("decision: ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("[setup] decision: ")]
    commands = [shlex.split(ln[len("[dry-run] "):]) for ln in p.stdout.splitlines() if ln.startswith("[dry-run] ")]
    return p.returncode, decisions, commands, out


def pip_installs(commands):
    """The arguments after 'pip install' of each printed pip install."""
    return [c[c.index("install") + 1:] for c in commands if "pip" in c and "install" in c and "uninstall" not in c]


def horovod_build(commands):
    """The environment assignments and unset names of the printed Horovod wheel build, or None."""
    for c in commands:
        if c[0] == "env" and "wheel" in c:
            sets = dict(a.split("=", 1) for a in c if "=" in a and a.startswith("HOROVOD_"))
            unsets = [c[i + 1] for i, a in enumerate(c) if a == "-u"]
            return sets, unsets
    return None


def wheel_cache_dir(commands):
    return next(c[-1] for c in commands if c[:2] == ["mkdir", "-p"] and "/wheels/" in c[-1])


def test_cuda_12_4_driver_with_nvcc_and_nccl_gets_cu126_cupy12_and_nccl_horovod(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver="12.4", nvcc="12.4", nccl="system")
    assert rc == 0, out
    # 12.4 has no torch 2.13.0 build of its own: the oldest CUDA 12 one, by minor version compatibility
    assert any(d.startswith(f"torch 2.13.0+cu126 from {INDEX}/cu126") and "minor version compatibility" in d
               for d in decisions), decisions
    installs = pip_installs(commands)
    assert ["torch==2.13.0+cu126", "--index-url", f"{INDEX}/cu126"] in [i[-3:] for i in installs], installs
    assert any(i[-1] == "cupy-cuda12x" for i in installs) and not any("cupy-cuda13x" in " ".join(i) for i in installs)
    sets, unsets = horovod_build(commands)
    assert sets["HOROVOD_GPU_OPERATIONS"] == "NCCL" and sets["HOROVOD_NCCL_LINK"] == "SHARED"
    assert sets["HOROVOD_WITH_PYTORCH"] == "1" and sets["HOROVOD_NCCL_INCLUDE"] == str(tmp_path / "sys/include")
    assert sets["HOROVOD_NCCL_LIB"] == str(tmp_path / "sys/lib64")     # libnccl.so there: no link needed
    assert sets["HOROVOD_CUDA_HOME"] == str(tmp_path / "cuda") and not unsets
    assert wheel_cache_dir(commands).endswith("/wheels/torch-2.13.0+cu126-nccl")
    # the C++17 fix for both CMakeLists, and C++17 for the CUDA kernels
    seds = [" ".join(c) for c in commands if c[0] == "sed"]
    assert any("CMAKE_CXX_STANDARD 17" in s and s.count("CMakeLists.txt") == 2 for s in seds), seds
    assert any("CMAKE_CUDA_STANDARD 17" in s for s in seds), seds
    assert any(c[-1] == "--check-build" for c in commands)


def test_cuda_13_0_driver_gets_cu130_cupy13_and_nccl_from_a_wheel_layout(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver="13.0", nvcc="13.0", nccl="home")
    assert rc == 0, out
    assert any(d.startswith(f"torch 2.13.0+cu130 from {INDEX}/cu130") for d in decisions), decisions
    installs = pip_installs(commands)
    assert ["torch==2.13.0+cu130", "--index-url", f"{INDEX}/cu130"] in [i[-3:] for i in installs]
    assert any(i[-1] == "cupy-cuda13x" for i in installs)
    sets, _ = horovod_build(commands)
    assert sets["HOROVOD_GPU_OPERATIONS"] == "NCCL" and sets["HOROVOD_NCCL_INCLUDE"] == str(tmp_path / "nccl/include")
    # only libnccl.so.2 (the nvidia-nccl wheel's layout): linked as libnccl.so in the build's own directory
    link = next(c for c in commands if c[:2] == ["ln", "-sf"])
    assert link[2] == str(tmp_path / "nccl/lib/libnccl.so.2") and link[3] == sets["HOROVOD_NCCL_LIB"] + "/libnccl.so"
    assert wheel_cache_dir(commands).endswith("/wheels/torch-2.13.0+cu130-nccl")


@pytest.mark.parametrize("smi_fails", [False, True], ids=["no-nvidia-smi", "nvidia-smi-without-driver"])
def test_cuda_without_a_driver_stops_before_installing_and_says_why(tmp_path, smi_fails):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver=None, nvcc="13.0", nccl="system",
                                           smi_fails=smi_fails)
    assert rc != 0 and not commands and not decisions, out
    assert ("couldn't communicate with the NVIDIA driver" if smi_fails else "nvidia-smi is not on PATH") in out
    assert "--cuda=12.8" in out         # the way to name the CUDA version without a driver


def test_cuda_given_without_a_driver_uses_that_version(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda=12.8", driver=None, nvcc=None)
    assert rc == 0, out
    assert any("given by --cuda=12.8" in d for d in decisions)
    assert any(i[-3:] == ["torch==2.13.0+cu128", "--index-url", f"{INDEX}/cu128"] for i in pip_installs(commands))


def test_nvcc_without_nccl_builds_horovod_with_cpu_operations_and_says_why(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver="12.8", nvcc="12.8", nccl=None)
    assert rc == 0, out
    why = next(d for d in decisions if d.startswith("Horovod"))
    assert "CPU operations" in why and "no NCCL" in why and "HOROVOD_NCCL_HOME" in why, why
    assert any(i[-3:] == ["torch==2.13.0+cu128", "--index-url", f"{INDEX}/cu128"] for i in pip_installs(commands))
    sets, unsets = horovod_build(commands)
    assert "HOROVOD_GPU_OPERATIONS" not in sets and "HOROVOD_GPU_OPERATIONS" in unsets
    assert sets["HOROVOD_WITH_PYTORCH"] == "1" and sets["HOROVOD_CUDA_HOME"] == str(tmp_path / "cuda")
    assert wheel_cache_dir(commands).endswith("/wheels/torch-2.13.0+cu128")   # not the NCCL build's key


def test_no_nvcc_skips_horovod_and_takes_cupys_cuda_libraries_from_pypi(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver="13.0", nvcc=None, nccl="system")
    assert rc == 0, out
    assert any(d.startswith("Horovod: not built") and "no nvcc" in d for d in decisions), decisions
    assert horovod_build(commands) is None
    assert any(i[-1] == "cupy-cuda13x[ctk]" for i in pip_installs(commands))


def test_nvcc_of_another_cuda_major_than_torch_skips_horovod(tmp_path):
    rc, decisions, commands, out = dry_run(tmp_path, "--cuda", driver="13.0", nvcc="12.4", nccl="system")
    assert rc == 0, out
    why = next(d for d in decisions if d.startswith("Horovod"))
    assert "not built" in why and "CUDA 12.4" in why and "CUDA 13" in why, why
    assert horovod_build(commands) is None


def test_driver_older_than_every_torch_cuda_build_is_refused(tmp_path):
    rc, _, commands, out = dry_run(tmp_path, "--cuda", driver="11.8", nvcc="11.8")
    assert rc != 0 and not commands
    assert "older than every CUDA build of torch 2.13.0" in out and "update the NVIDIA driver" in out


def test_cpu_install_plan_is_the_cpu_torch_and_the_cached_cpu_horovod(tmp_path):
    """Without --cuda (the README's commands): torch==2.13.0 from the usual index, Horovod with CPU operations
    under the wheel cache's torch-2.13.0 key, and no CUDA package."""
    rc, decisions, commands, out = dry_run(tmp_path, driver="13.0", nvcc="13.0", nccl="system")
    assert rc == 0, out
    installs = pip_installs(commands)
    assert not any("--index-url" in i or any("cupy" in a for a in i) for i in installs), installs
    assert any("torch==2.13.0" in i for i in installs)
    sets, unsets = horovod_build(commands)
    assert "HOROVOD_GPU_OPERATIONS" not in sets and "HOROVOD_GPU_OPERATIONS" in unsets
    assert "HOROVOD_CUDA_HOME" not in sets
    assert wheel_cache_dir(commands).endswith("/wheels/torch-2.13.0")
    assert decisions == ["Horovod 0.28.1 with CPU operations (Gloo, MPI): the CPU install (no --cuda)"]


@pytest.mark.slow
@pytest.mark.one_process
def test_setup_on_the_installed_venv_has_nothing_left_to_do():
    """The README's commands are idempotent: on the venv the tests run in (set up by setup.sh --test), a dry run
    of either command prints no command."""
    if not os.path.exists(os.path.join(sys.prefix, "bin", "horovodrun")):
        pytest.skip("this venv was not made by scripts/setup.sh (no horovodrun)")
    for args in ([], ["--test"]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(HOROVOD_TERNGRAD_VENV=sys.prefix, PYTHON=sys.executable)
        p = subprocess.run(["bash", SETUP, "--dry-run", *args], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert not [ln for ln in p.stdout.splitlines() if ln.startswith("[dry-run]")], p.stdout


@pytest.mark.parametrize("arg, message", [("--cuda=13", "expected a CUDA version X.Y"),
                                          ("--gpu", "unknown option '--gpu'")])
def test_bad_options_are_refused_by_name(tmp_path, arg, message):
    p = subprocess.run(["bash", SETUP, "--dry-run", arg], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr
