"""Render the generated parts of the docs from the code and from the JSON the benchmarks wrote.

    .venv/bin/python scripts/render_docs.py            # rewrite docs/reference.md and every rendered block
    .venv/bin/python scripts/render_docs.py --check    # exit 1 (and print a diff) where a page is stale

One source for every figure: the numbers in a rendered block come from ``docs/**/*.json`` (measured) or from
``horovod_terngrad.modelling`` (modelled), computed here, so two pages that show the same figure show the same
digits.  A rendered block sits between ``<!-- BEGIN rendered:NAME ... -->`` and ``<!-- END rendered:NAME -->``
in a Markdown page; everything outside the markers is written by hand.  ``docs/reference.md`` is generated whole:
the settings (``TernGradConfig``'s fields and docstring), the environment variables (found in the sources), the
optimizers' arguments (their signatures) and the command lines (their argparse parsers).
``tests/test_docs.py`` checks that the committed pages equal this script's output.  The renderers are
``scripts/docs_render/``'s modules, one per page or family of blocks; this script writes or checks the pages.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the renderers, one module per page or family of blocks (scripts/docs_render/); what tests/test_docs.py and
# tests/test_gpu_check.py use is importable from here
from docs_render.gpu import (block_gpu_codec_512, block_gpu_goals, block_gpu_kernels,  # noqa: E402,F401
                             block_gpu_steps, block_gpu_train_step, gpu_checks)
from docs_render.modelled import modelled  # noqa: E402,F401
from docs_render.pages import block_makers, blocks, insert_block, page_makers, rendered_pages  # noqa: E402,F401
from docs_render.reference import env_vars  # noqa: E402,F401


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 where a page differs")
    a = p.parse_args(argv)
    stale = []
    for rel, text in rendered_pages().items():
        path = os.path.join(ROOT, rel)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if old == text:
            continue
        stale.append(rel)
        if a.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), rel, rel + " (rendered)"))
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {rel}")
    if a.check and stale:
        print(f"render_docs: stale: {', '.join(stale)} (run: .venv/bin/python scripts/render_docs.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
