"""horovod-terngrad: TernGrad gradient compression (Wen et al., NeurIPS 2017) for Horovod, PyTorch DDP and FSDP2."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCES = ["*.c", "*.cu", "*.h", "*.cpp"]

# Supported versions.  Tested (scripts/setup.sh installs exactly these): Python 3.11, torch 2.13.0, Horovod 0.28.1,
# Lightning 2.6.6, transformers 5.23.0, Accelerate 1.15.0.  The floors are what the code needs: Python 3.10 for
# the ``X | None`` annotations evaluated at import; torch 2.6 for FSDP2's public ``torch.distributed.fsdp.
# fully_shard`` (the DDP hook and the Horovod compressor may run on older torch: untested).
HOROVOD_FLOOR = "0.28.1"


def long_description() -> str:
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


setup(
    name="horovod-terngrad",
    version="0.1.0",
    description="TernGrad ternary gradient compression for Horovod, PyTorch DDP and FSDP2",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE", "NOTICE"],
    # The native sources live in kernels/ at the top of the repository and are installed as package data
    # at horovod_terngrad/kernels (backends/compile_cache.KERNEL_DIR).  In the checkout, and so in the
    # editable install, horovod_terngrad/kernels is a symbolic link to ../kernels: one path everywhere.
    packages=find_packages(include=["horovod_terngrad", "horovod_terngrad.*"]) + ["horovod_terngrad.kernels"],
    package_dir={"horovod_terngrad.kernels": "kernels"},
    package_data={"horovod_terngrad.kernels": KERNEL_SOURCES},
    python_requires=">=3.10",
    # torch is not listed: it must be the build matching the user's hardware (CPU, a CUDA version), and a
    # plain "torch" requirement would let pip replace it with a multi-GB default build.  Install torch >= 2.6
    # first (tested: 2.13.0).  Horovod is optional ([horovod]): the DDP hook, the FSDP2 frontend and the
    # optimizers run on torch alone (tests/test_packaging.py checks it).
    install_requires=["numpy", "tqdm"],
    extras_require={
        # CuPy for the CUDA codec, one extra per CUDA major: match torch's build (torch.version.cuda); setup.sh
        # --cuda picks it from the driver.  [cuda] is CUDA 12's, which runs on a CUDA 12 or 13 driver.
        "cuda12": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "cuda": ["cupy-cuda12x"],
        # Horovod 0.28.1's sdist must be built against the installed torch (and, for torch >= 2.1, with C++17:
        # scripts/setup.sh builds and caches that wheel); a wheel already in pip's find-links is used as is.
        "horovod": [f"horovod>={HOROVOD_FLOOR}"],
        "mpi": ["mpi4py"],
        "lightning": ["lightning>=2.6"],
        "transformers": ["transformers>=5.23", "accelerate>=1.15"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "mpi4py"],
    },
    entry_points={
        # the same program as launch/terngrad-launch in the checkout
        "console_scripts": ["terngrad-launch = horovod_terngrad.operations.launcher:main"],
    },
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: C",
        "Environment :: GPU :: NVIDIA CUDA :: 12",
        "Environment :: GPU :: NVIDIA CUDA :: 13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    keywords="terngrad gradient-compression horovod pytorch ddp fsdp distributed-training",
)
