"""The reference trainer's data: what a run is asked (`TrainConfig`, and `defaults_for` a
device) and what it reports (`StepLog` after every step, `EvalLog` after every evaluation, and
`TrainResult`, whose `to_dict()` is `ampscope train --json`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    model: str = "gpt2-tiny"
    setting: str = "fp32"  # precision setting; a DEVICE: prefix picks the device (default cpu)
    steps: int = 200  # optimizer steps; the learning-rate schedule spans them
    batch: int = 8  # B: sequences per micro-batch
    seq: int = 64  # T: tokens per sequence
    total_batch: int | None = None  # tokens per optimizer step (a multiple of B·T); None: B·T
    data: str | None = None  # a UTF-8 text file; None: CPython's bundled documentation
    tokenizer: str = "auto"  # "auto", "gpt2" or "byte" (see tokenizer.choose_tokenizer)
    val_fraction: float = 0.1
    lr: float = 6e-4  # peak learning rate (GPT-3 small's)
    min_lr_ratio: float = 0.1  # the decay ends at lr · min_lr_ratio
    warmup_steps: int = 10
    decay: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50  # 0: only before the first and after the last step
    eval_batches: int = 10
    save_every: int = 0  # 0: a checkpoint at the end only (when `out` is given)
    out: str | None = None
    compile: bool = False
    attention: str = "auto"  # sdpa kernel: "auto" (PyTorch picks), "math", or "flash"
    seed: int = 0
    sample_tokens: int = 100  # generated after training; 0: none
    prompt: str = "\n"


@dataclass(frozen=True)
class StepLog:
    step: int  # optimizer steps done, 1 for the first
    loss: float  # mean training loss over the step's micro-batches
    lr: float
    grad_norm: float  # before clipping
    seconds: float  # wall time of the step, device synchronized
    tokens_per_s: float
    mfu: float | None  # None: unknown accelerator, or the CPU


@dataclass(frozen=True)
class EvalLog:
    step: int
    val_loss: float


@dataclass
class TrainResult:
    config: TrainConfig
    setting: dict  # Setting.to_dict()
    device_name: str
    parameters: int
    tokenizer: str
    data: str
    train_tokens: int
    val_tokens: int
    tokens_per_step: int
    grad_accum: int
    flops_per_token: int
    flops_formula: str
    start_step: int = 0  # > 0 when resumed
    steps: list[StepLog] = field(default_factory=list)
    evals: list[EvalLog] = field(default_factory=list)
    sample: str | None = None
    peak_memory: int | None = None
    memory_kind: str = "n/a"
    checkpoint: str | None = None  # the last one written
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["schema"] = "ampscope.train/1"
        return data


def defaults_for(device: str) -> TrainConfig:
    """What a command trains when not told: GPT-2 124M at 16×1024 tokens under bf16 autocast
    on a GPU (the size of the classic ladder); on a CPU a tiny GPT-2 in fp32, the baseline,
    which steps in milliseconds."""
    if device == "cuda":
        return TrainConfig(model="gpt2", setting="cuda:fp32+amp-bf16", batch=16, seq=1024)
    return TrainConfig(setting=f"{device}:fp32" if device != "cpu" else "fp32")
