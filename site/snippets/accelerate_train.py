# accelerate launch --cpu --num_processes 2 accelerate_train.py
#   or: torchrun --standalone --nproc_per_node 2 accelerate_train.py
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.optim import AdamW          # the Adam recipe; for SGD keep torch.optim.SGD

accelerator = Accelerator(cpu=not torch.cuda.is_available())   # also dynamo_backend="inductor"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(640, 784), torch.randint(0, 10, (640,)))
loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
model, opt, loader = accelerator.prepare(model, opt, loader)
# DistributedDataParallelKwargs(comm_hook=...) takes only PyTorch's built-in hooks: register on the prepared
# model (a DDP object, or torch.compile's wrapper of one), on every rank
state = tg_ddp.register(model)

for x, y in loader:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
if accelerator.is_main_process:
    print(f"loss {loss.item():.3f}; TernGrad {state.stats}")
