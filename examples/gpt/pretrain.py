"""Pretrain the example GPT the way larger production scripts do, for `ampscope run`.

    python pretrain.py --max_iters=20
    ampscope run --device cuda --flops pretrain.py

Beyond train.py, it has what such scripts carry around their step: the device picked with
`torch.accelerator`; a tokenizer table (the byte length of every token, for a bits-per-byte
metric) loaded with `torch.load(map_location=device)`; an evaluation of the loss under
`torch.no_grad()` and a few sampled tokens (from a seeded generator on the device) before the
first step and every `eval_interval` steps; gradient accumulation with a GradScaler; TF32
matmuls switched on; the learning rate set by hand each step.

Settings are module-level names, overridden by `--name=value` arguments. The data (uint16 token
ids in `train.bin`) and the tokenizer table (`vocab.pt`) are written to --data_dir when absent.
"""

import math
import os
import sys

import numpy as np
import torch
from model import GPT, GPTConfig

# -- settings, overridable as --name=value
data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
batch_size = 4
block_size = 64
gradient_accumulation_steps = 4
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 512
max_iters = 10
eval_interval = 5
eval_iters = 2
sample_tokens = 4
learning_rate = 6e-4
warmup_iters = 2
grad_clip = 1.0
dtype = "float16"  # with a GradScaler, as on GPUs without bf16; bfloat16 needs none

for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        raise ValueError(f"unknown setting {key!r}")
    old = globals()[key]
    globals()[key] = value if isinstance(old, str) else type(old)(eval(value))

device = (torch.accelerator.current_accelerator() if torch.accelerator.is_available()
          else torch.device("cpu"))
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

os.makedirs(data_dir, exist_ok=True)
data_path = os.path.join(data_dir, "train.bin")
if not os.path.exists(data_path):
    np.random.default_rng(0).integers(0, vocab_size, 20_000, dtype=np.uint16).tofile(data_path)
vocab_path = os.path.join(data_dir, f"vocab{vocab_size}.pt")
if not os.path.exists(vocab_path):
    torch.save(torch.randint(1, 8, (vocab_size,), dtype=torch.int32), vocab_path)
token_bytes = torch.load(vocab_path, map_location=device)


def get_batch():
    data = np.memmap(data_path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                     for i in ix])
    if device.type == "cpu":
        return x, y
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def autocast():
    return torch.autocast(device_type=device.type, dtype=ptdtype, enabled=dtype != "float32")


@torch.no_grad()
def estimate_loss(model):
    model.eval()
    losses, nbytes = [], 0
    for _ in range(eval_iters):
        x, y = get_batch()
        with autocast():
            _, loss = model(x, y)
        losses.append(loss.item())
        nbytes += int(token_bytes[y].sum())
    model.train()
    return sum(losses) / len(losses), nbytes


@torch.no_grad()
def sample(model, generator):
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    for _ in range(sample_tokens):
        with autocast():
            logits, _ = model(idx[:, -block_size:])
        probs = torch.softmax(logits[:, -1, :].float(), dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
    return idx


def lr_at(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    return learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, it / max_iters)))


model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                      n_head=n_head, n_embd=n_embd)).to(device)
scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95),
                              weight_decay=0.1, fused=device.type == "cuda")
generator = torch.Generator(device=device).manual_seed(42)

for it in range(max_iters):
    if it % eval_interval == 0:
        loss, nbytes = estimate_loss(model)
        print(f"iter {it}: eval loss {loss:.4f} over {nbytes:,} bytes; "
              f"sample {sample(model, generator).shape[1]} tokens")
    for group in optimizer.param_groups:
        group["lr"] = lr_at(it)
    for _ in range(gradient_accumulation_steps):
        x, y = get_batch()
        with autocast():
            _, loss = model(x, y)
        scaler.scale(loss / gradient_accumulation_steps).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item():.4f}, lr {lr_at(it):.2e}")
