"""The ``2 ranks`` step: two processes on the one device (gloo), the DDP hook and ``horovod_terngrad.optim.AdamW``
for a few steps; each rank writes its losses and a checksum of its parameters."""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
import zlib

import torch


def _two_rank_worker(rank: int, world: int, init_file: str, device_type: str, steps: int, out_dir: str) -> None:
    """One of the 2 ranks: the DDP hook and TernGrad's AdamW on a small MLP, on the one device (gloo)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ... import ddp as tg_ddp
    from ...optim import AdamW
    result = {"rank": rank}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(0)                                           # the same initial parameters on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
        ddp = DDP(model, device_ids=[0] if device_type == "cuda" else None)
        state = tg_ddp.register(ddp, min_numel=4096)
        opt = AdamW(ddp.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(100 + rank)                # each rank its own data
        losses, t0 = [], time.perf_counter()
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=gen).to(device), torch.randint(0, 8, (32,), generator=gen).to(device)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        code = 0
        for p in model.parameters():
            code = zlib.crc32(p.detach().cpu().numpy().tobytes(), code)
        result.update(losses=losses, checksum=code, ms_per_step=1e3 * elapsed / steps,
                      bits_per_element=state.stats.bits_per_element(), tensors=state.stats.tensors)
        dist.barrier()
    except Exception:  # noqa: BLE001 - the error is this step's result
        result["error"] = traceback.format_exc(limit=4)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def two_ranks(device_type: str, steps: int = 10, timeout_s: float = 120) -> dict:
    """Spawn 2 processes on this machine's one device and return their results (rank order)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="tg_gpu_check_") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_two_rank_worker, args=(r, 2, init_file, device_type, steps, tmp))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:
            return {"error": f"the 2 ranks did not finish in {timeout_s:.0f} s"}
        ranks = []
        for r in range(2):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                return {"error": f"rank {r} exited with {procs[r].exitcode} before writing its result"}
            with open(path) as f:
                ranks.append(json.load(f))
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0].strip().splitlines()[-1], "trace": errors[0]}
    return {"ranks": ranks}
