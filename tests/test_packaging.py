"""The package as a user installs it: a clean virtual environment holding torch and nothing else of this
project's environment (no Horovod, no Lightning), ``pip install --no-build-isolation .`` from a copy of the
tree (not editable), then TernGrad on 2 processes with the DDP hook and the FSDP2 frontend under
``horovod_terngrad.optim.AdamW`` (tests/workers/clean_venv.py).  Also: the metadata setup.py declares
(licence, Python floor, extras, the ``terngrad-launch`` console script) and the files a release carries.

The clean environment takes about a minute to build: torch comes from pip's configured sources (here a local
wheel), at the version this environment runs.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "workers", "clean_venv.py")
NP = 2
# what the copy of the tree leaves out: a venv, git's data, build outputs, results of runs
NOT_COPIED = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", "runs", "logs",
                                    ".pytest_cache", "*.so")


def run(cmd, what, timeout=600, **kw):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} took over {timeout}s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{what} failed ({' '.join(map(str, cmd))}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def clean_env():
    """The environment of commands in the clean venv: none of this process's Python paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return env


# a test that uses the clean venv (pip installs torch and this package into it) is slow (conftest.py)
SLOW_FIXTURES = ("venv",)
pytestmark = pytest.mark.launch_lane("hosts")     # installs into fresh venvs (tests/conftest.py)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(venv folder, its python): torch at this environment's version, then this package, non-editable."""
    base = tmp_path_factory.mktemp("clean")
    folder = base / "venv"
    env = clean_env()
    run([sys.executable, "-m", "venv", str(folder)], "python -m venv", env=env)
    py = str(folder / "bin" / "python")
    torch_version = torch.__version__.split("+")[0]
    # --no-compile: no .pyc for torch's thousands of modules up front; the few that run compile on import
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", f"torch=={torch_version}"],
                       capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0 and "No matching distribution" in p.stderr:
        pytest.skip(f"torch=={torch_version} cannot be installed into a fresh venv here: {p.stderr[-500:]}")
    assert p.returncode == 0, f"pip install torch=={torch_version}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    tree = base / "src"
    shutil.copytree(ROOT, tree, symlinks=True, ignore=NOT_COPIED)
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", "--no-build-isolation", "."],
                       capture_output=True, text=True, timeout=600, cwd=tree, env=env)
    if p.returncode != 0 and "No matching distribution" in p.stderr:     # numpy or tqdm unreachable (offline)
        pytest.skip(f"the package's requirements cannot be installed here: {p.stderr[-500:]}")
    assert p.returncode == 0, f"pip install .:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return folder, py


def test_the_installed_package_is_a_copy_with_its_kernels_and_without_horovod(venv):
    folder, py = venv
    code = ("import horovod_terngrad, os, importlib.util as u;"
            "from horovod_terngrad.backends import compile_cache as c;"
            "print(horovod_terngrad.__file__); print(sorted(os.listdir(c.KERNEL_DIR)));"
            "print(u.find_spec('horovod'))")
    out = run([py, "-c", code], "import horovod_terngrad", cwd="/", env=clean_env()).stdout.splitlines()
    assert out[0].startswith(str(folder)) and "site-packages" in out[0], out      # not the checkout, not editable
    assert {"terngrad_cpu.c", "terngrad.cu"} <= set(eval(out[1])), out[1]
    assert out[2] == "None"
    p = subprocess.run([py, "-c", "import horovod"], capture_output=True, text=True, env=clean_env(), cwd="/")
    assert p.returncode != 0 and "No module named 'horovod'" in p.stderr


def test_the_console_script_terngrad_launch_is_installed(venv):
    folder, _ = venv
    script = folder / "bin" / "terngrad-launch"
    assert script.is_file() and os.access(script, os.X_OK)
    out = run([str(script), "-np", "2", "--network", "ethernet", "--iface", "lo", "--dry-run", "--", "python",
               "train.py"], "terngrad-launch --dry-run", env=clean_env()).stdout
    lines = out.splitlines()
    assert "export HOROVOD_TERNGRAD=1" in lines and "export NCCL_SOCKET_IFNAME=lo" in lines
    # the preflight runs with the clean venv's own python, then the training command as given
    assert lines[-2].startswith("horovodrun -np 2") and lines[-2].endswith(f"{folder}/bin/python -m "
                                                                           "horovod_terngrad.operations.preflight")
    assert lines[-1].startswith("horovodrun -np 2") and lines[-1].endswith("--gloo python train.py")


def test_metadata_states_licence_python_floor_extras_and_entry_point(venv):
    _, py = venv
    code = ("import importlib.metadata as m, json; d = m.distribution('horovod-terngrad'); md = d.metadata;"
            "print(json.dumps({'license': md.get('License-Expression') or md.get('License'),"
            "'requires_python': md['Requires-Python'], 'extras': md.get_all('Provides-Extra'),"
            "'classifiers': md.get_all('Classifier'), 'files': [str(f) for f in d.files],"
            "'scripts': [e.value for e in d.entry_points if e.group == 'console_scripts']}))")
    meta = json.loads(run([py, "-c", code], "metadata", cwd="/", env=clean_env()).stdout)
    assert meta["license"] == "Apache-2.0" and meta["requires_python"] == ">=3.10"
    assert {"cuda", "cuda12", "cuda13", "horovod", "lightning", "transformers", "test"} <= set(meta["extras"])
    assert meta["scripts"] == ["horovod_terngrad.operations.launcher:main"]
    assert "Programming Language :: Python :: 3.11" in meta["classifiers"]
    assert any(f.endswith("licenses/LICENSE") for f in meta["files"]) and any(f.endswith("NOTICE") for f in meta["files"])


def test_ddp_hook_and_fsdp2_train_with_terngrad_adamw_in_the_clean_venv(venv, tmp_path):
    folder, py = venv
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NP), WORKER, str(tmp_path)],
        "torchrun clean_venv.py", timeout=300, cwd=str(tmp_path), env=clean_env())
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(NP)]
    for r in ranks:
        print(f"rank {r['rank']}: package {r['package_file']}, horovod importable: {r['horovod_found']}; "
              + "; ".join(f"{fe}: losses {[round(x, 4) for x in r[fe].get('losses', [])]}, checksum "
                          f"{r[fe].get('checksum')}, {r[fe].get('bits_per_element', 0):.3f} bits/element, AdamW "
                          f"ternary steps {r[fe].get('adam_ternary_steps')}" for fe in ("ddp", "fsdp")))
    for r in ranks:
        assert r["size"] == NP and r["prefix"] == str(folder) and not r["horovod_found"]
        assert r["package_file"].startswith(str(folder))
        for frontend in ("ddp", "fsdp"):
            res = r[frontend]
            assert "crash" not in res, f"{frontend} rank {r['rank']}:\n{res.get('crash')}"
            assert res["finite"] and len(res["losses"]) == 5
            # the two weights of >= 1024 elements were ternarized on each of the 5 steps, and AdamW took
            # TernGrad's path for them (5 ternary steps each) and torch's for the other 4 parameters
            assert res["tensors"] == 10 and 2.0 <= res["bits_per_element"] < 2.1
            assert res["adam_ternary_steps"] == [0, 0, 0, 0, 5, 5]
    for frontend in ("ddp", "fsdp"):
        assert ranks[0][frontend]["checksum"] == ranks[1][frontend]["checksum"], f"{frontend}: ranks' parameters differ"
        assert ranks[0][frontend]["losses"] != ranks[1][frontend]["losses"]      # each rank trained on its own data


def test_the_release_files_are_there():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 The horovod-terngrad authors" in open(os.path.join(ROOT, "NOTICE")).read()
    changelog = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    assert "## [Unreleased]" in changelog and "## [0.1.0]" in changelog
    manifest = open(os.path.join(ROOT, "MANIFEST.in")).read()
    assert all(name in manifest for name in ("LICENSE", "NOTICE", "CHANGELOG.md"))
