"""Where the native sources are, and the on-disk cache of the shared objects backends compile from them.

The native sources (C, C++, CUDA) live in ``kernels/`` at the top of the repository, beside the package.
``setup.py`` installs them as package data at ``horovod_terngrad/kernels``, and in a checkout (or an
editable install) ``horovod_terngrad/kernels`` is a symbolic link to ``../kernels``, so ``KERNEL_DIR`` is one
path, the same in every install: no search, no fallback.

Objects live under ``$HOROVOD_TERNGRAD_CACHE/cpu`` (default ``~/.cache/horovod-terngrad/cpu``), named by
a hash of their sources, flags and anything else the caller says they depend on, and are written under a
temporary name then renamed: ranks starting together on one host compile an object at most a few times
and never load a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile

#: The native sources: ``horovod_terngrad/kernels`` (package data from ``kernels/``; a link to it in a checkout).
KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def kernel_source(name: str) -> str:
    """Path of the native source ``name`` (e.g. ``"terngrad.cu"``); raises if an install lacks it."""
    path = os.path.join(KERNEL_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"horovod-terngrad: native source {path} is missing (kernels/ is installed as "
                                "package data at horovod_terngrad/kernels; reinstall the package)")
    return path


def cache_dir() -> str:
    """The directory the compiled objects are cached in."""
    return os.path.join(os.environ.get("HOROVOD_TERNGRAD_CACHE",
                                       os.path.join(os.path.expanduser("~"), ".cache", "horovod-terngrad")),
                        "cpu")


def compile_cached(compiler: str, flags: list, main_source: str, hashed_sources: list, prefix: str,
                   extra_tag: str = "") -> str:
    """Compile ``main_source`` into a shared object in the cache, keyed by a hash of the sources, the
    flags and ``extra_tag``; returns its path.  The file is written under a temporary name and renamed,
    so processes compiling at the same time never load a half-written object."""
    digest = hashlib.sha256(repr((flags, extra_tag)).encode())
    for path in hashed_sources:
        with open(path, "rb") as f:
            digest.update(f.read())
    out_dir = cache_dir()
    so = os.path.join(out_dir, f"{prefix}-{digest.hexdigest()[:16]}.so")
    if os.path.exists(so):
        return so
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        p = subprocess.run([compiler, *flags, main_source, "-o", tmp], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {main_source}:\n{p.stderr[-3000:]}")
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so
