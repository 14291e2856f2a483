"""`watch`: trace one optimizer step of the user's own training loop, as it runs; which step
is which, and what is installed when: docs/api.md ("`ampscope.watch`")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ampscope.api.tracing import capture
from ampscope.errors import AmpscopeError
from ampscope.files import unwritable, write_atomic
from ampscope.records import Trace
from ampscope.runs.session import Capture
from ampscope.torchcompat import optim

log = logging.getLogger(__name__)


def watch(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int = 2,
          out: str | Path | None = None, name: str | None = None) -> Watch:
    """Trace optimizer step `step` (1-based; default the 2nd: after warm-up and the optimizer's
    lazy state creation) of the loop that follows, and return a `Watch` whose `.trace` is set
    once that step's `optimizer.step()` has returned.

    `optimizer`: the one whose steps count (default: the first optimizer that steps). With
    `out`, a folder (made if missing), the trace is also written there as
    `ampscope-stepN.json` and the HTML report as `ampscope-stepN.html`, each atomically. The
    model and torch's global state are as before once the step is traced; if the loop stops
    earlier (or raises), `close()` (or a `with` block) removes what is still installed.
    """
    return Watch(model, optimizer, step=step, out=out, name=name)


class Watch:
    """What `watch` returns: `trace` (None until step `step` has run), `steps` (the optimizer
    steps seen, up to `step`: nothing counts after it), `files` (the paths written), `close()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 step: int = 2, out: str | Path | None = None, name: str | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise AmpscopeError(f"watch needs the model as an nn.Module, not a "
                                f"{type(model).__name__}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise AmpscopeError(f"step must be a positive integer (1 is the first optimizer "
                                f"step); got {step!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise AmpscopeError(f"watch needs a torch.optim.Optimizer, not a "
                                f"{type(optimizer).__name__}")
        self.model, self.step, self.name = model, step, name
        self.out = Path(out) if out is not None else None
        if self.out is not None:
            _check_folder(self.out)
        self.trace: Trace | None = None
        self.steps = 0
        self.files: list[Path] = []
        self._recorder: Capture | None = None  # the capture() around step N while it runs
        self._optimizer: torch.optim.Optimizer | None = None
        self._counter: RemovableHandle | None = None  # the optimizer post-hook counting steps
        self._finder: RemovableHandle | None = None  # with no optimizer given: finds it
        self._unfinished: list[tuple[RemovableHandle, optim.HookDict]] = []
        if optimizer is not None:
            self._bind(optimizer)
        else:
            self._finder = register_optimizer_step_pre_hook(self._find_optimizer)
        if step == 1:
            self._begin()

    # -- the hooks
    def _find_optimizer(self, optimizer, args, kwargs) -> None:
        """With no optimizer given, the first one to step is the one whose steps count."""
        if self._optimizer is None:
            self._bind(optimizer)
        self._remove(self._finder, optim.global_step_pre_hooks())
        self._finder = None

    def _bind(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._counter = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps == self.step - 1:
            self._begin()
        elif self.steps == self.step:
            try:
                self._end()
            finally:
                self._remove(self._counter, optim.step_post_hooks(optimizer))
                self._counter = None

    def _remove(self, handle: RemovableHandle | None, hooks: optim.HookDict) -> None:
        """Remove one of this Watch's hooks from inside a hook call. Torch runs each dict's hooks
        by iterating over it, and an OrderedDict's iterator fails on the next entry when one was
        removed; an iterator that has handed out its last entry is done and checks nothing.
        So a hook that is last removes itself at once; one that is not (a hook of the user's
        was registered after it) is made inert and removed by `close()` or the model's next
        forward call (module hooks run from a copy, so that one can remove itself)."""
        if handle is None:
            return
        if next(reversed(hooks), None) == handle.id:
            handle.remove()
            return
        hooks[handle.id] = _inert  # same key: the running iteration is not disturbed
        self._unfinished.append((handle, hooks))
        if len(self._unfinished) == 1:
            self._sweeper = self.model.register_forward_pre_hook(self._sweep)

    def _sweep(self, module, args) -> None:
        self._sweeper.remove()
        for handle, _ in self._unfinished:
            handle.remove()
        self._unfinished = []

    # -- step N
    def _begin(self) -> None:
        log.info("ampscope.watch: tracing optimizer step %d", self.step)
        # Without a device, capture() returns its Capture recorder itself: its .trace is read
        # once it has exited.
        self._recorder = cast(Capture, capture(self.model, name=self.name))
        self._recorder.__enter__()

    def _end(self) -> None:
        recorder, self._recorder = self._recorder, None
        assert recorder is not None  # (step N's end comes after its _begin)
        recorder.__exit__(None, None, None)
        self.trace = recorder.trace
        self.trace.notes.insert(0, f"Optimizer step {self.step} of the training loop, watched as "
                                   "it ran (ampscope.watch).")
        if self.out is not None:
            self._write()

    def _write(self) -> None:
        """The trace and its HTML report next to the run's outputs. A failed write is logged,
        never raised: it must not stop the user's training."""
        from ampscope.analysis.compare import build_matrix
        from ampscope.api.reports import flops, memory
        from ampscope.render.html import report_html

        trace, out = self.trace, self.out
        assert trace is not None and out is not None  # (_end calls this with both set)
        traces = [trace]
        page = report_html(traces, build_matrix(traces), reports=[memory(trace), flops(trace)])
        try:
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"ampscope-step{self.step}"
            trace.to_json(stem.with_suffix(".json"))
            self.files.append(stem.with_suffix(".json"))
            write_atomic(stem.with_suffix(".html"), page)
            self.files.append(stem.with_suffix(".html"))
        except OSError as e:
            log.warning("ampscope.watch: cannot write to %s: %s", self.out, e.strerror or e)
            return
        log.info("ampscope.watch: wrote %s", ", ".join(map(str, self.files)))

    # -- the end
    def close(self) -> None:
        """Remove whatever is still installed (the loop stopped before step N, or raised in
        it): the model and torch's global state are then as before. Idempotent."""
        recorder, self._recorder = self._recorder, None
        try:
            if recorder is not None:  # step N did not finish: no trace
                recorder.__exit__(AmpscopeError, AmpscopeError("step not finished"), None)
        finally:
            if self._finder is not None:
                self._finder.remove()
                self._finder = None
            if self._counter is not None:
                self._counter.remove()
                self._counter = None
            if self._unfinished:
                self._sweep(None, None)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "traced" if self.trace is not None else f"{self.steps} steps seen"
        return f"<ampscope.Watch step={self.step} {state}>"


def _inert(*args, **kwargs) -> None:
    """A hook that has done its work and waits to be removed."""


def _check_folder(out: Path) -> None:
    """Refuse at once an `out` that could not be written, rather than after the step."""
    if out.exists() and not out.is_dir():
        raise AmpscopeError(f"out must be a folder; {out} is a file")
    folder = out
    while not folder.exists():  # the nearest existing folder must let us make the rest
        folder = folder.parent
    why = unwritable(folder / "ampscope-step.json")
    if why is not None:
        raise AmpscopeError(f"cannot write to {out}: {why}")
