"""Independent recomputation of what the exchange must produce, from each rank's inputs."""
import torch

from horovod_terngrad import codec as C
from horovod_terngrad.config import TernGradConfig


def expected_average(grads, name, step, cfg: TernGradConfig, average=True):
    """The average every rank must get: ternary vectors recomputed from each rank's gradient."""
    N = len(grads)
    flat = [g.detach().reshape(-1).to(torch.float32) for g in grads]
    stats = [C.tensor_stats(g, cfg.bucket_size) for g in flat]
    thrs = [C.clip_threshold(st, cfg.clip_factor) for st in stats]
    local = [C.local_scalers(st, thr) for st, thr in zip(stats, thrs)]
    if cfg.shared_scaler:
        shared = torch.stack(local).amax(dim=0)
        scalers = [shared] * N
    else:
        scalers = local
    tid = C.tensor_id(name)
    n = flat[0].numel()
    acc = torch.zeros(n, dtype=torch.float32)
    ternary = []
    for r in range(N):
        t = C.ternarize(flat[r], thrs[r], scalers[r], cfg.bucket_size, C.stream_key(cfg.seed, step, tid, r))
        ternary.append(t)
        s = scalers[r]
        s = s if s.numel() == 1 else s.repeat_interleave(cfg.bucket_size)[:n]
        acc = acc + t.to(torch.float32) * s   # fp32, in rank order, as the wire format defines
    out = acc / (N if average else 1)
    return out.view(grads[0].shape).to(grads[0].dtype), ternary
