"""The docs: README's commands at its top, the pages scripts/render_docs.py generates equal to what is committed
(one source for every figure), the quickstart's scripts valid against the package, and the MkDocs site building in
strict mode (a broken link, a missing page or snippet fails)."""
from __future__ import annotations

import ast
import difflib
import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import render_docs  # noqa: E402

TEST_CMD = "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q tests"
DEMO_CMD = ("bash scripts/setup.sh && .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python "
            "examples/mnist_lenet.py --epochs 2")


def _readme() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read().splitlines()


def test_readme_opens_with_the_two_commands_and_stays_short():
    lines = _readme()
    assert lines[:8] == ["# horovod-terngrad", "", "```bash", DEMO_CMD, "```", "```bash", TEST_CMD, "```"]
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_readme_links_resolve():
    text = "\n".join(_readme())
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(target)
    assert not missing, missing


def test_generated_pages_equal_the_render_scripts_output():
    """docs/reference.md and every rendered block (README's and the home page's headline figures, the choosing
    table, ddp.md's status, fsdp.md's scale text, the troubleshooting inventory) as scripts/render_docs.py writes
    them from the code, the benchmarks' JSON and the performance model."""
    stale = []
    for rel, text in render_docs.rendered_pages().items():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            old = f.read()
        if old != text:
            diff = "".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True), rel, "rendered", n=1))
            stale.append(diff[:3000])
    assert not stale, "run .venv/bin/python scripts/render_docs.py\n" + "\n".join(stale)


def test_headline_figures_are_the_same_in_readme_and_on_the_home_page():
    blocks = render_docs.blocks()
    assert blocks[("README.md", "headline")].replace("docs/", "") == blocks[("docs/index.md", "headline")]


def test_reference_lists_every_setting_and_environment_variable():
    import dataclasses

    from horovod_terngrad.config import TernGradConfig
    with open(os.path.join(ROOT, "docs", "reference.md"), encoding="utf-8") as f:
        ref = f.read()
    for fld in dataclasses.fields(TernGradConfig):
        assert f"| `{fld.name}` |" in ref, fld.name
    for name in render_docs.env_vars():
        assert f"| `{name}` |" in ref, name
    for flag in ("--network", "--no-terngrad", "--dry-run", "--scheduled", "--fusion-numel", "--workers"):
        assert f"`{flag}`" in ref, flag


SNIPPETS = sorted(glob.glob(os.path.join(ROOT, "docs", "snippets", "*.py")))


@pytest.mark.parametrize("path", SNIPPETS, ids=os.path.basename)
def test_quickstart_scripts_parse_and_import_what_exists(path):
    """Each quickstart script compiles, and every name it imports from horovod_terngrad exists (they were run on
    CPU ranks when written; running them here would cost minutes of the suite)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    compile(tree, path, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("horovod_terngrad"):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{os.path.basename(path)}: from {node.module} import {alias.name}"
    with open(os.path.join(ROOT, "docs", "quickstart.md"), encoding="utf-8") as f:
        assert f'--8<-- "snippets/{os.path.basename(path)}"' in f.read()


def test_mkdocs_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="bash scripts/setup.sh --test installs mkdocs and mkdocs-material")
    pytest.importorskip("material", reason="bash scripts/setup.sh --test installs mkdocs-material")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                        "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for page in ("index.html", "quickstart/index.html", "choosing/index.html", "usage/index.html",
                 "troubleshooting/index.html", "reference/index.html", "performance/index.html"):
        assert (site / page).exists(), page
    quick = (site / "quickstart" / "index.html").read_text(encoding="utf-8")
    assert "tg_fsdp.register" in quick and "optimizer_cls_and_kwargs" in quick   # the snippets were included
