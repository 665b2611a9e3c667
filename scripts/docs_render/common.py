"""What every page's renderer shares: the repository's paths, the benchmarks' JSON, the examples' own
formulas (``examples/NAME.py`` as a module) and the number formats.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # the repository
DOCS = os.path.join(ROOT, "docs")


def _load(rel: str):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return json.load(f)


def _rows(rel: str) -> dict:
    return {r["config"]: r for r in _load(rel)["rows"]}


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _pct(v: float) -> str:
    return f"{v:+.1f}%"


def _pct2(v: float) -> str:
    return f"{v:+.2f}%"


def _example(name: str):
    """examples/NAME.py as a module: the benchmark's own formulas (limits, link bytes, ratios) for its tables."""
    import importlib
    path = os.path.join(ROOT, "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def _md(text: str) -> str:
    return text.replace("|", "\\|")
