"""docs/reference.md, generated whole: the settings (``TernGradConfig``'s fields and docstring), the
environment variables (found in the sources), the optimizers' arguments (their signatures) and the command lines
(their argparse parsers).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import inspect
import os
import re

from .common import ROOT, _md


def _config_docs() -> dict:
    from horovod_terngrad.config import TernGradConfig
    doc = inspect.getdoc(TernGradConfig)
    out, cur = {}, None
    for line in doc.splitlines():
        mm = re.match(r"^(\w+):\s+(.*)$", line)
        if mm and mm.group(1) in {f.name for f in dataclasses.fields(TernGradConfig)}:
            cur = mm.group(1)
            out[cur] = [mm.group(2)]
        elif cur and line.strip():
            out[cur].append(line.strip())
    return {k: " ".join(v) for k, v in out.items()}


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


ENV_MEANING = {
    "HOROVOD_TERNGRAD": "`0`, `off`, `false` or `no`: the compressors and hooks pass tensors through uncompressed "
                        "(a fp32 baseline without editing the script); `terngrad-launch --no-terngrad` sets it",
    "HOROVOD_TERNGRAD_BACKEND": "`torch`: use the torch reference codec everywhere instead of the fused C / CUDA "
                                "backends (same bytes; for comparisons)",
    "HOROVOD_TERNGRAD_CACHE": "where compiled codec objects (and setup.sh's Horovod wheel) are cached; default "
                              "`~/.cache/horovod-terngrad`",
    "HOROVOD_TERNGRAD_HOST": "this rank's node name for the node-aware exchange's topology (default: the host "
                             "name); set it where host names lie or to emulate nodes",
    "HOROVOD_TERNGRAD_NODE_GROUPS": "`world` (default): node and cross-node groups run as world collectives; "
                                    "`process_sets`: as Horovod process sets (needs `HOROVOD_DYNAMIC_PROCESS_SETS=1` "
                                    "before `hvd.init()` unless registered there)",
    "HOROVOD_TERNGRAD_MEASURE_LINKS": "`0`: `hierarchical=\"auto\"` prices the configured links instead of measuring "
                                      "them once before the first exchange (it measures only where "
                                      "`HOROVOD_TERNGRAD_GBPS` is unset)",
    "HOROVOD_TERNGRAD_GBPS": "the link between nodes that `exchange=\"auto\"` and `hierarchical=\"auto\"` price, "
                             "Gbit/s",
    "HOROVOD_TERNGRAD_ALPHA_US": "that link's latency per message (alpha), microseconds",
    "HOROVOD_TERNGRAD_INTRA_GBPS": "the link inside a node (per link), Gbit/s, for `hierarchical=\"auto\"`",
    "HOROVOD_TERNGRAD_INTRA_ALPHA_US": "its latency per message, microseconds",
    "HOROVOD_TERNGRAD_INTRA_LINKS": "links from each GPU to its peers inside a node (3: four GPUs fully connected "
                                    "by NVLink; 1: one PCIe port)",
    "HOROVOD_TERNGRAD_NETWORK": "set by `terngrad-launch` to the network profile it chose; the preflight prints it",
    "HOROVOD_TERNGRAD_NCCL_PREFIXES": "`scripts/setup.sh --cuda`: the system prefixes searched for NCCL (`include/nccl.h`"
                                      " and `lib*/libnccl.so*`), besides `HOROVOD_NCCL_HOME`, the CUDA toolkit and "
                                      "the venv's nvidia-nccl wheel (default `/usr /usr/local`; empty: none)",
    "HOROVOD_TERNGRAD_TORCH_INDEX": "`scripts/setup.sh --cuda`: the base URL of the wheel index the CUDA torch comes "
                                    "from, `<base>/cu130` etc. (default `https://download.pytorch.org/whl`)",
    "HOROVOD_TERNGRAD_VENV": "`scripts/setup.sh`: where to create the virtual environment (default `.venv`)",
}


def env_vars() -> dict:
    """name -> (default in the code or '', files that read it), from the sources."""
    found: dict = {}
    files = (glob.glob(os.path.join(ROOT, "horovod_terngrad", "**", "*.py"), recursive=True)
             + [os.path.join(ROOT, "launch", "terngrad-launch"), os.path.join(ROOT, "scripts", "setup.sh")])
    for path in sorted(files):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        for name in set(re.findall(r"\bHOROVOD_TERNGRAD(?:_[A-Z][A-Z_0-9]*)?\b", text)):
            name = name.rstrip("_")
            d = found.setdefault(name, {"default": "", "files": set()})
            d["files"].add(rel)
            if rel.endswith("preflight.py"):      # its defaults are what it prints when a variable is unset
                continue
            # read by name, or through a module constant (NODE_GROUPS_ENV = "HOROVOD_TERNGRAD_NODE_GROUPS")
            refs = [re.escape(f'"{name}"')] + [re.escape(c) for c in
                                                re.findall(rf'^(\w+)\s*=\s*"{name}"', text, re.M)]
            for ref in refs:
                for pat in (rf'environ\.get\(\s*{ref}\s*,\s*"([^"]*)"', rf'_env_number\(\s*{ref}\s*,\s*"([^"]*)"'):
                    mm = re.search(pat, text)
                    if mm:
                        d["default"] = mm.group(1)
            mm = re.search(rf'\$\{{{name}:-([^}}]*)\}}', text)
            if mm:
                d["default"] = mm.group(1)
    return found


def _launcher_env() -> dict:
    from horovod_terngrad.operations import launcher
    # the profiles' own values: given={} leaves out whatever rate this shell (or the test run) exported
    return {p: launcher.network_env(p, "eth0" if p == "ethernet" else None, ["mlx5_0:1"], True, given={})
            for p in ("infiniband", "ethernet")}


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _capture_parser(fn, argv):
    """The ArgumentParser ``fn(argv)`` builds, caught at its parse_args (nothing runs)."""
    orig = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        raise _Parsed(self)
    argparse.ArgumentParser.parse_args = grab
    try:
        fn(argv)
    except _Parsed as e:
        return e.parser
    finally:
        argparse.ArgumentParser.parse_args = orig
    raise RuntimeError(f"{fn} built no parser")


def _parser_table(p: argparse.ArgumentParser) -> list[str]:
    lines = ["| option | default | choices | help |", "|---|---|---|---|"]
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        opts = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}` (positional)"
        default = "" if a.default is None or a.default is argparse.SUPPRESS else f"`{a.default!r}`"
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and a.option_strings and \
                a.option_strings[-1].lstrip("-").replace("-", "_") != a.dest:
            default = f"sets `{a.dest}` to `{a.const!r}` (default `{a.default!r}`)"
        choices = ", ".join(f"`{c}`" for c in a.choices) if a.choices else ""
        lines.append(f"| {opts} | {default} | {choices} | {_md(a.help or '')} |")
    return lines


def _settings_section() -> list[str]:
    """The page's head and ``TernGradConfig``'s table: every field, its default and its entry in the docstring."""
    from horovod_terngrad.config import TernGradConfig
    out = ["# Reference", "",
           "<!-- Generated by scripts/render_docs.py from the code; do not edit by hand "
           "(tests/test_docs.py checks it). -->", "",
           "Every setting, environment variable, optimizer argument and command-line flag, as the code defines them. "
           "Which to choose: [choosing settings](choosing.md); what goes wrong: [troubleshooting](troubleshooting.md).",
           "", "## Settings: `TernGradConfig`", "",
           "`horovod_terngrad.TernGradConfig` (`horovod_terngrad/config.py`). Give them to "
           "`TernGrad.configure(...)` (Horovod), `horovod_terngrad.ddp.register(model, ...)` / `TernGradState(...)` "
           "(DDP) or `horovod_terngrad.fsdp.register(model, mesh, ...)` (FSDP2) as keyword arguments.", "",
           "| setting | default | meaning (the class docstring) |", "|---|---|---|"]
    docs = _config_docs()
    for f in dataclasses.fields(TernGradConfig):
        if f.name not in docs:
            raise SystemExit(f"render_docs: TernGradConfig.{f.name} has no entry in the class docstring")
        out.append(f"| `{f.name}` | `{_default(f)}` | {_md(docs[f.name])} |")
    return out


def _env_section() -> list[str]:
    """The environment variables the sources read (``env_vars``), with what ``terngrad-launch`` sets per network
    profile, then the other variables it sets for the job."""
    out = ["", "## Environment variables", "",
           "Found in the sources (`horovod_terngrad/`, `launch/terngrad-launch`, `scripts/setup.sh`); the default is "
           "the one the code uses when the variable is unset, and the last two columns what `terngrad-launch` sets "
           "for each network profile.", "",
           "| variable | default | `--network infiniband` | `--network ethernet` | meaning | read in |",
           "|---|---|---|---|---|---|"]
    lenv = _launcher_env()
    for name, d in sorted(env_vars().items()):
        if name not in ENV_MEANING:
            raise SystemExit(f"render_docs: {name} is read by {sorted(d['files'])} but ENV_MEANING does not explain it")
        ib, eth = lenv["infiniband"].get(name, ""), lenv["ethernet"].get(name, "")
        out.append(f"| `{name}` | {('`' + d['default'] + '`') if d['default'] else ''} | "
                   f"{('`' + ib + '`') if ib else ''} | {('`' + eth + '`') if eth else ''} | {ENV_MEANING[name]} | "
                   f"{', '.join('`' + f + '`' for f in sorted(d['files']))} |")
    out += ["", "Besides its own variables `terngrad-launch` sets these for the job (interfaces shown for "
            "`--iface eth0` and one InfiniBand port `mlx5_0:1`):", "",
            "| variable | `--network infiniband` | `--network ethernet` |", "|---|---|---|"]
    for name in sorted(set(lenv["infiniband"]) | set(lenv["ethernet"])):
        if name.startswith("HOROVOD_TERNGRAD"):
            continue
        ib, eth = lenv["infiniband"].get(name, ""), lenv["ethernet"].get(name, "")
        out.append(f"| `{name}` | {('`' + ib + '`') if ib else ''} | {('`' + eth + '`') if eth else ''} |")
    return out


#: what each argument of horovod_terngrad.optim's Adam and AdamW does beyond torch's ("as torch's" otherwise)
OPTIMIZER_ARGUMENTS = {
    "refresh": "None: the second moment corrected by the exchange's noise estimate (the default mode); a "
               "`RefreshSchedule` (or a dict of its fields): the second moment from full-precision refreshes only. "
               "Per param group.",
    "v_floor": "the corrected second moment is at least `v_floor`·v (in [0, 1]); bounds a step at 1/sqrt(v_floor) "
               "times plain Adam's",
    "fused": "as torch's; refused for ternarized parameters",
    "capturable": "as torch's; refused for ternarized parameters",
    "differentiable": "as torch's; refused for ternarized parameters"}


def _optimizer_section() -> list[str]:
    """``Adam``'s and ``AdamW``'s signatures, and ``RefreshSchedule``'s fields."""
    from horovod_terngrad.optim import Adam, AdamW, RefreshSchedule
    out = ["", "## Optimizers: `horovod_terngrad.optim`", "",
           "`Adam` and `AdamW` take `torch.optim.Adam` / `torch.optim.AdamW`'s arguments with the same defaults, "
           "plus two of their own (keyword-only). Signatures as the code has them:", ""]
    for cls in (Adam, AdamW):
        sig = inspect.signature(cls.__init__)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        out += [f"### `{cls.__name__}`", "", "| argument | default | |", "|---|---|---|"]
        for p in params:
            dflt = "" if p.default is inspect.Parameter.empty else f"`{p.default!r}`"
            what = OPTIMIZER_ARGUMENTS.get(p.name, "as torch's")
            out.append(f"| `{p.name}` | {dflt} | {what} |")
        out.append("")
    out += ["### `RefreshSchedule`", "",
            "`horovod_terngrad.optim.RefreshSchedule` (`horovod_terngrad/codec/schedule.py`): which exchanges of a "
            "tensor carry the exact average in the refresh mode: the first `warmup`, then `per_phase` refreshes "
            "`interval` apart, `per_phase` at twice that, ... up to one every `max_interval`.", "",
            "| field | default |", "|---|---|"]
    for f in dataclasses.fields(RefreshSchedule):
        out.append(f"| `{f.name}` | `{_default(f)}` |")
    return out


def _command_lines_section() -> list[str]:
    """Each command line's first paragraph of help and its options (its argparse parser, caught unrun)."""
    from horovod_terngrad.modelling import cli
    from horovod_terngrad.operations import launcher
    out = []
    for title, fn, argv in (("`terngrad-launch` (`launch/terngrad-launch`, "
                             "`python -m horovod_terngrad.operations.launcher`)", launcher.plan, ["-np", "1"]),
                            ("`python -m horovod_terngrad.modelling`", cli.main, []),
                            ("`python -m horovod_terngrad.modelling hsdp`", cli.hsdp_main, [])):
        p = _capture_parser(fn, argv)
        out += ["", f"## {title}", "", _md((p.description or "").split("\n\n")[0].strip()).replace("\n", " "), ""]
        out += _parser_table(p)
    return out


def reference_md() -> str:
    """docs/reference.md: the settings, the environment variables, the optimizers and the command lines."""
    out = _settings_section() + _env_section() + _optimizer_section() + _command_lines_section()
    return "\n".join(out) + "\n"
