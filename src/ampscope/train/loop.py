"""The reference trainer: one training loop, readable top to bottom, like nanoGPT's train.py.

`train(config)` builds the model and the data, then runs the classic GPT recipe, each part and
why in docs/training.md ("What the trainer does").

The library never prints: `log` receives a `StepLog` after every step and an `EvalLog` after
every evaluation, and the CLI draws them. Torch's global state (matmul precision, autocast,
RNG) is set for the run and restored afterwards by its `RunEnvironment`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ampscope import hardware
from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.precision import Setting, main_dtype, parse_setting, resolve_device
from ampscope.records import dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.train import checkpoint, measure
from ampscope.train.config import EvalLog, StepLog, TrainConfig, TrainResult
from ampscope.train.data import DEFAULT_CORPUS, DataLoaderLite, load_tokens, split
from ampscope.train.tokenizer import Tokenizer, choose_tokenizer
from ampscope.workloads import RunOptions

# The run's choices for `ampscope -v` and callers' logging (`log` is the step callback here).
decisions = logging.getLogger(__name__)
DECAYS = ("cosine", "linear")
ATTENTION = ("auto", "math", "flash")
# What must be equal for a resumed run to continue the same run: the model, its weights' dtype,
# the batches it sees, and the seed they come from. The schedule may be changed on purpose (more
# steps, a lower learning rate); the result then notes that the curve is no longer the same one.
SAME_RUN = ("model", "setting", "batch", "seq", "total_batch", "data", "tokenizer",
            "val_fraction", "seed")
SAME_CURVE = ("steps", "lr", "min_lr_ratio", "warmup_steps", "decay", "weight_decay",
              "grad_clip", "attention", "compile")


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then decay to min."""
    max_lr, min_lr = config.lr, config.lr * config.min_lr_ratio
    if step < config.warmup_steps:
        return max_lr * (step + 1) / config.warmup_steps
    if step >= config.steps:
        return min_lr
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    if config.decay == "linear":
        return max_lr - progress * (max_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def configure_optimizer(model: nn.Module, config: TrainConfig, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D parameters only (nanoGPT's `configure_optimizers`).

    Decay pulls weights toward zero; that regularises matmul weights and embeddings, while a
    bias or a LayerNorm gain pulled to zero only hurts.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused CUDA kernel does the whole update in a few launches instead of several per
    # parameter; elsewhere PyTorch picks its default implementation.
    fused = True if device == "cuda" else None
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def attention_kernel(name: str) -> contextlib.AbstractContextManager:
    """Pin `scaled_dot_product_attention` to one kernel: "math" materialises the T×T scores
    like a hand-written attention; "flash" is FlashAttention (on CUDA: sm80+, fp16/bf16 only;
    on the CPU PyTorch's own flash-style kernel)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH if name == "math" else SDPBackend.FLASH_ATTENTION)


def training_setting(text: str) -> Setting:
    """Parse a setting for a real training run: an absent device cannot be trained on."""
    setting = resolve_device(parse_setting(text))
    if setting.emulated:
        raise AmpscopeError(f"cannot train under {setting.name}: this machine has no "
                            f"{setting.device} device, and training needs the real one "
                            "(emulation predicts dtypes, not losses or speed)")
    return setting


def _to_param_dtype(module: nn.Module, dtype: torch.dtype | None) -> list[str]:
    """Convert the model to the setting's parameter dtype, as a trace does (precision.applied):
    only when most of it is in another dtype, so a model's own choices (nanochat's bf16 rotary
    tables) survive an fp32 setting as they would in its own training script."""
    if dtype is None or main_dtype(module) in (None, dtype):  # native: as the model made it
        return []
    module.to(dtype=dtype)
    return [f"parameters converted to {dtype_name(dtype)}"]


def _batch(lm: LoadedModel, x: torch.Tensor, y: torch.Tensor) -> Batch:
    """The model's batch dict; Hugging Face models shift their labels themselves."""
    ids = x.to(lm.train_ids_dtype)
    targets = y if lm.targets_are_shifted_inputs else x
    return {lm.input_name: ids, lm.target_name: targets.to(torch.int64)}


def _check_resume(saved: dict, config: TrainConfig, notes: list[str]) -> None:
    for name in SAME_RUN:
        if saved.get(name) != getattr(config, name):
            raise AmpscopeError(
                f"the checkpoint was trained with {name}={saved.get(name)!r}, this run asks for "
                f"{getattr(config, name)!r}; resuming would not continue the same run")
    changed = [name for name in SAME_CURVE if saved.get(name) != getattr(config, name)]
    if changed:
        notes.append(f"resumed with a different {', '.join(changed)}: the run continues from "
                     "the checkpoint, but not on the curve it would have followed")


def train(config: TrainConfig, *, resume: str | None = None,
          log: Callable[[StepLog | EvalLog], None] | None = None,
          on_start: Callable[[], None] | None = None) -> TrainResult:
    """Train `config.model` from scratch (or from the checkpoint at `resume`) and return the
    losses, throughput and a sample. `log` is called after every step and evaluation;
    `on_start` once everything is checked and built, before the first step (a header printed
    there never precedes a one-line error about the options)."""
    run = _Run.prepare(config, resume)
    result = run.result

    def record(entry: StepLog | EvalLog) -> None:
        if isinstance(entry, StepLog):
            result.steps.append(entry)
        else:
            result.evals.append(entry)
        if log is not None:
            log(entry)

    # -- the loop ------------------------------------------------------------------------------
    if on_start is not None:
        on_start()
    setting, device = run.setting, run.device
    with RunEnvironment(setting).applied(), attention_kernel(config.attention):
        start = run.restore()
        measure.reset_peak_memory(device)
        run.model.train()
        if start == 0:
            record(EvalLog(0, run.evaluate()))
        for step in range(start, config.steps):
            record(run.step(step))
            done = step + 1
            last = done == config.steps
            if last or (config.eval_every and done % config.eval_every == 0):
                record(EvalLog(done, run.evaluate()))
            if config.out and (last or (config.save_every and done % config.save_every == 0)):
                run.save_checkpoint(done)

        result.peak_memory, result.memory_kind = measure.peak_memory(device)
        if config.sample_tokens:
            result.sample, unknown = _sample(run.lm, run.tokenizer, config, setting, device)
            if unknown:
                result.notes.append(f"the sample drew {unknown} id(s) past the tokenizer's "
                                    f"{run.tokenizer.vocab_size:,}, which stand for no text: "
                                    "left out")
    return result


@dataclass
class _Run:
    """One training run, checked and built: the model, the data, the optimizer, and the
    figures every step reports against."""

    config: TrainConfig
    setting: Setting
    device: str
    lm: LoadedModel
    run_lm: LoadedModel  # the compiled module with --compile, sharing `lm`'s parameters
    saved: checkpoint.Checkpoint | None
    tokenizer: Tokenizer
    train_loader: DataLoaderLite
    val_loader: DataLoaderLite
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    compute_dtype: torch.dtype
    accelerator: hardware.Accelerator | None  # None: MFU n/a (measure.accelerator)
    result: TrainResult

    @property
    def model(self) -> nn.Module:
        return self.lm.module

    @classmethod
    def prepare(cls, config: TrainConfig, resume: str | None) -> _Run:
        setting = training_setting(config.setting)
        notes: list[str] = []
        saved = _checked(config, resume, notes)
        lm, params = _built(config, setting, notes)
        device = setting.device
        # -- data: tokens, a train/validation split, and the loaders ----------------------------
        tokenizer, why = choose_tokenizer(config.tokenizer, lm.name, lm.vocab_size)
        notes.append(why)
        B, T = config.batch, config.seq
        source = config.data or DEFAULT_CORPUS
        parts = split(load_tokens(config.data, tokenizer), config.val_fraction, B, T, source)
        total_batch = config.total_batch or B * T
        if total_batch % (B * T):
            raise AmpscopeError(f"--total-batch {total_batch} is not a multiple of batch × seq "
                                f"= {B * T}")
        # -- optimizer, loss scaling, compilation -----------------------------------------------
        model = lm.module
        optimizer = configure_optimizer(model, config, device)
        scaler = _scaler(setting, params, notes)
        if setting.matmul_precision == "high" and device != "cuda":
            notes.append(f"TF32 is a CUDA Tensor Core mode; on {device} it changes little or "
                         "nothing")
        # The compiled module shares its parameters with `model`; checkpoints read `model` (its
        # state-dict names have no `_orig_mod.` prefix).
        # (torch.compile of a module gives an OptimizedModule, a module itself.)
        run_lm = (dataclasses.replace(lm, module=cast(nn.Module, torch.compile(model)))
                  if config.compile else lm)
        flops_per_token, formula = measure.flops_per_token(model, T)
        for note in notes:  # the choices made for this run (tokenizer, dtype, fallbacks), for -v
            decisions.info("%s", note)
        result = TrainResult(
            config=config, setting=setting.to_dict(), device_name=measure.device_name(device),
            parameters=lm.num_parameters, tokenizer=tokenizer.name, data=source,
            train_tokens=len(parts.train), val_tokens=len(parts.val),
            tokens_per_step=total_batch, grad_accum=total_batch // (B * T),
            flops_per_token=flops_per_token, flops_formula=formula, notes=notes)
        return cls(config, setting, device, lm, run_lm, saved, tokenizer,
                   DataLoaderLite(parts.train, B, T), DataLoaderLite(parts.val, B, T),
                   optimizer, scaler, setting.autocast_dtype or params,  # what the matmuls run in
                   measure.accelerator(device), result)

    def restore(self) -> int:
        """Seed a new run, or put a resumed one back where its checkpoint left it: weights,
        moments, scaler, RNG, then the data position and the history. The step it starts at."""
        saved, result = self.saved, self.result
        if saved is None:
            torch.manual_seed(self.config.seed)
            return 0
        checkpoint.restore(saved, model=self.model, optimizer=self.optimizer,
                           scaler=self.scaler)
        self.train_loader.position = saved.loader["position"]
        self.train_loader.epoch = saved.loader["epoch"]
        result.start_step = saved.step
        result.steps = [StepLog(**s) for s in saved.history["steps"]]
        result.evals = [EvalLog(**e) for e in saved.history["evals"]]
        return saved.step

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first `eval_batches` validation batches (the same ones every
        time)."""
        lm, loader, device = self.run_lm, self.val_loader, self.device
        batches = self.config.eval_batches
        lm.module.eval()
        loader.position = 0
        total = torch.zeros((), device=device)
        for _ in range(batches):
            x, y = loader.next_batch()
            with self.setting.autocast():
                total += lm.loss(_batch(lm, x.to(device), y.to(device))).float()
        lm.module.train()
        return (total / batches).item()

    def step(self, step: int) -> StepLog:
        """One optimizer step over `grad_accum` micro-batches, timed."""
        config, device, optimizer, scaler = self.config, self.device, self.optimizer, self.scaler
        measure.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_accum = torch.zeros((), device=device)
        grad_accum = self.result.grad_accum
        for _ in range(grad_accum):
            x, y = self.train_loader.next_batch()
            batch = _batch(self.lm, x.to(device), y.to(device))
            with self.setting.autocast():
                loss = self.run_lm.loss(batch)
            # Gradients add up over micro-batches: divide so that they average instead,
            # as one big batch of total_batch tokens would.
            loss = loss / grad_accum
            loss_accum += loss.detach().float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if scaler is not None:
            scaler.step(optimizer)  # skipped when a gradient is inf or nan
            scaler.update()
        else:
            optimizer.step()
        measure.synchronize(device)
        seconds = time.perf_counter() - t0
        tokens = self.result.tokens_per_step
        return StepLog(
            step=step + 1, loss=loss_accum.item(), lr=lr, grad_norm=norm.item(),
            seconds=seconds, tokens_per_s=tokens / seconds,
            mfu=measure.mfu(self.result.flops_per_token * tokens, self.compute_dtype, seconds,
                            self.accelerator, self.setting.matmul_precision))

    def save_checkpoint(self, step: int) -> None:
        config, result = self.config, self.result
        assert config.out is not None  # (saved only into an out folder)
        path = checkpoint.save(
            checkpoint.checkpoint_dir(config.out, step), model=self.model,
            optimizer=self.optimizer, scaler=self.scaler, step=step,
            loader=self.train_loader.state(), config=dataclasses.asdict(config),
            history={"steps": [dataclasses.asdict(s) for s in result.steps],
                     "evals": [dataclasses.asdict(e) for e in result.evals]})
        result.checkpoint = str(path)


def _checked(config: TrainConfig, resume: str | None, notes: list[str]):
    """The options checked before anything is built; the checkpoint to resume from, if any."""
    if config.decay not in DECAYS:
        raise AmpscopeError(f"unknown decay {config.decay!r}; choose {' or '.join(DECAYS)}")
    if config.attention not in ATTENTION:
        raise AmpscopeError(f"unknown attention {config.attention!r}; choose one of "
                            f"{', '.join(ATTENTION)}")
    RunOptions("train", batch=config.batch, seq=config.seq)  # checked as every run's are
    if min(config.steps, config.eval_batches) < 1:
        raise AmpscopeError("steps and eval batches must be positive")
    saved = checkpoint.read(resume) if resume is not None else None
    if saved is not None:
        _check_resume(saved.config, config, notes)
        if saved.step >= config.steps:
            raise AmpscopeError(f"the checkpoint is at step {saved.step} and this run ends at "
                                f"step {config.steps}: give a larger --steps to go on")
    return saved


def _built(config: TrainConfig, setting: Setting, notes: list[str]
           ) -> tuple[LoadedModel, torch.dtype]:
    """The model, in the setting's parameter dtype, if it fits here with its gradients and
    AdamW's moments; and that dtype."""
    from ampscope.models import registry

    device = setting.device
    lm = registry.resolve(config.model, device=device, seed=config.seed)
    model = lm.module
    if config.seq > lm.max_seq_len:
        raise AmpscopeError(f"--seq {config.seq} exceeds {lm.name}'s context length "
                            f"{lm.max_seq_len}")
    notes += _to_param_dtype(model, setting.param_dtype)
    params = setting.param_dtype or main_dtype(model) or torch.float32  # native: the model's
    shortfall = registry.memory_needed_message(
        lm.name, lm.num_parameters, bytes_per_parameter=3 * params.itemsize, device=device,
        what=f"for gradients and AdamW's two moments in {dtype_name(params)}")
    if shortfall:
        raise AmpscopeError(shortfall)
    return lm, params


def _scaler(setting: Setting, params: torch.dtype, notes: list[str]
            ) -> torch.amp.GradScaler | None:
    """fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The scaler multiplies the
    loss (so every gradient) by a large factor and divides it out before the update, skipping
    steps whose gradients overflowed. bf16 has fp32's exponent range and needs none. Pure fp16
    parameters cannot be unscaled in place (GradScaler refuses fp16 gradients)."""
    if params == torch.float16:
        notes.append("fp16 parameters train without loss scaling: small gradients may "
                     "underflow; fp32+amp-fp16 is the usual recipe")
    use_scaler = setting.autocast_dtype == torch.float16 and params != torch.float16
    return torch.amp.GradScaler(setting.device) if use_scaler else None


def _sample(lm: LoadedModel, tokenizer: Tokenizer, config: TrainConfig, setting: Setting,
            device: str) -> tuple[str, int]:
    """The prompt and `sample_tokens` tokens the trained model writes after it (seeded), and
    how many sampled ids were past the tokenizer's vocabulary (left out of the text)."""
    lm.module.eval()
    prompt = tokenizer.encode(config.prompt) or [0]
    idx = torch.tensor([prompt], dtype=lm.generate_ids_dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    with torch.no_grad(), setting.autocast():
        out = lm.generate(idx, config.sample_tokens, generator)[0].tolist()
    # A model whose vocabulary is larger than the tokenizer's (gpt2-tiny: 512 rows, 256 byte
    # ids) never sees the extra ids as targets, so training drives them down, but a short run
    # may still sample one: it stands for no text.
    ids = [i for i in out if i < tokenizer.vocab_size]
    return tokenizer.decode(ids), len(out) - len(ids)
