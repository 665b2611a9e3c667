"""horovod-terngrad: TernGrad gradient compression (Wen et al., NeurIPS 2017) for stock Horovod."""
from setuptools import find_packages, setup

KERNEL_SOURCES = ["*.c", "*.cu", "*.h", "*.cpp"]

setup(
    name="horovod-terngrad",
    version="0.1.0",
    description="TernGrad ternary gradient compression as a Horovod compressor",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    # The native sources live in kernels/ at the top of the repository and are installed as package data
    # at horovod_terngrad/kernels (backends/compile_cache.KERNEL_DIR).  In the checkout, and so in the
    # editable install, horovod_terngrad/kernels is a symbolic link to ../kernels: one path everywhere.
    packages=find_packages(include=["horovod_terngrad", "horovod_terngrad.*"]) + ["horovod_terngrad.kernels"],
    package_dir={"horovod_terngrad.kernels": "kernels"},
    package_data={"horovod_terngrad.kernels": KERNEL_SOURCES},
    python_requires=">=3.9",
    # torch and horovod are not listed: torch must be the build matching the user's hardware and
    # horovod must be built against it; scripts/setup.sh installs both. Listing them would let pip
    # pull a multi-GB CUDA torch or an unbuildable horovod sdist.
    install_requires=["numpy", "tqdm"],
    extras_require={
        "cuda": ["cupy-cuda12x"],
        "test": ["pytest", "pytest-timeout", "mpi4py"],
        "mpi": ["mpi4py"],
    },
)
