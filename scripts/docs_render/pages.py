"""Which function renders which page and block, the markers a block sits between, and every page as rendered."""
from __future__ import annotations

import functools
import os

from .adam import ADAM_SCALE_TAGS, _adam_table, block_adam, block_adam_tables
from .choosing import block_choosing
from .cluster import (CLUSTER_WORKLOAD, CLUSTER_WORKLOAD_FIXED, block_cluster_regime, block_cluster_released,
                      block_cluster_many_hosts, block_cluster_released_n4, block_cluster_workload,
                      block_link_measurement)
from .common import ROOT
from .ddp import block_ddp_bench, block_ddp_gpt2, block_ddp_gpt2_profile, block_ddp_side_by_side, block_ddp_status
from .ddp_studies import (block_ddp_accuracy_steps, block_ddp_accuracy_wallclock, block_ddp_cifarnet_ema,
                          block_ddp_cifarnet_long)
from .fsdp import block_fsdp_lm, block_fsdp_memory, block_fsdp_scale, block_fsdp_speed
from .gpu import (block_gpu_codec_512, block_gpu_goals, block_gpu_kernels, block_gpu_steps, block_gpu_train_step,
                  gpu_checks)
from .headline import headline
from .measured import measured
from .mixed_precision import block_mp_bf16, block_mp_fp16
from .model_blocks import (block_bf16_intra, block_goal_budget, block_goals_512, block_owner_step_512,
                           block_owner_step_budget, block_paper_vs_model)
from .modelled import hsdp_break_even, modelled, paper_vs_model
from .realshapes import block_realshapes, block_realshapes_repeats
from .reference import reference_md
from .troubleshooting import block_inventory, block_warnings
from .whole_run import block_whole_run, whole_runs


BEGIN = "<!-- BEGIN rendered:{name} (scripts/render_docs.py; do not edit by hand) -->"
END = "<!-- END rendered:{name} -->"


def block_makers() -> dict:
    """(page, block name) -> the function that renders the block; the figures the blocks share (``measured()``,
    ``modelled()``, ``hsdp_break_even()``, ``headline()``) are computed once per process.  tests/test_docs.py
    renders the blocks made from the performance model's predictions apart from the others."""
    def gpu():
        return gpu_checks()[-1]

    @functools.lru_cache(maxsize=None)
    def owner_step_512():           # one block on two pages, computed once
        return block_owner_step_512(gpu())

    return {
        ("docs/gpu.md", "gpu-goals"): lambda: block_gpu_goals(gpu()),
        ("docs/gpu.md", "gpu-steps"): lambda: block_gpu_steps(gpu()),
        ("docs/gpu.md", "gpu-kernels"): lambda: block_gpu_kernels(gpu()),
        ("docs/gpu.md", "gpu-train-step"): lambda: block_gpu_train_step(gpu()),
        ("docs/perfmodel.md", "gpu-codec-512"): lambda: block_gpu_codec_512(gpu()),
        ("docs/perfmodel.md", "owner-step-512"): owner_step_512,
        ("docs/scale.md", "owner-step-512"): owner_step_512,
        ("docs/perfmodel.md", "owner-step-budget"): lambda: block_owner_step_budget(gpu()),
        ("README.md", "headline"): lambda: headline().replace("DOCS/", "docs/"),
        ("docs/index.md", "headline"): lambda: headline().replace("DOCS/", ""),
        ("docs/choosing.md", "choosing"): lambda: block_choosing(modelled(), measured()),
        ("docs/choosing.md", "whole-run"): lambda: block_whole_run(whole_runs()),
        ("docs/scale.md", "whole-run"): lambda: block_whole_run(whole_runs()),
        ("docs/ddp.md", "ddp-status"): lambda: block_ddp_status(measured()),
        ("docs/quickstart.md", "adam"): lambda: block_adam(measured()),
        ("docs/fsdp.md", "fsdp-scale"): lambda: block_fsdp_scale(hsdp_break_even(), modelled()),
        ("docs/troubleshooting.md", "inventory"): block_inventory,
        ("docs/troubleshooting.md", "warnings"): block_warnings,
        ("docs/perfmodel.md", "paper-vs-model"): lambda: block_paper_vs_model(paper_vs_model()),
        ("docs/adam.md", "adam-tables"): block_adam_tables,
        ("docs/fsdp.md", "fsdp-lm"): block_fsdp_lm,
        ("docs/scale.md", "bf16-intra"): block_bf16_intra,
        ("docs/scale.md", "cluster-many-hosts"): block_cluster_many_hosts,
        ("docs/perfmodel.md", "goals-512"): block_goals_512,
        ("docs/perfmodel.md", "goal-budget"): block_goal_budget,
        ("docs/fsdp.md", "fsdp-speed"): block_fsdp_speed,
        ("docs/fsdp.md", "fsdp-memory"): block_fsdp_memory,
        ("docs/cluster.md", "cluster-released"): block_cluster_released,
        ("docs/cluster.md", "cluster-released-n4"): block_cluster_released_n4,
        ("docs/cluster.md", "cluster-workload"): lambda: block_cluster_workload(CLUSTER_WORKLOAD),
        ("docs/cluster.md", "cluster-workload-fixed"):
            lambda: block_cluster_workload(CLUSTER_WORKLOAD_FIXED, rounds=True),
        ("docs/cluster.md", "cluster-regime-mlp"): lambda: block_cluster_regime("mlp", ("r3", "r4", "r5"), "limit"),
        ("docs/cluster.md", "cluster-regime-resnet50"): lambda: block_cluster_regime("resnet50", ("", "r2"), "flat"),
        ("docs/ddp.md", "ddp-gpt2"): block_ddp_gpt2,
        ("docs/ddp.md", "ddp-mlp"): lambda: block_ddp_bench("docs/ddp/mlp-n2-1gbit.json", True),
        ("docs/ddp.md", "ddp-resnet50"): lambda: block_ddp_bench("docs/ddp/resnet50-n2-1gbit.json", False),
        ("docs/ddp.md", "ddp-gpt2-profile"): block_ddp_gpt2_profile,
        ("docs/cluster.md", "link-measurement"): block_link_measurement,
        ("docs/mixed_precision.md", "mp-fp16"): block_mp_fp16,
        ("docs/mixed_precision.md", "mp-bf16"): block_mp_bf16,
        ("docs/realshapes.md", "realshapes"): block_realshapes,
        ("docs/realshapes.md", "realshapes-repeats"): block_realshapes_repeats,
        ("docs/ddp.md", "ddp-side-by-side"): block_ddp_side_by_side,
        ("docs/ddp.md", "ddp-accuracy-steps"): block_ddp_accuracy_steps,
        ("docs/ddp.md", "ddp-accuracy-wallclock"): block_ddp_accuracy_wallclock,
        ("docs/ddp.md", "ddp-cifarnet-long"):
            lambda: block_ddp_cifarnet_long("docs/ddp/cifarnet-long/study_cifarnet.json", "bits"),
        ("docs/ddp.md", "ddp-cifarnet-ema"): block_ddp_cifarnet_ema,
        ("docs/ddp.md", "ddp-cifarnet-lr3e-4"):
            lambda: block_ddp_cifarnet_long("docs/ddp/cifarnet-lr3e-4/study_cifarnet.json", "lr2e-4"),
    }


@functools.lru_cache(maxsize=None)
def blocks() -> dict:
    """(page, block name) -> the block's text; computed once per process."""
    return {key: make() for key, make in block_makers().items()}


def _modelling_output(argv: list) -> str:
    """What ``python -m horovod_terngrad.modelling ARGV`` prints."""
    import contextlib
    import io

    from horovod_terngrad.modelling import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    return out.getvalue()


def page_makers() -> dict:
    """rel path -> the function that renders a page generated whole."""
    return {"docs/reference.md": reference_md,
            "docs/adam/scale-table.md": lambda: _adam_table("ddp4-fp32", ADAM_SCALE_TAGS) + "\n\n",
            # the model's tables perfmodel.md includes (scripts/perfmodel_tables.sh writes the rest of docs/perfmodel/)
            "docs/perfmodel/fig5-tables.txt": lambda: _modelling_output([]),
            "docs/perfmodel/reternarized-hsdp.md": lambda: _modelling_output(["hsdp", "--markdown"])}


def insert_block(text: str, rel: str, name: str, body: str) -> str:
    """``text`` (the page ``rel``) with ``body`` between the markers of block ``name``."""
    b, e = BEGIN.format(name=name), END.format(name=name)
    if b not in text or e not in text:
        raise SystemExit(f"render_docs: {rel} lacks the markers of block {name!r}:\n{b}\n{e}")
    pre, rest = text.split(b, 1)
    _, post = rest.split(e, 1)
    # a block inside a list item keeps the item's indentation: the BEGIN marker's
    indent = pre[pre.rfind("\n") + 1:]
    if indent.strip():
        raise SystemExit(f"render_docs: {rel}: the BEGIN marker of block {name!r} must start its line")
    body = "\n".join(indent + line if line else line for line in body.split("\n"))
    return pre + b + "\n" + body + "\n" + indent + e + post


def rendered_pages() -> dict:
    """rel path -> the page's text as this script renders it."""
    pages = {rel: make() for rel, make in page_makers().items()}
    for (rel, name), body in blocks().items():
        text = pages.get(rel)
        if text is None:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        pages[rel] = insert_block(text, rel, name, body)
    return pages
