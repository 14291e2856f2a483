"""Train the example GPT: a GPU training script in the usual shape, for `ampscope run`.

    python train.py --batch_size=8 --max_iters=20
    ampscope run --device cuda --steps 1 train.py --batch_size=4

Settings are module-level names, overridden by `--name=value` arguments. The data is a flat
file of uint16 token ids (`train.bin` in --data_dir), memory-mapped; the script writes a small
random one there when none exists.
"""

import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
from model import GPT, GPTConfig

# -- settings, overridable as --name=value
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
batch_size = 4
gradient_accumulation_steps = 1
block_size = 64
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 512
max_iters = 10
learning_rate = 6e-4
grad_clip = 1.0
compile = False
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"

for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        raise ValueError(f"unknown setting {key!r}")
    old = globals()[key]
    globals()[key] = value if isinstance(old, str) else type(old)(eval(value))

device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type,
                                                                   dtype=ptdtype)
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True

path = os.path.join(data_dir, "train.bin")
if not os.path.exists(path):
    os.makedirs(data_dir, exist_ok=True)
    np.random.default_rng(0).integers(0, vocab_size, 20_000, dtype=np.uint16).tofile(path)


def get_batch():
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                      n_head=n_head, n_embd=n_embd))
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                              weight_decay=0.1)
if compile:
    model = torch.compile(model)

X, Y = get_batch()
for it in range(max_iters):
    t0 = time.time()
    for _ in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if device_type == "cuda":
        torch.cuda.synchronize()
    print(f"iter {it}: loss {loss.item():.4f}, {(time.time() - t0) * 1000:.0f} ms")
    if device_type == "cuda":
        print(f"max memory allocated {torch.cuda.max_memory_allocated():,} B")
