"""docs/troubleshooting.md's blocks: the inventory of every raise and warning in the package, and what each
logged warning means and what to do.
"""
from __future__ import annotations

import ast
import glob
import os
import re

from .common import ROOT, _md


def _message(node) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _message(node.left) + ("" if isinstance(node.op, ast.Mod) else _message(node.right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _message(node.func.value)
    return "…"


#: Functions whose returned text the package logs elsewhere (``log.warning(msg)``, ``log.info("%s", msg)``): their
#: messages are listed under their own module, the forwarding call (whose message is a variable) is not.
LOGGED_RETURNS = {("horovod_terngrad/frontends/cpu_threads.py", "oversubscription"): "warning",
                  ("horovod_terngrad/exchange/link.py", "describe"): "log (INFO or WARNING)",
                  ("horovod_terngrad/exchange/policy.py", "statement"): "log (INFO or WARNING)"}


#: Module-level helpers that log their third argument once, at the level given as their second (``fsdp._say``).
LOG_ONCE_HELPERS = {"_say"}


def inventory() -> list[tuple[str, int, str, str]]:
    """(file, line, kind, message) for every ``raise X(...)``, every log warning / warnings.warn, every message a
    ``LOG_ONCE_HELPERS`` call logs at WARNING and every text a ``LOGGED_RETURNS`` function returns."""
    out = []
    found_returns = set()
    for path in sorted(glob.glob(os.path.join(ROOT, "horovod_terngrad", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (rel, node.name) in LOGGED_RETURNS:
                found_returns.add((rel, node.name))
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and ret.value is not None and _message(ret.value) != "…":
                        out.append((rel, ret.lineno, LOGGED_RETURNS[(rel, node.name)], _message(ret.value)))
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                fn = node.exc.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "?")
                msg = _message(node.exc.args[0]) if node.exc.args else ""
                out.append((rel, node.lineno, name, msg))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LOG_ONCE_HELPERS:
                level = node.args[1] if len(node.args) >= 3 else None
                if isinstance(level, ast.Attribute) and level.attr == "WARNING":
                    out.append((rel, node.lineno, "warning", _message(node.args[2])))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                owner = node.func.value
                oname = getattr(owner, "id", "")
                if (attr == "warn" and oname == "warnings") or (attr in ("warning", "error") and oname == "log"):
                    if not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)):
                        out.append((rel, node.lineno, "warning", _message(node.args[0]) if node.args else ""))
                elif attr == "log" and oname == "log" and len(node.args) >= 2:
                    if not isinstance(node.args[1], ast.Name):
                        out.append((rel, node.lineno, "log (INFO or WARNING)", _message(node.args[1])))
    missing = set(LOGGED_RETURNS) - found_returns
    if missing:
        raise SystemExit(f"render_docs: LOGGED_RETURNS names functions the package no longer has: {sorted(missing)}")
    return sorted(out)


def block_inventory() -> str:
    rows = sorted({(rel, kind, msg) for rel, _, kind, msg in inventory()})
    lines = [f"{len(rows)} sites. `{{…}}` stands for a value filled in at run time; `…` for a message built "
             "elsewhere.", ""]
    cur = None
    for rel, kind, msg in rows:
        if rel != cur:
            if cur is not None:
                lines.append("")
            lines += [f"**`{rel}`**", "", "| raises / logs | message |", "|---|---|"]
            cur = rel
        msg = " ".join(msg.split())
        if len(msg) > 220:
            msg = msg[:217] + "..."
        lines.append(f"| `{kind}` | {_md(msg).replace('`', '')} |")
    return "\n".join(lines)


#: What each logged warning means and what to do, keyed by (module, the start of its message as the code writes it
#: with its whitespace collapsed).  Every warning and log site of ``inventory()`` needs an entry, and every entry a
#: site: a new warning without advice, or advice for a message the code no longer writes, stops the render.
WARNING_ADVICE = [
    ("horovod_terngrad/optim/owner_step.py", "horovod_terngrad: owner-step skipped step",
     "a NaN/Inf in some rank's gradient: `OwnerStepOptimizer` skipped the step on every rank (logged once; "
     "`skipped_steps` counts them)", "find the tensor the message names, or set `on_nonfinite=\"raise\"` to "
     "stop there (under fp16's `GradScaler` an overflow is the scaler's and is not logged)"),
    ("horovod_terngrad/optim/owner_step.py", "horovod_terngrad: scaler.unscale_(OwnerStepOptimizer)",
     "the AMP clipping recipe (`scaler.unscale_(opt)` then `clip_grad_norm_`) met `OwnerStepOptimizer`: the "
     "scaler reaches only the full-precision parameters, `step()` unscales the rest", "drop the "
     "`unscale_` / `clip_grad_norm_` lines and pass `max_grad_norm=` (the averaged gradient's norm, as the "
     "recipe means)"),
    ("horovod_terngrad/backends/cpu.py", "TernGrad: fused CPU codec unavailable",
     "no C compiler or the build failed: the torch reference codec runs (same bytes, slower)", "install gcc, or set `CC`"),
    ("horovod_terngrad/backends/__init__.py", "TernGrad: CUDA kernels unavailable",
     "CuPy missing: CUDA tensors use the torch reference path (correct, slower)",
     "`bash scripts/setup.sh --cuda`, or `pip install cupy-cuda12x` / `cupy-cuda13x` (torch's CUDA major, "
     "`torch.version.cuda`)"),
    ("horovod_terngrad/backends/cuda_adam.py", "horovod_terngrad.optim: kernels/adam.cu did not build",
     "NVRTC or the driver refused the optimizer's kernel: its foreach ops run (correct, slower)",
     "report the error; check that CuPy matches the driver's CUDA (`bash scripts/setup.sh --cuda`)"),
    ("horovod_terngrad/frontends/cpu_threads.py", "TernGrad: … rank(s) on this host each run",
     "the ranks of a host run more threads than it has cores; on CPU that, not the network, sets the step time",
     "`OMP_NUM_THREADS=1` (or cores / ranks) for every rank, or `torch.set_num_threads`"),
    ("horovod_terngrad/frontends/cpu_threads.py", "TernGrad: … ranks on this host share",
     "more ranks than cores on one host (an emulated cluster on one machine, or `-np` / `--nproc_per_node` above "
     "the cores)", "at most C ranks per host; on an emulated cluster, compare against the shared-core limit "
     "([scale](scale.md))"),
    ("horovod_terngrad/exchange/policy.py", "TernGrad plan: flat,",
     "the plan, once, on rank 0, made before the first exchange: the flat exchange among the engine's ranks (INFO; "
     "WARNING where `exchange=\"auto\"` measured a link on which ternarizing does not pay)",
     "nothing (that is the choice); set another `exchange` to force TernGrad"),
    ("horovod_terngrad/exchange/policy.py", "TernGrad plan on",
     "the plan, once, on rank 0, made before the first exchange: which group sizes go node-aware, how each side "
     "travels, and the links as measured with the grid rates they are priced as (WARNING where measured, else INFO)",
     "nothing if the rates are near your fabric's; otherwise give them: `HOROVOD_TERNGRAD_GBPS` (and "
     "`HOROVOD_TERNGRAD_INTRA_GBPS`), or `terngrad-launch --gbps`"),
    ("horovod_terngrad/exchange/policy.py", "TernGrad plan: node-aware exchange off",
     "the plan: the flat exchange runs instead of the node-aware one, and why (INFO where quiet: one node or one "
     "rank per node)", "nothing, or fix the placement the message names"),
    ("horovod_terngrad/exchange/link.py", "exchange='auto':",
     "the part of the plan line saying the link `exchange=\"auto\"` measured, or the rate `HOROVOD_TERNGRAD_GBPS` "
     "gave, and whether ternarizing pays on it (where it does not, every gradient travels uncompressed)",
     "nothing (that is the choice); set another `exchange` to force TernGrad"),
    ("horovod_terngrad/exchange/link.py", "measured",
     "the measured part of the node-aware plan line (`MeasuredLinks.describe`)", "as above"),
    ("horovod_terngrad/frontends/hierarchy.py", "TernGrad: …=process_sets:",
     "process sets could not be added; world collectives carry the node-aware exchange instead",
     "nothing, or `HOROVOD_DYNAMIC_PROCESS_SETS=1` before `hvd.init()`"),
    ("horovod_terngrad/exchange/engine.py", "…; its averaged gradient is set to zero on every rank this step",
     "a NaN/Inf was zeroed, once per tensor", "with fp16 AMP use `\"propagate\"`"),
    ("horovod_terngrad/frontends/horovod.py", "TernGrad: no parameter name available",
     "Horovod's optimizer was built without `named_parameters`", "pass `named_parameters=model.named_parameters()`"),
    ("horovod_terngrad/frontends/horovod.py", "TernGrad: gradient '…' submitted again",
     "a step was abandoned half-way (an exception, a skipped `step()`); the step's groups start afresh",
     "nothing if it was intended"),
    ("horovod_terngrad/frontends/horovod.py", "TernGrad: fused groups miss",
     "some members of a fusion group sent no gradient (sparse without `sparse_as_dense`, parameters dropped from "
     "the update)", "nothing; their other members go as smaller groups"),
    ("horovod_terngrad/frontends/ddp.py", "TernGrad: a TernGradState's process group is not pickled",
     "an unpickled DDP state uses the default group", "pass `process_group=` again to a new state for a subgroup"),
    ("horovod_terngrad/frontends/fsdp.py", "TernGrad FSDP: unit '…': parameter offsets in its shard unknown",
     "a unit's flat shard could not be split per parameter: one scaler per `bucket_size` elements instead (65536 "
     "where it is 0); FSDP's own path (a 1-D mesh, one replica) is said at INFO", "nothing; `state.layout` / "
     "`state.reason` say which"),
    ("horovod_terngrad/optim/adam.py", "horovod_terngrad.optim: no ternary noise estimate came with a gradient",
     "the exchange gave no estimate (sharded, a rank in `hvd.join()`): the optimizer behaves as plain AdamW with "
     "TernGrad there", "an exchange that gives one, flat or node-aware: `\"default\"` (the allgather up to 4 ranks, "
     "the requantized exchange above), `\"allgather\"`, `\"requantized\"` or `\"auto\"` "
     "([choosing settings](choosing.md))"),
    ("horovod_terngrad/optim/adam.py", "horovod_terngrad.optim: a parameter (shape …) got a ternary gradient",
     "refresh mode: the schedule's first step was not full precision for it (e.g. resumed mid-run); its second "
     "moment starts from a ternary gradient", "nothing, or start with a warm-up"),
]


def _plain(msg: str) -> str:
    """A message with its whitespace collapsed and its run-time values (%s, %r, %d, {…}) shown as …."""
    return re.sub(r"%[srd]|\{…\}", "…", " ".join(msg.split()))


def block_warnings() -> str:
    sites = [(rel, _plain(msg)) for rel, _, kind, msg in inventory() if kind == "warning" or kind.startswith("log")]
    lines = ["| warning (start of the message, as the code writes it) | module | what it means | what to do |",
             "|---|---|---|---|"]
    covered = set()
    for rel, start, meaning, todo in WARNING_ADVICE:
        hits = [msg for r, msg in sites if r == rel and msg.startswith(start)]
        if not hits:
            raise SystemExit(f"render_docs: WARNING_ADVICE: {rel} logs no message starting {start!r}")
        covered.update((rel, msg) for msg in hits)
        shown = hits[0] if len(hits[0]) <= 90 else hits[0][:hits[0].rfind(" ", 0, 90)] + " ..."
        lines.append(f"| `{_md(shown).replace('`', '')}` | `{rel.removeprefix('horovod_terngrad/')}` | {meaning} "
                     f"| {todo} |")
    left = sorted(set(sites) - covered)
    if left:
        raise SystemExit(f"render_docs: warnings without an entry in WARNING_ADVICE: {left}")
    return "\n".join(lines)
