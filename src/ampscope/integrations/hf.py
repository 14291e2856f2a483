"""`AmpscopeCallback` for the Hugging Face `Trainer`: traces optimizer step N of the run and
writes the trace and its HTML report into the run's `output_dir`.

    from ampscope.integrations.hf import AmpscopeCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[AmpscopeCallback(step=2)])

Between step N-1's end and step N's, the recorders of `ampscope.capture` are installed in the
whole process (global module hooks, a dispatch mode, a function mode). They must come off when
training ends however it ends, and the Trainer tells callbacks only of a normal end
(`on_train_end`): a `TrainerCallback` has no `on_exception`, and an error in step N (a batch that
fails to load, an out-of-memory) leaves `train()` without another callback call. So:

- `on_init_end`, called inside `Trainer.__init__` before any `train()`, wraps that Trainer's
  own `train` (on the instance, not the class: no other Trainer is touched) so that whatever
  `train()` does, returning or raising, ends with `close()`. Nothing but the callback mechanism
  says which Trainer is calling, so it is found on the call stack: the innermost caller whose
  `self` is a `transformers.Trainer`.
- `on_train_begin` first closes whatever an earlier run left (a callback given through
  `add_callback` after the Trainer was made gets no `on_init_end`, so its Trainer is wrapped from
  here, for the next `train()`; `auto_find_batch_size` restarts the loop after an
  out-of-memory error by calling `on_train_begin` again).
- `on_train_end` closes, as before.

Namesakes, the same concern at another layer: `models/hf.py`."""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from ampscope.api.watch import Watch, watch
from ampscope.records import Trace

log = logging.getLogger(__name__)

# Set on a Trainer whose `train` is wrapped, so that it is wrapped once however many
# AmpscopeCallbacks it holds or however often one is told of it.
_GUARDED = "_ampscope_guarded"


class AmpscopeCallback(TrainerCallback):
    """Trace optimizer step `step` (default the 2nd) of `Trainer.train()`; `out` defaults to
    the run's `args.output_dir`. After training, `trace` holds the Trace (None when the run
    stopped before that step). Nothing of ampscope stays installed once `train()` has returned
    or raised."""

    def __init__(self, step: int = 2, out: str | Path | None = None) -> None:
        self.step, self.out = step, out
        self.watch: Watch | None = None

    @property
    def trace(self) -> Trace | None:
        return self.watch.trace if self.watch is not None else None

    def close(self) -> None:
        """Remove whatever of the watch is still installed (idempotent; `trace` is kept)."""
        if self.watch is not None:
            self.watch.close()

    def on_init_end(self, args, state, control, **kwargs):
        _guard(_calling_trainer(), self)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()  # an earlier run that raised, or the loop restarted with a smaller batch
        _guard(_calling_trainer(), self)
        self.watch = watch(model, _torch_optimizer(optimizer), step=self.step,
                           out=self.out if self.out is not None else args.output_dir,
                           name=type(model).__name__)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()  # the run ended before step N: nothing stays installed


def _calling_trainer() -> Trainer | None:
    """The Trainer whose method is calling the callback: the innermost frame on the stack whose
    `self` is one (the callback handler's own frames come first). None when there is none, as
    when a callback is called by hand."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
        return None
    finally:
        del here, frame  # a frame held in its own locals is a reference cycle


def _guard(trainer: Trainer | None, callback: AmpscopeCallback) -> None:
    """Make `trainer.train()` end with `callback.close()`, also when it raises."""
    if trainer is None:
        log.debug("ampscope: no Trainer on the stack; the recorders come off at on_train_end "
                  "or the next on_train_begin only")
        return
    closers = getattr(trainer, _GUARDED, None)
    if closers is not None:  # wrapped already: one more callback to close
        if callback not in closers:
            closers.append(callback)
        return
    closers = [callback]
    train = trainer.train  # the bound method, or what a subclass or another library set

    @functools.wraps(train)
    def guarded_train(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            for each in closers:
                each.close()

    setattr(trainer, _GUARDED, closers)
    trainer.train = guarded_train  # type: ignore[method-assign]  # on this Trainer only


def _torch_optimizer(optimizer):
    """The optimizer whose step() runs the step hooks: accelerate wraps the Trainer's in an
    `AcceleratedOptimizer` (`.optimizer` is the one inside)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer
