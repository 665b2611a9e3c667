"""One check of a GPU machine, in one call (scripts/gpu_check.sh), printing one table.

    python -m horovod_terngrad.operations.gpu_check               # on a GPU; a CPU dry run where there is none
    python -m horovod_terngrad.operations.gpu_check --dry-run     # the CPU dry run, GPU or not

Steps, each one row of the table:

1. ``tests``: the CUDA tests of the checkout (tests/test_kernels.py, tests/test_backends.py,
   tests/test_cuda_nosync.py, tests/test_adam_kernel.py (the optimizer's kernel against its host build), and
   tests/test_golden.py's CUDA tests: every exchange's pinned bytes and averages
   from CUDA tensors, and the default above 4 ranks against the CPU) under pytest.  Dry run: test_kernels.py (its
   CUDA sources built for the host) and test_cuda_nosync.py, whose CUDA tests skip.
2. ``identity <model>``: byte identity of the device backend against a CPU backend on a model's real tensor
   shapes (GPT-2 in GPT2LMHeadModel's layout, ResNet-50 in torchvision's): per tensor, two ranks' statistics,
   encoded payloads (both packings) and the decode of both payloads must be bit for bit the same.  On a GPU: the
   CUDA backend (CuPy kernels, or the torch reference on the GPU where CuPy is missing) against the fused CPU
   backend.  Dry run: the fused CPU backend against the torch reference.
3. ``kernels``: the kernel table.  Each codec path (``KERNEL_PATHS``: compress = prepare + encode of fp32 and of
   bf16 gradients, 2bit and base3; decode of 2 and of 8 payloads) on single tensors of 16M, 64M and 256M elements
   and on GPT-2 124M's and ResNet-50's gradients cut into the frontends' fused groups, one call per member as the
   engine makes them.  Per row: the bytes the kernel must move per element (``traffic``), the GPU time (CUDA
   events) and the wall time per call, elements/s, GB/s moved and the fraction of the device's copy bandwidth,
   measured in the same call (a copy of B bytes moves 2B); goal: 70%.  Dry run: the host build of the CUDA
   kernels at 64K and 256K elements, a 12 x 128 GPT-2 (148 tensors) and ResNet-50's tensors at 1/16.
4. ``optimizer``: ``horovod_terngrad.optim.AdamW``'s step on GPT-2 124M's 148 tensors with a ternary gradient and
   its noise estimate (what every frontend hands over), beside ``torch.optim.AdamW``'s fused and foreach steps.
5. ``train step``: one GPU's GPT-2 124M step (bf16 autocast, 8 x 1024 tokens; forward, backward, torch's fused
   AdamW), and what TernGrad adds: the codec at N = 8 (8 thread-ranks through ``exchange.Engine`` on the one
   device, one rank's share of the device time) plus ``optim.AdamW``'s step less torch's fused one; goal: 5%.
6. ``2 ranks``: two processes on the one device (gloo; on a GPU over CUDA tensors), the DDP hook and
   ``horovod_terngrad.optim.AdamW`` for a few steps: losses finite, the ranks' parameters identical.

A step that fails is marked FAIL (with its error) and the others still run; the exit status is 1 when any step
failed, else 0 (a CPU dry run that passes exits 0).  Every step has its share of ``--budget-s`` (``STEP_BUDGET_S``;
default 420 s, scripts/gpu_check.sh stops the whole call at 480 s): the tests, the kernel table, the thread-ranks
and the 2 ranks stop at theirs; the other steps' sizes fit theirs.  ``--json`` writes
every figure (docs/gpu/*.json; scripts/render_docs.py renders docs/gpu.md and the performance model's GPU rows from
the newest a GPU wrote).

Modules: ``check`` (the steps in order, each a named function, the JSON and the table), ``shapes`` (the models'
parameter shapes), ``timing`` (the timer, the device's copy rate and busy time), ``status`` (a step's row),
``pytest_step``, ``identity``, ``kernels`` (the kernel table), ``optimizer``, ``train_step``, ``two_ranks``, and
``cli`` (the command line; ``__main__`` runs it).
"""
from .check import DRY_RUN_PLAN, GPU_PLAN, STEP_BUDGET_S, STEPS, Plan, check, table  # noqa: F401
from .cli import main  # noqa: F401
from .identity import identity  # noqa: F401
from .kernels import (GOAL_OF_COPY, KERNEL_PATHS, Target, codec_profile, kernel_rows, kernel_table,  # noqa: F401
                      model_target, reads_bf16, size_target, traffic, traffic_formula)
from .optimizer import optimizer_step_ms  # noqa: F401
from .pytest_step import DRY_RUN_TEST_FILES, GPU_TEST_FILES, ROOT, run_tests  # noqa: F401
from .shapes import GPT2_124M, GPT2_DRY_RUN, GPT2Size, gpt2_shapes, resnet50_shapes, scaled_resnet50  # noqa: F401
from .status import FAIL, OK, SKIPPED, Row  # noqa: F401
from .timing import Timer, copy_rate, device_busy_s  # noqa: F401
from .train_step import codec_share_ms, compute_step_ms  # noqa: F401
from .two_ranks import two_ranks  # noqa: F401
