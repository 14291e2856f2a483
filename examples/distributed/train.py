"""Train a small decoder with FSDP2 × tensor parallelism, launched by torchrun, for
`ampscope run --nproc`.

    torchrun --nproc_per_node 4 train.py --tp=2
    ampscope run --nproc 4 --device cuda train.py --tp=2

The shape of a reference trainer for large models, at toy size: the ranks form a 2-D mesh
(`dp` × `tp`); each block's attention and MLP are split across `tp` (q/k/v and the MLP's first
projection column-wise, the output projections row-wise), then every block and the whole model
are sharded across `dp` with FSDP2, parameters gathered in bfloat16 and gradients reduced in
float32. `--checkpoint=True` recomputes each block in the backward pass.

Settings are module-level names, overridden by `--name=value` arguments. The batches are
random token ids, the same on the ranks of one `tp` group.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

# -- settings, overridable as --name=value
tp = 1
batch_size = 2
block_size = 32
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 256
steps = 3
learning_rate = 3e-4
checkpoint_blocks = False

for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        raise ValueError(f"unknown setting {key!r}")
    old = globals()[key]
    globals()[key] = value if isinstance(old, str) else type(old)(eval(value))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=False)
        self.o = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # Under tensor parallelism each rank holds n_head / tp heads: -1 finds them.
        q, k, v = (p(x).view(B, T, -1, n_embd // n_head).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(n_embd)
        self.attn = Attention()
        self.norm2 = nn.RMSNorm(n_embd)
        self.up = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.down = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if checkpoint_blocks else block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, vocab_size), targets.reshape(-1))


local_rank = int(os.environ["LOCAL_RANK"])
world = int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))

torch.manual_seed(0)
model = Decoder().to(device)
if tp > 1:
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.blocks:
    fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)

generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
for step in range(steps):
    idx = torch.randint(vocab_size, (batch_size, block_size + 1), generator=generator)
    idx = idx.to(device)
    loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
