"""The kernel-level measurements of gpu_check: the device, matmul throughput, memory bandwidth and
attention, each a list of plain dicts (what the JSON keeps).

The shapes are the reference models' own: GPT-2 124M at batch 16 × 1024 tokens (16,384 rows)
and a Llama-3-8B-class layer at 8,192 tokens; `tiny=True` keeps their names at shapes a CPU runs
in milliseconds, so that the plumbing is tested without a GPU.
"""

from __future__ import annotations

import math
import platform
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_check.timing import Box, Clock, free_memory, is_oom, log, matmul_precision

# (name, M, K, N): an (M×K) @ (K×N) product. The forward shapes of each linear layer, and for
# GPT-2 also the two backward products of the widest layer (the weight gradient's K is the
# token count), which run at other efficiencies than the forward one.
MATMULS: tuple[tuple[str, int, int, int], ...] = (
    ("gpt2 c_attn", 16384, 768, 2304),
    ("gpt2 attn.c_proj", 16384, 768, 768),
    ("gpt2 c_fc", 16384, 768, 3072),
    ("gpt2 mlp.c_proj", 16384, 3072, 768),
    ("gpt2 lm_head", 16384, 768, 50257),
    ("gpt2 c_fc dgrad", 16384, 3072, 768),
    ("gpt2 c_fc wgrad", 768, 16384, 3072),
    ("llama-3-8b q_proj", 8192, 4096, 4096),
    ("llama-3-8b k_proj", 8192, 4096, 1024),
    ("llama-3-8b gate_proj", 8192, 4096, 14336),
    ("llama-3-8b down_proj", 8192, 14336, 4096),
    ("llama-3-8b lm_head", 8192, 4096, 128256),
)
TINY_MATMULS = tuple((name, max(m // 256, 8), max(k // 64, 8), max(n // 64, 8))
                     for name, m, k, n in MATMULS)

# (mode, dtype, float32 matmul precision): the four ways a matmul runs in the built-in settings.
MATMUL_MODES = (
    ("fp32", torch.float32, "highest"),
    ("tf32", torch.float32, "high"),
    ("bf16", torch.bfloat16, "highest"),
    ("fp16", torch.float16, "highest"),
)

# GPT-2 124M's attention at batch 16 × 1024: (batch, heads, tokens, head size).
ATTENTION = (16, 12, 1024, 64)
TINY_ATTENTION = (2, 2, 32, 16)
SDPA_BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION),
                 ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                 ("cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("math", SDPBackend.MATH))


def device_info(device: torch.device) -> dict:
    """What the device is, and the torch build that drives it."""
    info: dict = {"device_type": device.type, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), multiprocessors=props.multi_processor_count,
                    memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    else:
        info.update(name=platform.processor() or platform.machine(), multiprocessors=None,
                    memory_bytes=None, capability=None, threads=torch.get_num_threads())
    return info


def _repeats(clock: Clock, fn: Callable[[], object], budget: float) -> int:
    """How many timed calls fit `budget` seconds (3 to 20), from one call timed after one
    warm-up (the first call of a shape also picks its kernel)."""
    fn()
    one = clock.once(fn)
    return max(3, min(20, int(budget / max(one, 1e-6))))


def _timed_mm(clock: Clock, device: torch.device, shape: tuple[int, int, int],
              dtype: torch.dtype, precision: str, budget: float) -> tuple[float, int]:
    """Median seconds of (m×k) @ (k×n) in `dtype` and `precision`, and the calls timed."""
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    with matmul_precision(precision):
        def product() -> torch.Tensor:
            return torch.mm(a, b)
        repeats = _repeats(clock, product, budget)
        return clock.median_seconds(product, warmup=1, repeats=repeats), repeats


def matmuls(device: torch.device, box: Box, *, tiny: bool) -> list[dict]:
    """Each shape in each mode: median seconds of `torch.mm` and the TFLOP/s (2·M·K·N FLOPs)."""
    clock, rows = Clock(device), []
    shapes = TINY_MATMULS if tiny else MATMULS
    per_item = box.seconds / (len(shapes) * len(MATMUL_MODES)) / 2
    for mode, dtype, precision in MATMUL_MODES:
        for name, m, k, n in shapes:
            row: dict[str, Any] = {"name": name, "mode": mode, "m": m, "k": k, "n": n,
                                   "flops": 2 * m * k * n}
            if box.over():
                rows.append(row | {"seconds": None, "skipped": "time box spent"})
                continue
            try:
                seconds, repeats = _timed_mm(clock, device, (m, k, n), dtype, precision, per_item)
                row |= {"seconds": seconds, "tflops": row["flops"] / seconds / 1e12,
                        "repeats": repeats}
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not is_oom(e) and "not implemented" not in str(e).lower():
                    raise
                row |= {"seconds": None, "skipped": str(e).splitlines()[0][:200]}
            free_memory(device)  # (the operands went with _timed_mm's frame)
            rows.append(row)
        log(f"matmuls in {mode}: {sum(r['mode'] == mode and r['seconds'] is not None for r in rows)}"
            f" of {len(shapes)} shapes timed")
    return rows


def _bandwidth_rows(clock: Clock, device: torch.device, box: Box, nbytes: int) -> list[dict]:
    numel = nbytes // 4
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    out = torch.empty_like(a)
    rows = []
    for name, moved, fn in (("copy", 2 * nbytes, lambda: out.copy_(a)),
                            ("add", 3 * nbytes, lambda: torch.add(a, b, out=out))):
        if box.over():
            rows.append({"name": name, "bytes": moved, "seconds": None, "skipped": "time box spent"})
            continue
        seconds = clock.median_seconds(fn, warmup=3, repeats=20)
        rows.append({"name": name, "bytes": moved, "tensor_bytes": nbytes, "seconds": seconds,
                     "bytes_per_s": moved / seconds})
    return rows


def bandwidth(device: torch.device, box: Box, *, tiny: bool) -> list[dict]:
    """A copy (reads N bytes, writes N) and an elementwise add (reads 2N, writes N) of float32
    tensors of N bytes (2 GiB: far past any cache): bytes moved / median seconds."""
    rows = _bandwidth_rows(Clock(device), device, box, 4 * 2**20 if tiny else 2 * 2**30)
    free_memory(device)  # after the tensors went with the function that made them
    log("bandwidth: " + ", ".join(f"{r['name']} {r['bytes_per_s'] / 1e12:.2f} TB/s"
                                  for r in rows if r.get("bytes_per_s")))
    return rows


def handwritten_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """nanoGPT's attention without flash: scores, causal mask, softmax, weighted sum."""
    t = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def _sdpa(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def kernel(name: str) -> Callable[..., torch.Tensor]:
    """The attention of that name: an SDPA backend's ("flash", "math", …) or "handwritten"."""
    if name == "handwritten":
        return handwritten_attention
    return _sdpa(dict(SDPA_BACKENDS)[name])


class AttentionStep(nn.Module):
    """One attention call over its own q, k, v (parameters, so that backward computes all three
    gradients, and so that ampscope can trace the same module for its prediction). `forward(x)`
    (x: an unused 0-dim tensor, the batch a trace needs) returns the output, or with
    `loss=True` its sum, whose backward is the kernel's backward."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, *, loss: bool) -> None:
        super().__init__()
        self.fn, self.loss = kernel(name), loss
        self.q, self.k, self.v = (nn.Parameter(torch.randn(shape, device=device, dtype=dtype))
                                  for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fn(self.q, self.k, self.v)
        return out.sum() if self.loss else out


def attention(device: torch.device, box: Box, *, tiny: bool) -> list[dict]:
    """`attention_rows`, with the warnings that SDPA prints for each backend it cannot use
    held back (one a backend and dtype would fill the output a GPU run returns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return attention_rows(device, box, tiny=tiny)


def attention_rows(device: torch.device, box: Box, *, tiny: bool) -> list[dict]:
    """Causal attention at GPT-2's shape, forward and forward+backward (of the output's sum), for
    each SDPA backend this build and device can run and for the hand-written form, in bf16 and
    fp32. FLOPs: 4·B·H·T²·D forward (the two products over the full square), ×3 with
    backward."""
    clock, rows = Clock(device), []
    shape = TINY_ATTENTION if tiny else ATTENTION
    b, h, t, d = shape
    x = torch.zeros((), device=device)
    names = [name for name, _ in SDPA_BACKENDS] + ["handwritten"]
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for name in names:
            for direction in ("forward", "forward+backward"):
                flops = 4 * b * h * t * t * d * (3 if direction != "forward" else 1)
                row: dict[str, Any] = {"name": name, "dtype": dtype_name,
                                       "direction": direction, "shape": list(shape),
                                       "flops": flops}
                if box.over():
                    rows.append(row | {"seconds": None, "skipped": "time box spent"})
                    continue
                step = AttentionStep(name, shape, dtype, device, loss=direction != "forward")

                def call(step=step):
                    if not step.loss:
                        with torch.no_grad():
                            return step(x)
                    for p in step.parameters():  # no accumulation into the last call's grads
                        p.grad = None
                    step(x).backward()
                    return None
                try:
                    with matmul_precision("highest"):  # fp32 as the fp32 setting runs it
                        seconds = clock.median_seconds(call, warmup=2, repeats=10)
                    row |= {"seconds": seconds, "tflops": flops / seconds / 1e12}
                except RuntimeError as e:
                    # A backend this build, device or dtype lacks says so ("No available kernel").
                    row |= {"seconds": None, "skipped": str(e).splitlines()[0][:200]}
                rows.append(row)
                del step, call
        free_memory(device)
    ran = sorted({f"{r['name']} ({r['dtype']})" for r in rows if r["seconds"] is not None})
    log(f"attention: {', '.join(ran)}")
    return rows
