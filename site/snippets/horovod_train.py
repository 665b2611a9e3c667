# horovodrun --gloo -np 2 -H localhost:2 python horovod_train.py
import torch
import torch.nn.functional as F
import horovod.torch as hvd

from horovod_terngrad import TernGrad
from horovod_terngrad.optim import AdamW          # the Adam recipe; for SGD keep torch.optim.SGD

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = AdamW(model.parameters(), lr=1e-3)          # torch.optim.AdamW's signature and defaults
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression=TernGrad)   # or TernGrad.configure(packing="base3", ...)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)

gen = torch.Generator().manual_seed(hvd.rank())   # each rank its own data
for step in range(20):
    x, y = torch.randn(32, 784, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
if hvd.rank() == 0:
    print(f"loss {loss.item():.3f}; TernGrad {TernGrad.stats}")
