"""The docs: README's commands at its top, the pages scripts/render_docs.py generates equal to what is committed
(one source for every figure), no page speaking of the project's history, the quickstart's scripts valid against
the package, and the MkDocs site building in strict mode (a broken link, a missing page or snippet, a docstring the
API pages cannot render fails)."""
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

TEST_CMD = "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q -n 2 tests"
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


# What scripts/render_docs.py makes from the performance model's predictions at scale (render_docs.modelled(), the
# modelling command line's tables, the goals at 512 GPUs): most of the render's minute, so checked in the slow tier.
MODEL_PAGES = {"docs/perfmodel/fig5-tables.txt", "docs/perfmodel/reternarized-hsdp.md"}
MODEL_BLOCKS = {("README.md", "headline"), ("docs/index.md", "headline"), ("docs/choosing.md", "choosing"),
                ("docs/fsdp.md", "fsdp-scale"), ("docs/perfmodel.md", "goals-512")}


def _stale(pages: dict, blocks: dict) -> list:
    """Diffs between the committed files and what render_docs makes of ``pages`` (rel -> the function rendering the
    whole page) and ``blocks`` ((rel, name) -> the function rendering the block), a block checked as its page with
    that block rendered in: the page and every block equal is the page equal to render_docs.rendered_pages()'s."""
    def committed(rel):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            return f.read()

    got = [(rel, committed(rel), make()) for rel, make in pages.items()]
    for (rel, name), make in blocks.items():
        old = committed(rel)
        got.append((f"{rel} ({name})", old, render_docs.insert_block(old, rel, name, make())))
    stale = []
    for label, old, text in got:
        if old != text:
            diff = "".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True), label, "rendered", n=1))
            stale.append(diff[:3000])
    return stale


def test_generated_pages_equal_the_render_scripts_output():
    """docs/reference.md, docs/adam/scale-table.md and every rendered block (ddp.md's status, adam.md's tables, the
    quickstart's Adam figures, the whole-run table, the troubleshooting inventory, ...) as scripts/render_docs.py
    writes them from the code and the benchmarks' JSON; those made from the performance model: the next test."""
    pages, blocks = render_docs.page_makers(), render_docs.block_makers()
    assert MODEL_PAGES <= set(pages) and MODEL_BLOCKS <= set(blocks), "render_docs renamed a page or block"
    stale = _stale({rel: make for rel, make in pages.items() if rel not in MODEL_PAGES},
                   {key: make for key, make in blocks.items() if key not in MODEL_BLOCKS})
    assert not stale, "run .venv/bin/python scripts/render_docs.py\n" + "\n".join(stale)


@pytest.mark.slow
@pytest.mark.one_process
def test_the_performance_models_pages_and_blocks_equal_the_render_scripts_output():
    """README's and the home page's headline, the choosing tables, fsdp.md's scale text, perfmodel.md's goals at 512
    GPUs and the modelling command line's tables, as scripts/render_docs.py writes them from the performance model."""
    pages, blocks = render_docs.page_makers(), render_docs.block_makers()
    stale = _stale({rel: pages[rel] for rel in MODEL_PAGES}, {key: blocks[key] for key in MODEL_BLOCKS})
    assert not stale, "run .venv/bin/python scripts/render_docs.py\n" + "\n".join(stale)


def test_every_rendered_marker_has_its_block():
    """A ``BEGIN rendered:NAME`` marker in any page is one of render_docs.blocks(): none is left unrendered."""
    known = set(render_docs.block_makers())
    orphans = []
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True) + [os.path.join(ROOT, "README.md")]:
        rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8") as f:
            for name in re.findall(r"<!-- BEGIN rendered:([\w-]+)", f.read()):
                if (rel, name) not in known:
                    orphans.append(f"{rel}: {name}")
    assert not orphans, orphans


def test_headline_figures_are_the_same_in_readme_and_on_the_home_page():
    """The committed headline blocks (each equal to its rendering: the performance model's test above) agree, but
    for the links' folder."""
    def committed_block(rel):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        begin = text.index("<!-- BEGIN rendered:headline")
        return text[text.index("\n", begin) + 1:text.index("<!-- END rendered:headline -->")]
    readme, home = committed_block("README.md"), committed_block("docs/index.md")
    assert "fp32" in readme and readme.replace("docs/", "") == home


def test_the_usage_pages_settings_table_has_every_setting_with_its_default():
    """docs/usage.md's hand-written settings table: one row per TernGradConfig field, its default the code's."""
    import dataclasses

    from horovod_terngrad.config import TernGradConfig
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", f.read(), re.M))
    for fld in dataclasses.fields(TernGradConfig):
        assert fld.name in rows, f"docs/usage.md has no row for {fld.name}"
        default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
        shown = rows[fld.name].strip().strip("`").replace('"', "'")
        assert shown == (repr(default) if isinstance(default, str) else str(default)), (fld.name, shown, default)


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


# Words that narrate the project's history instead of saying what holds: a work stop by number ("stop 45", "this
# stop's runs"), a run by its letter ("run g", "runs i-m"), an issue by number ("issue 39", "(issue #24)"), a
# session.  History belongs in CHANGELOG.md, which is not checked.  Ordinary English passes: "run a preflight" (the
# letter a is never a label here), "the stop button", "issue order", "runs every step", "run e.g. ...".
HISTORY_WORDS = re.compile("|".join([
    r"\bstops? #?\d+",                                    # stop 45, stops 45-48
    r"\b(?:this|last|previous|an earlier) stop\b",        # this stop('s), an earlier stop
    r"\bruns? [b-z]\b(?![.'’-]\w)",                       # run g, runs k  (not "run e.g.")
    r"\bruns? [a-z]-[a-z]\b",                             # runs a-h, runs i-m
    r"\b[Ii]ssues? #?\d+",                                # issue 39, Issue #34, issues #6
    r"\([Ii]ssues?\b(?!\()",                              # (issue ...), not a call issue()
    r"\b(?:this|last|previous|other) sessions?\b",        # the last session's run
    r"\bthe issue's\b|\bthe brief(?:'s)?\b",                # the issue's goals, the brief's limit
]))
#: (path relative to the repository, text of the line) pairs allowed to match; none are needed today
HISTORY_ALLOWED: set = set()


def _history_scanned_files() -> list[str]:
    """docs/ (pages, rendered tables, the study scripts), README.md, CONTRIBUTING.md, mkdocs.yml, scripts/ (the
    renderers' package scripts/docs_render/ too), examples/, tests/ and the package's docstrings and comments;
    CHANGELOG.md is where history goes."""
    pats = ["docs/**/*.md", "docs/**/*.sh", "docs/**/*.py", "README.md", "CONTRIBUTING.md", "mkdocs.yml", "scripts/*",
            "scripts/**/*.py", "examples/**/*.py", "tests/**/*.py", "horovod_terngrad/**/*.py", "launch/*", "slurm/*"]
    files = {os.path.relpath(f, ROOT) for pat in pats for f in glob.glob(os.path.join(ROOT, pat), recursive=True)
             if os.path.isfile(f)}
    files.discard(os.path.join("tests", "test_docs.py"))     # names the patterns themselves
    return sorted(files)


def test_no_page_script_or_test_speaks_of_stops_runs_by_letter_or_issue_numbers():
    found = []
    for rel in _history_scanned_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                m = HISTORY_WORDS.search(line)
                if m and (rel, line.strip()) not in HISTORY_ALLOWED:
                    found.append(f"{rel}:{i}: '{m.group(0)}' in: {line.strip()[:160]}")
    assert not found, ("history words (say what holds now; history goes to CHANGELOG.md):\n" + "\n".join(found))


@pytest.mark.parametrize("text", ["see stop 45", "the default since stop 45", "in this stop's runs",
                                  "the figures come from run g", "runs i-m", "runs a-h used those",
                                  "Issue #34.", "(issue 39)", "issue #15's goals", "in the last session's run",
                                  "against the issue's goals", "the brief's limit"])
def test_the_history_words_pattern_catches_each_kind(text):
    assert HISTORY_WORDS.search(text), text


@pytest.mark.parametrize("text", ["runs a preflight on every rank", "run a benchmark", "the stop button",
                                  "in issue order", "return _Pending(issue(), out)", "runs every step",
                                  "run e.g. the codec benchmark", "training stops", "the whole test session",
                                  "tags a-h in docs/cluster/default/"])
def test_the_history_words_pattern_lets_ordinary_english_pass(text):
    assert not HISTORY_WORDS.search(text), text


def test_history_free_test_names():
    """Test functions are named for what they check, never for the issue or run that added them."""
    bad = []
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for name in re.findall(r"^\s*def (test_\w+)", f.read(), re.M):
                if re.search(r"(?:^|_)(?:issue|stop)_?\d+|(?:^|_)runs?_[b-z](?:_|$)", name):
                    bad.append(f"{os.path.relpath(path, ROOT)}::{name}")
    assert not bad, bad


def _pages() -> dict:
    out = {}
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True) + [os.path.join(ROOT, "README.md")]:
        with open(path, encoding="utf-8") as f:
            out[os.path.relpath(path, ROOT)] = " ".join(f.read().split())     # sentences across line breaks
    return out


def test_pages_state_the_default_exchanges_rule_as_the_code_has_it():
    """Where a page says how far the default runs the allgather ("up to 4 ranks") or from where the requantized
    exchange ("above 4 ranks"), the number is exchange.policy.DEFAULT_ALLGATHER_MAX_RANKS."""
    from horovod_terngrad.exchange import policy
    unit = r"(?:ranks|nodes|replicas|ranks or nodes)"
    pats = [re.compile(r"allgather[^.;]{0,40}?\b(?:up to|among up to|to) (\d+) " + unit),
            re.compile(r"requantized[^.;]{0,40}?\b(?:above|more than|beyond|among more than) (\d+) " + unit),
            re.compile(r"(?:above|more than|beyond) (\d+) " + unit + r"[^.;]{0,30}?\brequantized")]
    wrong = []
    for rel, text in _pages().items():
        for pat in pats:
            for m in pat.finditer(text):
                if int(m.group(1)) != policy.DEFAULT_ALLGATHER_MAX_RANKS:
                    wrong.append(f"{rel}: ...{m.group(0)}...")
    assert not wrong, wrong


def test_no_page_says_the_node_aware_exchange_gives_no_noise_estimate():
    """The node-aware exchange hands horovod_terngrad.optim its cross stage's noise estimate (exchange/hierarchical.py,
    want_noise): no page may say otherwise, or advise hierarchical=False to get one."""
    with open(os.path.join(ROOT, "horovod_terngrad", "exchange", "hierarchical.py"), encoding="utf-8") as f:
        assert "want_noise" in f.read()
    bad = re.compile(r"(?:node-aware|hierarchical)[^.]{0,80}?(?:no noise estimate|without (?:a|its|the) "
                     r"(?:noise )?estimate|gives? (?:it )?none)|hierarchical=False[^.]{0,60}?(?:AdamW|noise estimate)",
                     re.I)
    found = [f"{rel}: {m.group(0)}" for rel, text in _pages().items() for m in bad.finditer(text)]
    assert not found, found


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


@pytest.mark.slow
@pytest.mark.one_process
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
