"""`AmpscopeCallback` for Lightning's `Trainer`: traces optimizer step N of `fit()` and writes
the trace and its HTML report into the run's log folder.

    from ampscope.integrations.lightning import AmpscopeCallback
    trainer = lightning.Trainer(callbacks=[AmpscopeCallback(step=2)])
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # one of the two for the checker: the same class, in two packages
    from lightning.pytorch.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # the standalone package
        from pytorch_lightning.callbacks import Callback

from ampscope.api.watch import Watch, watch
from ampscope.records import Trace


class AmpscopeCallback(Callback):
    """Trace optimizer step `step` (default the 2nd) of `trainer.fit()` (the first optimizer's
    steps count); `out` defaults to `trainer.log_dir`, else `trainer.default_root_dir`. After
    training, `trace` holds the Trace (None when the run stopped before that step)."""

    def __init__(self, step: int = 2, out: str | Path | None = None) -> None:
        self.step, self.out = step, out
        self.watch: Watch | None = None

    @property
    def trace(self) -> Trace | None:
        return self.watch.trace if self.watch is not None else None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.watch is not None:  # an earlier fit() (on_exception closed it if it raised)
            self.watch.close()
        out = self.out if self.out is not None else (trainer.log_dir or trainer.default_root_dir)
        optimizers = trainer.optimizers
        self.watch = watch(pl_module, optimizers[0] if optimizers else None, step=self.step,
                           out=out, name=type(pl_module).__name__)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.watch is not None:
            self.watch.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.watch is not None:  # the step may have raised while traced
            self.watch.close()
