"""The layers of docs/design.md, enforced: lower layers never import higher ones, and the training path
never loads the operations subpackage (benchmarks, performance model, plots) or matplotlib."""
import ast
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "horovod_terngrad")

# part of the package -> layer; a module may import its own part or parts of strictly lower layers
LAYERS = {"errors": 0, "codec": 1, "config": 2, "backends": 2, "exchange": 3, "frontends": 4,
          "optim": 4,        # optimizers that know what the exchange did (beside the frontends, not above them)
          "__init__": 4.5,   # the package's public names (TernGrad, allreduce, ...), on top of the frontends
          "ddp": 4.5,        # horovod_terngrad.ddp: the DDP frontend's public names (frontends/ddp.py)
          "fsdp": 4.5,       # horovod_terngrad.fsdp: the FSDP frontend's public names (frontends/fsdp.py)
          "integrations": 4.6,  # per-step figures in Lightning, transformers, Accelerate logs (frontends' stats)
          "modelling": 4.7,  # the step models (perfmodel, timeline, simulator, plots), on the exchange's plans
          "operations": 5}
TORCH_FREE = ("codec/sizes.py", "exchange/cost.py", "exchange/names.py", "exchange/network_env.py",
              "exchange/topology.py")


def _part(relpath: str) -> str:
    head = relpath.split(os.sep)[0]
    return head[:-3] if head.endswith(".py") else head


def _modules():
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                yield os.path.relpath(path, PKG), path


def _imports(relpath: str, path: str):
    """(imported part of horovod_terngrad or None, top-level module name, line) of every import in a file,
    module-level and inside functions alike."""
    pkg_parts = relpath.split(os.sep)[:-1]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.name.split(".")
                yield (name[1] if name[0] == "horovod_terngrad" and len(name) > 1 else None), name[0], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - (node.level - 1)] if node.level > 1 else pkg_parts
                if node.level - 1 > len(pkg_parts):
                    continue
                target = base + (node.module.split(".") if node.module else [])
                names = target[:1] if target else [a.name for a in node.names]
                for n in names:       # ``from .. import TernGrad``: a public name of the package root
                    yield (n if n in LAYERS or target else "__init__"), "horovod_terngrad", node.lineno
            else:
                name = (node.module or "").split(".")
                if name[0] == "horovod_terngrad":
                    parts = name[1:2] or [a.name for a in node.names]
                    for n in parts:
                        yield n, "horovod_terngrad", node.lineno
                else:
                    yield None, name[0], node.lineno


def test_every_module_belongs_to_a_layer():
    assert {_part(rel) for rel, _ in _modules()} <= set(LAYERS)


def test_lower_layers_never_import_higher_ones():
    bad = []
    for rel, path in _modules():
        mine = _part(rel)
        for part, _, line in _imports(rel, path):
            if part is None or part == mine:
                continue
            if part not in LAYERS:
                bad.append(f"{rel}:{line} imports unknown part {part!r}")
            elif LAYERS[part] >= LAYERS[mine]:
                bad.append(f"{rel}:{line} ({mine}, layer {LAYERS[mine]}) imports {part} (layer {LAYERS[part]})")
    assert not bad, "\n".join(bad)


def test_the_import_checker_sees_violations(tmp_path):
    """The checker itself: a relative import upwards is found, inside a function too."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from ..operations import perfmodel\nfrom .. import exchange\n")
    found = {(p, line) for p, _, line in _imports(os.path.join("codec", "x.py"), str(f))}
    assert ("operations", 2) in found and ("exchange", 3) in found


@pytest.mark.parametrize("rel", TORCH_FREE)
def test_size_and_cost_modules_need_no_torch(rel):
    """codec/sizes.py, exchange/cost.py, exchange/names.py, exchange/network_env.py and exchange/topology.py
    import nothing but the standard library and each other when they are loaded (the performance model runs without
    torch).  Inside a function that runs only on a training job's ranks (topology.py's host discovery over
    collectives) torch may be imported."""
    path = os.path.join(PKG, rel)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    in_functions = {n.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    tops = {top for part, top, line in _imports(rel, path) if part is None and line not in in_functions}
    assert tops <= {"__future__", "math", "functools", "os", "dataclasses", "typing"}, tops
    late = {top for part, top, line in _imports(rel, path) if part is None and line in in_functions}
    assert late <= {"torch", "socket", "os", "zlib"}, late
    parts = {part for part, _, _ in _imports(rel, path) if part is not None}
    assert parts <= {"codec", "exchange"}, parts
    with open(path) as f:          # which modules: only the torch-free ones of this list
        for node in ast.walk(ast.parse(f.read())):
            if isinstance(node, ast.ImportFrom) and node.level and node.lineno not in in_functions:
                folder = os.path.dirname(rel) if node.level == 1 else ""
                base = os.path.join(folder, *(node.module or "").split("."))
                if os.path.normpath(base) + ".py" in TORCH_FREE:     # ``from .names import FP32``
                    continue
                for a in node.names:      # ``from ..codec import sizes``, ``from . import topology``
                    target = os.path.normpath(os.path.join(base, a.name)) + ".py"
                    assert target in TORCH_FREE, (rel, target)


@pytest.mark.slow
@pytest.mark.one_process
def test_training_path_loads_neither_operations_nor_matplotlib():
    """A Horovod training step with TernGrad (exchange='auto', so the cost model runs) in a fresh process:
    no horovod_terngrad.operations or horovod_terngrad.modelling module and no matplotlib get imported."""
    code = (
        "import sys, torch, horovod.torch as hvd\n"
        "import horovod_terngrad as tg\n"
        "hvd.init()\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),\n"
        "                               compression=tg.TernGrad.configure(exchange='auto', min_numel=0))\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); m(torch.randn(4, 8)).sum().backward(); opt.step()\n"
        "comp = tg.TernGrad.configure(exchange='auto', min_numel=0)\n"
        "out = hvd.allreduce(torch.randn(100), name='direct', compression=comp)\n"
        "assert comp.stats.tensors == 1 and out.shape == (100,)\n"
        "print(sorted(k for k in sys.modules if k.startswith(('horovod_terngrad.operations', 'horovod_terngrad.modelling',\n"
        "                                                     'matplotlib'))))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout


ROOT = os.path.dirname(PKG)
NATIVE = (".c", ".cu", ".h", ".cpp", ".cuh")


def test_every_native_source_lives_in_the_top_level_kernels_folder():
    """kernels/ beside the package holds every C/C++/CUDA source; the package reaches it through one path
    (horovod_terngrad/kernels: a link in the checkout, package data in an install), with no fallback."""
    from horovod_terngrad.backends.compile_cache import KERNEL_DIR, kernel_source
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    native = [f for f in tracked.stdout.split() if f.endswith(NATIVE)]
    assert native and all(os.path.dirname(f) == "kernels" for f in native), native
    assert {os.path.basename(f) for f in native} >= {"terngrad.cu", "terngrad_cpu.c", "host_shim.h",
                                                      "host_launch.cpp"}
    assert os.path.realpath(KERNEL_DIR) == os.path.join(os.path.realpath(ROOT), "kernels")
    for f in native:
        assert os.path.samefile(kernel_source(os.path.basename(f)), os.path.join(ROOT, f))
    with pytest.raises(FileNotFoundError, match="no_such.cu"):
        kernel_source("no_such.cu")


@pytest.mark.slow
@pytest.mark.one_process
def test_wheel_and_sdist_carry_the_kernels(tmp_path):
    """A wheel installs kernels/ as package data at horovod_terngrad/kernels; an sdist carries kernels/."""
    import tarfile
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), ROOT], check=True, capture_output=True, cwd=tmp_path)
    wheel, = tmp_path.glob("horovod_terngrad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("terngrad.cu", "terngrad_cpu.c", "host_shim.h", "host_launch.cpp"):
        assert f"horovod_terngrad/kernels/{f}" in names, names
    assert not [n for n in names if "/native/" in n]
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], check=True,
                   capture_output=True, cwd=ROOT)
    sdist, = tmp_path.glob("horovod_terngrad-*.tar.gz")
    members = tarfile.open(sdist).getnames()
    assert any(m.endswith("/kernels/terngrad.cu") for m in members), members


def test_the_step_models_have_no_import_cycle():
    """modelling/: plots imports the model, the model never imports plots or the CLI (a cycle between
    perfmodel and plots would make importing the model load matplotlib)."""
    graph = {}
    for rel, path in _modules():
        if rel.startswith("modelling" + os.sep):
            mod = os.path.basename(rel)[:-3]
            with open(path) as f:
                tree = ast.parse(f.read())
            graph[mod] = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
                          for a in ([ast.alias(name=node.module)] if node.module else node.names)}
    for mod, deps in graph.items():
        for dep in deps & set(graph):
            assert mod not in graph[dep], f"modelling/{mod}.py and modelling/{dep}.py import each other"
    assert "plots" not in graph["perfmodel"] and "cli" not in graph["perfmodel"]
