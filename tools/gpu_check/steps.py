"""The reference model's training step, measured: GPT-2 124M (ampscope's built-in `gpt2`, random
weights) at batch 16 × 1024 tokens in the built-in settings, with its time and the allocator's
allocated and reserved peaks.

The step is what ampscope's train workload runs and predicts: AdamW (GPT-2's hyperparameters,
PyTorch's default implementation for the device), forward and loss under the setting's autocast,
backward, optimizer step; the parameters in the setting's dtype and float32 matmuls in its
precision. Two peaks are kept: the first step's (a fresh model and optimizer, as a predicted
step is: AdamW makes its moments inside it) and the steady one over the timed steps (moments
live throughout, gradients set to None between steps).
"""

from __future__ import annotations

import torch

import ampscope
from ampscope.models import resolve
from gpu_check.timing import Box, Clock, free_memory, is_oom, log, matmul_precision

SETTINGS = ("fp32", "fp32+tf32", "fp32+amp-bf16", "bf16")
MODEL, BATCH, SEQ = "gpt2", 16, 1024
TINY_MODEL, TINY_BATCH, TINY_SEQ = "gpt2-tiny", 2, 16


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (tied weights, ids and targets sharing
    one storage: counted once, as the prediction counts them)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _peaks(device: torch.device) -> dict:
    """The allocator's peaks since the last reset (none on the CPU: it has no counters)."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device)}


def _first_step_peaks(device: torch.device, before: tuple[int, int], own: int) -> dict:
    """The first step's peaks, the allocated one as the prediction counts it: the step's own
    allocations on top of the weights and the batch (`own` bytes), without what others held
    when it started (`before`: allocated, reserved; cuBLAS's workspaces, made by the earlier
    parts, live through the whole run). The raw counters are kept beside it."""
    peaks = _peaks(device)
    if peaks["allocated"] is None:
        return peaks
    return {"allocated": peaks["allocated"] - before[0] + own, "reserved": peaks["reserved"],
            "raw_allocated": peaks["allocated"], "allocated_before": before[0],
            "reserved_before": before[1], "weights_and_batch": own}


def _one_setting(name: str, device: torch.device, model: str, batch: int, seq: int,
                 steps: int) -> dict:
    setting = ampscope.parse_setting(f"{device.type}:{name}")
    free_memory(device)  # (also what a failed try at a larger batch left cached)
    try:
        times, first_seconds, first, steady = _measured(setting, device, model, batch, seq, steps)
    finally:
        free_memory(device)  # the model and optimizer went with _measured's frame
    median = times[len(times) // 2]
    return {"setting": name, "model": model, "batch": batch, "seq": seq,
            "tokens": batch * seq, "steps": steps, "first_step_seconds": first_seconds,
            "seconds": median, "min_seconds": times[0], "max_seconds": times[-1],
            "tokens_per_s": batch * seq / median,
            "first_step_peak": first, "steady_peak": steady}


def _measured(setting: ampscope.Setting, device: torch.device, model: str, batch: int, seq: int,
              steps: int) -> tuple[list[float], float, dict, dict]:
    """The sorted step times, the first step's time and peaks, the timed steps' peaks."""
    lm = resolve(model, device=device)
    if setting.param_dtype is not None:
        lm.module.to(setting.param_dtype)
    lm.module.train()
    params = [p for p in lm.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = lm.make_batch(batch, seq, "train", torch.Generator().manual_seed(0), device=device)
    clock = Clock(device)

    def step() -> None:
        with setting.autocast():
            loss = lm.loss(data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with matmul_precision(setting.matmul_precision):
        # The cache of the model's construction is given back first: the first step then
        # starts, as a predicted one does, with only the weights and the batch held.
        free_memory(device)
        own = _storage_bytes([*lm.module.parameters(), *lm.module.buffers(), *data.values()])
        before = ((torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
                  if device.type == "cuda" else (0, 0))
        first_seconds = clock.once(step)
        first = _first_step_peaks(device, before, own)
        step()  # one more warm-up: the first step also made AdamW's moments
        clock.sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = sorted(clock.once(step) for _ in range(steps))
        steady = _peaks(device)
    return times, first_seconds, first, steady


def training_steps(device: torch.device, box: Box, *, tiny: bool,
                   settings: tuple[str, ...] = SETTINGS) -> list[dict]:
    """Each setting's median step over a few steps after two warm-ups. A batch that does not
    fit is halved until it does (the row says so); a setting past the time box is skipped."""
    model, batch, seq = (TINY_MODEL, TINY_BATCH, TINY_SEQ) if tiny else (MODEL, BATCH, SEQ)
    rows = []
    for name in settings:
        if box.over():
            rows.append({"setting": name, "model": model, "batch": batch, "seq": seq,
                         "seconds": None, "skipped": "time box spent"})
            continue
        size = batch
        while True:
            try:
                row = _one_setting(name, device, model, size, seq, steps=3 if tiny else 5)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                if not is_oom(e) or size == 1:
                    raise
                log(f"step {name}: batch {size} ran out of memory; trying {size // 2}")
                size //= 2
                continue
            break
        if size != batch:
            row["batch_reduced_from"] = batch
        rows.append(row)
        peak = row["steady_peak"]["reserved"]
        log(f"step {name}: {row['seconds'] * 1e3:.1f} ms at batch {size} × {seq}"
            + (f", reserved peak {peak / 2**30:.2f} GiB" if peak is not None else ""))
    return rows
