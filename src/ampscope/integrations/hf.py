"""`AmpscopeCallback` for the Hugging Face `Trainer`: traces optimizer step N of the run and
writes the trace and its HTML report into the run's `output_dir`.

    from ampscope.integrations.hf import AmpscopeCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[AmpscopeCallback(step=2)])
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from ampscope.api.watch import Watch, watch
from ampscope.records import Trace


class AmpscopeCallback(TrainerCallback):
    """Trace optimizer step `step` (default the 2nd) of `Trainer.train()`; `out` defaults to
    the run's `args.output_dir`. After training, `trace` holds the Trace (None when the run
    stopped before that step)."""

    def __init__(self, step: int = 2, out: str | Path | None = None) -> None:
        self.step, self.out = step, out
        self.watch: Watch | None = None

    @property
    def trace(self) -> Trace | None:
        return self.watch.trace if self.watch is not None else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.watch = watch(model, _torch_optimizer(optimizer), step=self.step,
                           out=self.out if self.out is not None else args.output_dir,
                           name=type(model).__name__)

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.close()  # the run ended before step N: nothing stays installed


def _torch_optimizer(optimizer):
    """The optimizer whose step() runs the step hooks: accelerate wraps the Trainer's in an
    `AcceleratedOptimizer` (`.optimizer` is the one inside)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer
