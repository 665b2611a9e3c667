# torchrun --standalone --nproc_per_node 4 fsdp_train.py      (2 "nodes" x 2 ranks on one machine)
# On a cluster: one torchrun per node, mesh (nodes, GPUs per node), init_device_mesh("cuda", ...), "nccl".
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

from horovod_terngrad import fsdp as tg_fsdp
from horovod_terngrad.optim import AdamW          # the Adam recipe; for SGD keep torch.optim.SGD

dist.init_process_group("gloo")
world = dist.get_world_size()
nodes = int(os.environ.get("NODES", "2"))         # on a real cluster: world // int(os.environ["LOCAL_WORLD_SIZE"])
mesh = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
for block in model.transformer.h:
    fully_shard(block, mesh=mesh["shard"])        # the 1-D shard mesh: FSDP reduce-scatters inside the node
fully_shard(model, mesh=mesh["shard"])
state = tg_fsdp.register(model, mesh)             # every unit's shard averaged across nodes with TernGrad
opt = AdamW(model.parameters(), lr=2e-3)

gen = torch.Generator().manual_seed(dist.get_rank())
for step in range(20):
    x = torch.randint(0, 256, (8, 64), generator=gen)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    print(f"loss {loss.item():.3f}; TernGrad {state.stats}")
dist.destroy_process_group()
