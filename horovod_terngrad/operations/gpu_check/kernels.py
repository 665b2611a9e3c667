"""The ``kernels`` step: the kernel table.  Each codec path on each target (a single tensor, or a model's gradients
cut into the frontends' fused groups): the bytes it must move per element, its GPU and wall time per call, and
the fraction of the device's copy bandwidth it reaches; and the performance model's GPU profile drawn from it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .status import OK, SKIPPED
from .timing import Timer


def traffic_formula(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """Bytes a codec kernel must move per gradient element, reads and writes counted (a copy moves 2 per byte):
    compress (statistics, then ternarize + pack: two passes over the input) 2·in_bytes + the code's bytes (1/4 in
    2bit, 1/5 in base3); decode of ``payloads`` payloads: their codes + 4 (fp32 written).  Used where the kernels'
    own ``backends.cuda.traffic`` is missing; the two agree (tests/test_gpu_check.py)."""
    code = {"2bit": 1 / 4, "base3": 1 / 5}.get(fmt)
    if code is None:
        raise ValueError(f"traffic: fmt must be '2bit' or 'base3', got {fmt!r}")
    if op == "compress":
        return 2.0 * in_bytes + code
    if op == "decode":
        return payloads * code + 4.0
    raise ValueError(f"traffic: op must be 'compress' or 'decode', got {op!r}")


def traffic(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """``horovod_terngrad.backends.cuda.traffic`` where the checkout has it, else :func:`traffic_formula`."""
    from ...backends import cuda
    fn = getattr(cuda, "traffic", None) or traffic_formula
    return float(fn(op, in_bytes=in_bytes, fmt=fmt, payloads=payloads))


# each codec path of the table: (name, op, input dtype, packing, payloads)
KERNEL_PATHS = (("compress fp32 2bit", "compress", torch.float32, "2bit", 1),
                ("compress bf16 2bit", "compress", torch.bfloat16, "2bit", 1),
                ("compress fp32 base3", "compress", torch.float32, "base3", 1),
                ("compress bf16 base3", "compress", torch.bfloat16, "base3", 1),
                ("decode N=2 2bit", "decode", torch.float32, "2bit", 2),
                ("decode N=8 2bit", "decode", torch.float32, "2bit", 8),
                ("decode N=2 base3", "decode", torch.float32, "base3", 2),
                ("decode N=8 base3", "decode", torch.float32, "base3", 8))
GOAL_OF_COPY = 0.70


@dataclass
class Target:
    """What a kernel row runs on: one tensor (``groups`` = [[n]]) or a model's compressed gradients cut into the
    frontends' fused groups (``exchange/fusion.py``), each member its own prepare / encode / decode as the
    engine runs them (``exchange/engine.py``'s ``start_group``)."""

    name: str
    groups: list            # [[numel of each member] per group], backward order
    tensors: int            # the model's tensors, compressed or not

    @property
    def elements(self) -> int:
        return sum(sum(g) for g in self.groups)

    @property
    def members(self) -> list:
        return [n for g in self.groups for n in g]


def size_target(numel: int) -> Target:
    label = f"{numel >> 20}M" if numel >= 1 << 20 else f"{numel >> 10}K"
    return Target(label, [[numel]], 1)


def model_target(label: str, shapes) -> Target:
    """``shapes`` (registration order) cut as the Horovod frontend cuts them with the default settings."""
    from ...config import TernGradConfig
    from ...exchange import fusion
    names = [n for n, _ in shapes]
    sizes = [math.prod(s) for _, s in shapes]
    plan = fusion.cut_sizes(sizes, TernGradConfig(), names)
    numel = dict(zip(names, sizes))
    groups = len(plan.groups)
    return Target(f"{label} ({len(shapes)} tensors, {groups} group{'s' if groups != 1 else ''})",
                  [[numel[n] for n in g] for g in plan.groups], len(shapes))


def reads_bf16(backend) -> bool:
    """Whether ``backend`` reads bf16 gradients itself (``BF16_INPUT``); otherwise the engine casts them to fp32
    first, and so does the table.  Never probed with a bf16 tensor: a kernel that reads fp32 would run past the
    tensor's end."""
    from ... import backends
    return backends.has_capability(backend, backends.BF16_INPUT)


def _row_head(path: tuple, target: Target) -> dict:
    name, op, dtype, fmt, n_pay = path
    return {"kernel": name, "op": op, "dtype": str(dtype).replace("torch.", ""), "fmt": fmt,
            "payloads": n_pay, "target": target.name, "elements": target.elements,
            "tensors": target.tensors, "members": len(target.members)}


def _compress_call(backend, views, keys, fmt: str, cast: bool):
    """One compress of every member, as the engine runs it (cast to fp32 first where the backend reads no bf16)."""
    def fn():
        for v, key in zip(views, keys):
            g = v.to(torch.float32) if cast else v            # the engine's cast
            prep = backend.prepare(g, 0, 2.5)
            backend.encode(g, prep.threshold, prep.scalers, 0, key, fmt)
    return fn


def _decode_call(backend, device, members, payloads: list, n_pay: int):
    """One decode of every member from ``n_pay`` copies of its payload, into a preallocated output."""
    from ...codec import packing
    gathered = [torch.cat([y] * n_pay) for y in payloads]
    walked = [packing.walk(g, n_pay) for g in gathered]
    outs = [torch.empty(n, device=device) for n in members]

    def fn():
        for g, (headers, offsets), o in zip(gathered, walked, outs):
            backend.decode(g, headers, offsets, n_pay, out=o)
    return fn


def _path_call(backend, device, target: Target, path: tuple, tensors: dict, keys: list, payloads: dict,
               direct_bf16: bool) -> tuple:
    """(the call to time, its path in words, bytes per element) of one codec path on ``target``'s members;
    ``tensors``: the members' gradients by dtype; ``payloads``: each packing's encoded members, made at the first
    decode that needs them."""
    _, op, dtype, fmt, n_pay = path
    views = tensors[dtype]
    if op == "compress":
        cast = dtype != torch.float32 and not direct_bf16
        return (_compress_call(backend, views, keys, fmt, cast),
                "cast to fp32 first" if cast else f"reads {str(dtype).replace('torch.', '')}",
                traffic("compress", in_bytes=views[0].element_size(), fmt=fmt))
    if fmt not in payloads:
        payloads[fmt] = []
        for v, key in zip(views, keys):
            prep = backend.prepare(v, 0, 2.5)
            payloads[fmt].append(backend.encode(v, prep.threshold, prep.scalers, 0, key, fmt))
    return (_decode_call(backend, device, target.members, payloads[fmt], n_pay), f"{n_pay} payloads",
            traffic("decode", fmt=fmt, payloads=n_pay))


def kernel_rows(backend, device, targets, timer: Timer, copy_gbs: float, repeat: int, budget_s: float,
                seed: int = 0) -> list[dict]:
    """One row per (codec path, target): bytes per element, GPU and wall ms per call, elements/s, GB/s moved and
    the fraction of the device's copy bandwidth.  Rows past ``budget_s`` are left out with status "skipped"."""
    from ... import codec
    t_start = time.perf_counter()
    direct_bf16 = reads_bf16(backend)
    rows = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for target in targets:
        # every member its own allocation, as every parameter's gradient is (aligned as the allocator aligns them)
        fp32 = [torch.randn(n, device=device, generator=gen) for n in target.members]
        tensors = {torch.float32: fp32, torch.bfloat16: [g.to(torch.bfloat16) for g in fp32]}
        keys = [codec.stream_key(7, 3, i, 0) for i in range(len(target.members))]
        payloads: dict = {}
        for path in KERNEL_PATHS:
            row = _row_head(path, target)
            rows.append(row)
            if time.perf_counter() - t_start > budget_s:
                row.update(status=SKIPPED, note=f"past the step's {budget_s:.0f} s")
                continue
            fn, row["path"], row["bytes_per_element"] = _path_call(backend, device, target, path, tensors, keys,
                                                                   payloads, direct_bf16)
            t = timer.measure(fn, repeat)
            n = target.elements
            gbs = row["bytes_per_element"] * n / t["s"] / 1e9
            row.update(status=OK, gpu_ms=None if t["gpu_s"] is None else 1e3 * t["gpu_s"],
                       wall_ms=1e3 * t["wall_s"], queued=t["queued"], gelem_s=n / t["s"] / 1e9, gbs=gbs,
                       of_copy=gbs / copy_gbs)
            del fn
        del fp32, tensors, payloads
    return rows


def codec_profile(rows: list[dict], device_name: str) -> dict | None:
    """The performance model's GPU profile from the kernel table: elements/s of the fp32 2bit compress and of the
    2-payload decode (per element written), on the largest single tensor measured."""
    def best(kernel):
        ok = [r for r in rows if r["kernel"] == kernel and r.get("status") == OK and r["tensors"] == 1]
        return max(ok, key=lambda r: r["elements"]) if ok else None
    c, d, d8 = best("compress fp32 2bit"), best("decode N=2 2bit"), best("decode N=8 2bit")
    if c is None or d is None:
        return None
    prof = {"device": device_name, "compress_elements_per_s": 1e9 * c["gelem_s"],
            "decode_elements_per_s": 1e9 * d["gelem_s"],
            "source": f"gpu_check kernel table: compress fp32 2bit and decode N=2 2bit on {c['target']} elements"}
    if d8 is not None:
        prof["decode8_elements_per_s"] = 1e9 * d8["gelem_s"]
    return prof


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def kernel_table(krows: list[dict]) -> str:
    """The kernel table's Markdown (also what docs/gpu.md renders from the JSON)."""
    lines = ["| kernel | target | elements | bytes/element | GPU ms | wall ms | Gelem/s | GB/s moved | of copy "
             f"| ≥ {GOAL_OF_COPY:.0%} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in krows:
        head = f"| {r['kernel']} ({r.get('path', '')}) | {r['target']} | {r['elements']:,} |"
        if r.get("status") != OK:
            lines.append(head + f" {r.get('bytes_per_element', '-')} | {r.get('note', r.get('status'))} "
                         "| | | | | |")
            continue
        lines.append(head + f" {r['bytes_per_element']:.3g} | {_ms(r['gpu_ms'])} | {_ms(r['wall_ms'])} "
                     f"| {r['gelem_s']:.2f} | {r['gbs']:.1f} | {r['of_copy']:.0%} "
                     f"| {'yes' if r['of_copy'] >= GOAL_OF_COPY else 'no'} |")
    return "\n".join(lines)
