"""What runs under capture: one forward pass, one training step, or a few sampled tokens.

Each workload is written as a training or sampling script would write it, because ampscope
must show what such a script really does: autocast around the forward pass and the loss only,
`backward()` and the optimizer step outside it, a GradScaler with fp16 autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from ampscope.errors import AmpscopeError
from ampscope.models.base import Batch, LoadedModel
from ampscope.patches import patched
from ampscope.precision import Setting
from ampscope.runtime.emulation import foreach_by_default
from ampscope.torchcompat.dispatch import no_torch_function

WORKLOADS = ("train", "forward", "generate")
OPTIMIZERS = ("adamw", "adam", "sgd")
# How the optimizer updates its parameters: one kernel per parameter ("for-loop"), one per op
# over all of them ("foreach": temporaries as large as every parameter), or one fused kernel.
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
Workload = str | Callable[[nn.Module, Batch], object]


# The largest batch, seq or new_tokens a run takes: more is no size any machine runs.
MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class RunOptions:
    """What one run does besides its model and setting: the workload and its size.

    Checked once, when made, so every caller — the API, the CLI, distributed runs — gets the
    same one-line error for a bad value before any model is built.
    """

    workload: Workload = "train"  # a name from WORKLOADS, or a callable(module, batch)
    batch: int = 1
    seq: int = 64
    optimizer: str = "adamw"  # for the train workload
    new_tokens: int = 4  # for the generate workload
    seed: int = 0  # random token ids, dropout masks and sampling
    predict: bool | None = None  # fake tensors; None: unless the model reads values
    checkpoint: bool = False  # train: recompute each block's activations in backward
    optimizer_impl: str | None = None  # from OPTIMIZER_IMPLS; None: PyTorch's choice
    # predicted: every speed trick off, every op dispatched (ampscope.tricks)
    exact: bool = False
    # real: also record what the values say (Trace.values: runs/value_checks.py)
    values: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.workload, str):
            if self.workload not in WORKLOADS:
                raise AmpscopeError(f"unknown workload {self.workload!r}; choose one of "
                                    f"{', '.join(WORKLOADS)}")
        elif not callable(self.workload):
            raise AmpscopeError("a workload is a name (train, forward, generate) or a "
                                "callable(module, batch)")
        if self.optimizer not in OPTIMIZERS:
            raise AmpscopeError(f"unknown optimizer {self.optimizer!r}; choose one of "
                                f"{', '.join(OPTIMIZERS)}")
        sizes = {"batch": self.batch, "seq": self.seq, "new_tokens": self.new_tokens}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            got = ", ".join(f"{k}={v!r}" for k, v in bad.items())
            raise AmpscopeError(f"batch, seq and new_tokens must be positive integers; got {got}")
        huge = {k: v for k, v in sizes.items() if v > MAX_SIZE}
        if huge:  # beyond any tensor dimension torch's random ids can take
            got = ", ".join(f"{k}={v:,}" for k, v in huge.items())
            raise AmpscopeError(f"batch, seq and new_tokens must be at most {MAX_SIZE:,}; got {got}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise AmpscopeError(f"seed must be an integer, not {self.seed!r}")
        if self.optimizer_impl is not None and self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise AmpscopeError(f"unknown optimizer implementation {self.optimizer_impl!r}; "
                                f"choose one of {', '.join(OPTIMIZER_IMPLS)}")
        if self.checkpoint and self.workload != "train":
            raise AmpscopeError("activation checkpointing applies to the train workload only")

    def as_kwargs(self) -> dict:
        """The options as the keyword arguments of `ampscope.trace` and its siblings."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def workload_name(self) -> str:
        """The workload as a trace names it: its name, or the callable's name."""
        if isinstance(self.workload, str):
            return self.workload
        return getattr(self.workload, "__name__", "custom")


def make_optimizer(name: str, params: list[nn.Parameter], *,
                   foreach: bool | None = None, fused: bool | None = None) -> torch.optim.Optimizer:
    # Hyperparameters are GPT-2-like; they change values, never dtypes. `foreach=None` lets
    # PyTorch choose by device, as a training script does.
    if name == "adamw":
        return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                 foreach=foreach, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, lr=6e-4, foreach=foreach, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach, fused=fused)
    raise AmpscopeError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of the largest ModuleList (transformer.h, layers)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    largest = max(lists, key=len) if lists else None
    return list(largest) if largest is not None else []


@contextlib.contextmanager
def checkpointed(lm: LoadedModel) -> Iterator[None]:
    """Every repeated block's forward runs under `torch.utils.checkpoint` (non-reentrant, as
    PyTorch recommends): only its inputs are saved, its activations are recomputed in backward.
    The blocks' own `forward` attributes are put back afterwards, also on failure."""
    from torch.utils.checkpoint import checkpoint

    blocks = repeated_blocks(lm.module)
    if not blocks:
        raise AmpscopeError(f"activation checkpointing wraps each block of {lm.name}'s largest "
                            "ModuleList, and it has none")
    def wrapped(forward: Callable) -> Callable:
        def run(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    with contextlib.ExitStack() as stack:
        for b in blocks:
            stack.enter_context(patched(b, "forward", wrapped(b.forward)))
        yield


def _optimizer_choice(setting: Setting, impl: str | None) -> dict:
    """`foreach`/`fused` arguments of the optimizer: the implementation asked for, or the one
    PyTorch would pick on the setting's device (an emulated device gets its own default)."""
    if impl == "fused":
        return {"fused": True}
    if impl is not None:
        return {"foreach": impl == "foreach"}
    return {"foreach": True if setting.emulated and foreach_by_default(setting.device) else None}


def train_step(lm: LoadedModel, batch: Batch, setting: Setting, optimizer: str, *,
               predict: bool = False, checkpoint: bool = False,
               optimizer_impl: str | None = None) -> dict:
    module = lm.module
    module.train()
    # ampscope's own look at the parameters, no call of the model's: a `requires_grad` read
    # per parameter that no mode needs to see (on a 70B model, 723 round trips through each).
    with no_torch_function():
        params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise AmpscopeError(f"{lm.name} has no parameter that requires grad; nothing to train")
    opt = make_optimizer(optimizer, params, **_optimizer_choice(setting, optimizer_impl))
    # fp16 autocast needs loss scaling to keep small gradients from flushing to zero;
    # pure fp16 parameters cannot be unscaled by GradScaler, so scripts skip it there.
    use_scaler = setting.autocast_dtype == torch.float16 and setting.param_dtype != torch.float16
    scaler = torch.amp.GradScaler(setting.run_device) if use_scaler else None
    with setting.autocast(), checkpointed(lm) if checkpoint else contextlib.nullcontext():
        loss = lm.loss(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        if predict:
            # scaler.step reads found_inf's value to decide whether to step; fake tensors have
            # none. Unscale and step as it does when the gradients are finite.
            scaler.unscale_(opt)
            opt.step()
        else:
            scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return {"loss": loss.detach()}


def forward(lm: LoadedModel, batch: Batch, setting: Setting) -> dict:
    lm.module.eval()
    with torch.no_grad(), setting.autocast():
        logits = lm.logits(batch)
    return {"logits": logits}


def generate(lm: LoadedModel, batch: Batch, setting: Setting, new_tokens: int,
             generator: torch.Generator) -> dict:
    lm.module.eval()
    # Samplers that take no generator (HF's generate) draw from the global RNG: seed it too, so
    # a trace is reproducible; `precision.applied` restores the user's RNG state afterwards.
    torch.manual_seed(generator.initial_seed())
    with torch.no_grad(), setting.autocast():
        tokens = lm.generate(batch[lm.input_name], new_tokens, generator)
    return {"tokens": tokens}


def run(lm: LoadedModel, batch: Batch, setting: Setting, options: RunOptions, *,
        predict: bool = False) -> dict:
    """Run one workload; returns its named outputs (loss, logits or tokens)."""
    workload, optimizer = options.workload, options.optimizer
    if callable(workload):
        with setting.autocast():
            out = workload(lm.module, batch)
        return {"output": out} if isinstance(out, torch.Tensor) else {}
    if workload == "train":
        return train_step(lm, batch, setting, optimizer, predict=predict,
                          checkpoint=options.checkpoint, optimizer_impl=options.optimizer_impl)
    if workload == "forward":
        return forward(lm, batch, setting)
    if workload == "generate":
        return generate(lm, batch, setting, options.new_tokens,
                        torch.Generator().manual_seed(options.seed))
    raise AmpscopeError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")


DEFAULT_OPTIONS = RunOptions()
