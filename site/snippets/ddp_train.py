# torchrun --standalone --nproc_per_node 2 ddp_train.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.optim import AdamW          # the Adam recipe; for SGD keep torch.optim.SGD

dist.init_process_group("gloo")                   # "nccl" on GPUs
torch.manual_seed(0)                              # the same initial weights on every rank
model = DDP(torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
state = tg_ddp.register(model)                    # any TernGradConfig setting: tg_ddp.register(model, packing="base3")
opt = AdamW(model.parameters(), lr=1e-3)

gen = torch.Generator().manual_seed(dist.get_rank())
for step in range(20):
    x, y = torch.randn(32, 784, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()                               # the hook has averaged the gradients when this returns
    opt.step()
if dist.get_rank() == 0:
    print(f"loss {loss.item():.3f}; TernGrad {state.stats}")
dist.destroy_process_group()
