"""`ampscope run`: the user's own script, unmodified, traced the way `python -m cProfile` runs it:
as `__main__` under a `Capture` that adopts the first module it calls outside any other as the
model, stopped after its steps (or `max_forwards` passes), on the virtual device where this
machine lacks its device, on fake tensors with `predict`; it ends as under `python`. What it
sees and how a run ends: docs/cli.md ("`ampscope run`", "How a run ends").

The package:

- `__init__.py`: `run_script`, and the run in this process.
- `target.py`: the script or module as `python` starts it; where it failed.
- `predicted.py`: fake weights, `.item()` of fake values, `model.to()` of fake parameters.
- `written_files.py`: what the script wrote, left open, or (predicted) was kept from writing.
- `ending.py`: its atexit handlers, `os._exit`, forks.
- `state.py`: the caller's process state, saved and restored.
- `child.py`: the run in a spawned child process.
- `ranks.py`: `run --nproc N`, the script as N ranks, each a child process.
- `predicted_ranks.py`: `run --nproc N --predict`, ranks 0 and N-1 of N predicted on the fake
  process group, each a child process.
- `rank_groups.py`: each rank in a process group of its own, ended with what it started;
  SIGTERM and SIGHUP end the job as torchrun ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Sequence
from functools import partial

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from ampscope import hardware
from ampscope.analysis.checks import judge
from ampscope.analysis.diagnosis import FP16_GRADIENTS, diagnose, fp16_gradients_origin
from ampscope.analysis.findings import plural
from ampscope.analysis.summary import pass_notes
from ampscope.defaults import MAX_FORWARDS, MAX_FORWARDS_NO_OPTIMIZER
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.precision import DEVICES
from ampscope.records import Trace, dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.runs.session import Capture
from ampscope.runs.source import source_line
from ampscope.runs.tensor_meta import no_torch_function
from ampscope.runtime.compiled import EagerCompile
from ampscope.runtime.emulation import device_api_error
from ampscope.runtime.predict import data_dependent
from ampscope.runtime.workers import leaving_workers
from ampscope.script.ending import Ending, ScriptExited, exit_code, with_status
from ampscope.script.predicted import (
    Instances,
    fake_model,
    fake_values,
    made,
    swappable,
)
from ampscope.script.state import ProcessState
from ampscope.script.target import nth, runner, user_line
from ampscope.script.written_files import ScriptFiles, watched
from ampscope.tricks import exact

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

# Findings and checks filled in, a check silenced by a comment on the user's line.
judged = partial(judge, line_of=source_line)


class _StopScript(BaseException):
    """Raised as the model's first forward pass after the last traced optimizer step begins
    (or the first beyond the passes allowed without a step): unwinds the script past its own
    `except Exception:` handlers."""


def run_script(target: str, argv: Sequence[str] = (), *, module: bool = False,
               device: str | None = None, steps: int = 1, predict: bool = False,
               virtual: bool | None = None, max_forwards: int | None = None,
               in_process: bool = False, values: bool = False,
               gpu: str | hardware.Accelerator | None = None) -> Trace:
    """Run a script (`target` a path) or a module (`module=True`, `target` a dotted name) with
    `argv` as its arguments, stop it after `steps` optimizer steps (as its model's next
    forward pass begins, so the rest of the last step runs), and return what its model did. A
    script that never steps runs to its end, or until its model has run `max_forwards` forward
    passes without a step (0: no bound; None: 100 while the script has made no optimizer, as
    an evaluation or a sampler, 1,000 once it has, to let an evaluation before its first step
    run).

    `device` is the device the script should believe it has ("cuda", "mps", "xpu"); on a
    machine without it, the script runs on the virtual device and the trace says "emulated".
    `predict=True` runs it on fake tensors. `virtual=True` uses the virtual device even where
    the device exists (to compare the two on a GPU machine); None: only where it does not.
    Inside `ampscope.exact_path()` a predicted run takes no speed trick (`run --exact`).
    `values=True` also records what a real run's values say (Trace.values: inf/NaN, activations
    near the format's limit, 16-bit updates that round away); a predicted run has none.
    `gpu` (a name of `hardware.table()` or an `Accelerator`, `--gpu`) is the GPU the virtual
    cuda device is: its name, memory and compute capability, and the kernels chosen by it;
    default: an H100.

    The script runs in a spawned child process, whose trace comes back as JSON; its output goes
    where the caller's goes. `in_process=True` runs it here, as the CLI does, and restores this
    process's state afterwards, also when it raised (what is restored: docs/api.md)."""
    if steps < 1:
        raise AmpscopeError("--steps must be at least 1: the run stops after that many "
                            "optimizer steps")
    if max_forwards is not None and max_forwards < 0:
        raise AmpscopeError("--max-forwards must be 0 (no bound) or more")
    if device is not None and device not in DEVICES:
        raise AmpscopeError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    if isinstance(gpu, str):
        gpu = hardware.by_name(gpu)  # an unknown name is refused before anything runs
    label, run = runner(target, argv, module)  # a target that cannot run: refused here
    if not in_process:
        from ampscope.script.child import run_in_child

        # The child finds the entry again by its name (the same table); figures given on a
        # command line alone (`custom`) name no GPU to be.
        named = gpu.name if gpu is not None and gpu.name in {a.name for a in hardware.table()} \
            else None
        return run_in_child(target, list(argv), module=module, device=device, steps=steps,
                            predict=predict, virtual=virtual, max_forwards=max_forwards,
                            exact=exact(), values=values, gpu=named)
    saved = ProcessState.save()
    try:
        script = _ScriptRun(label, steps=steps, max_forwards=max_forwards,
                            env=RunEnvironment(device=device, predict=predict, virtual=virtual,
                                               gpu=gpu),
                            values=values)
        try:
            with contextlib.ExitStack() as stack:
                script.enter(stack)
                script.run(run)
        except (AmpscopeError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise _script_error(e, label, script.capture, script.env.target,
                                script.values_read if predict else None) from e
        return script.trace()
    finally:
        saved.restore()


class _ScriptRun:
    """One script's run in this process: what counts its steps and forward passes, what it runs
    under, how it ended, and the trace it leaves."""

    def __init__(self, label: str, *, steps: int, max_forwards: int | None,
                 env: RunEnvironment, values: bool = False) -> None:
        self.env = env  # the device it believes it has (virtual where missing), fake or real
        self.label, self.steps, self.max_forwards = label, steps, max_forwards
        self.taken = self.forwards = 0
        self.grads: dict[int, str] = {}  # id(parameter): the dtype of its gradient at a step
        # "steps", "bound" (max_forwards), or how the script failed after its last step
        self.stopped: str | None = None
        # ("bound") the passes without a step it was stopped after; whether it had an optimizer
        self.bound, self.had_optimizer = 0, False
        self.exited: int | None = None  # the status of an os._exit the script called
        self.status = 0  # the status the script ended with, as `python SCRIPT` would exit
        self.made = Instances()  # every module the script makes
        self.optimizers = Instances()  # and every optimizer
        # torch.compile: eager; its module wrapper is no model of the script's, what it wraps is
        self.compiled = EagerCompile(on_wrapper=self.made.discard)
        self.capture = env.capture(
            None, workload="script", judge=judged, thin=env.predict,
            on_model_forward=self._count_forward, candidates=self.made,
            optimizers=self.optimizers, device=env.device,
            rank_roles=True, values=values)
        self.values_read: list[str] = []  # lines whose .item() of a fake tensor returned NaN
        self.values_answered: list[str] = []  # library lines whose truth tests were answered
        self.files = ScriptFiles(env.predict)
        self.ending = Ending()

    def _count_step(self, optimizer, args, kwargs) -> None:
        # No stop here, even after the last step: the code that ends the step (GradScaler's
        # update, the LR scheduler, zero_grad, logging) runs and is traced. The script stops
        # as its model's next forward pass begins (`_count_forward`).
        self.taken += 1
        self.forwards = 0
        # The gradients the step used: the inventory is taken as the run ends, after the
        # script's `zero_grad()` may have dropped them.
        with no_torch_function():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.grads[id(p)] = dtype_name(p.grad.dtype)

    def _count_forward(self) -> None:
        """As a forward pass of the model begins, before any of it is recorded (the capture's
        root-forward callback): stop the script here once its steps are done, or once it has
        run past `max_forwards` passes without a step."""
        if self.taken >= self.steps:
            self.stopped = "steps"
            raise _StopScript
        self.forwards += 1
        # The passes without a step allowed now: `max_forwards` as given, or by default fewer
        # while the script has made no optimizer (it cannot be about to step).
        bound = self.max_forwards if self.max_forwards is not None else (
            MAX_FORWARDS if self.optimizers else MAX_FORWARDS_NO_OPTIMIZER)
        if bound and self.forwards > bound:
            self.stopped, self.bound = "bound", bound
            self.had_optimizer = bool(self.optimizers)  # (gone once the script's globals are)
            raise _StopScript

    def enter(self, stack: contextlib.ExitStack) -> None:
        """Everything the script runs under, innermost last."""
        target, fake = self.env.virtual, self.env.fake
        stack.enter_context(leaving_workers())  # first: it records the state before the run
        stack.enter_context(self.env.emulated())
        if fake is not None:
            stack.enter_context(fake_model(fake, target))
        stack.enter_context(made(nn.Module, self.made))
        stack.enter_context(made(Optimizer, self.optimizers))
        stack.enter_context(self.capture.recording())
        stack.callback(register_optimizer_step_post_hook(self._count_step).remove)
        stack.enter_context(self.env.device_active(self.capture))
        stack.enter_context(swappable(self.capture, target, fake))
        if fake is not None:
            stack.enter_context(fake_values(self.values_read, self.values_answered))
        stack.enter_context(watched(self.files))
        stack.enter_context(self.ending.watching())
        stack.enter_context(self.compiled.active())  # after the virtual device's own

    def run(self, run: Callable[[], None]) -> None:
        """The script, to its end or its stop; then its end as the interpreter would make it
        (os._exit skips it all)."""
        handlers = {h for logger in _loggers() for h in logger.handlers}  # every one now
        try:
            self._guarded(run)
        except _StopScript:
            pass  # `stopped` says why
        except ScriptExited as e:
            self.exited = e.code
            if e.code != 0:
                self._failed(f"ended its process with os._exit({e.code})", None, e.code)
        except SystemExit as e:
            if e.code not in (None, 0):
                self._failed(f"exited with status {e.code}", e, exit_code(e))
        except Exception as e:
            # The steps are traced; the rest of the last one failed (its logging, a
            # checkpoint): the trace stands, and its notes say what failed where.
            if self.taken < self.steps:
                raise
            self.status = 1  # as `python` ends on an exception nothing caught
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            where = user_line(e)
            self.stopped = (f"raised {type(e).__name__}{f' at {where}' if where else ''}"
                            f"{f': {message}' if message else ''}")
        finally:
            if self.exited is None:
                self.ending.run_handlers()
                _close_log_handlers(handlers)
            self.files.close_what_is_open()

    def _failed(self, how: str, cause: BaseException | None, status: int) -> None:
        """The script ended its process with a failure `status`: an error before its last
        step, a note after it; either carries the status (`ampscope run` exits with it)."""
        if self.taken < self.steps:
            raise with_status(AmpscopeError(
                f"{self.label} {how} before its {nth(self.steps)} optimizer step"),
                status) from cause
        self.stopped = how
        self.status = status

    def _guarded(self, run: Callable[[], None]) -> None:
        leaving: BaseException | None = None
        try:
            run()
        except BaseException as e:
            leaving = e
            raise
        finally:
            # Before the script's frames and globals go (its unwinding, the collector).
            self.capture.hold_storages()
            # A process the script forked goes no further than its script.
            self.ending.leave_if_forked(exit_code(leaving))

    def trace(self) -> Trace:
        """What the script's model did, with the notes that say how the run went."""
        model = self.capture.model
        if model is None:
            raise AmpscopeError(f"nothing was captured: {self.label} ran no nn.Module (call "
                                "your model in the script, or trace it with `ampscope trace "
                                "package.module:factory`)")
        result = self.capture.finish()
        # A parameter whose gradient the script dropped after its last step (`zero_grad()`
        # runs before the stop) is listed with the dtype its gradient had at the step.
        if self.grads:
            stepped = {name: self.grads[id(p)] for name, p in model.named_parameters()
                       if id(p) in self.grads}
            result.parameters = [
                dataclasses.replace(r, grad_dtype=stepped[r.name])
                if r.grad_dtype is None and r.name in stepped else r
                for r in result.parameters]
        result.mode = "predict" if self.env.predict else "run"
        result.workload = "train" if self.taken else "forward"
        notes = self._notes(result)
        for note in notes:
            log.info("%s", note)
        notes += self.env.device_notes()
        notes += self.env.emulation_notes(result)  # the kernels it chose as the device would
        notes += self.compiled.notes()
        result.notes = notes + result.notes
        judged(result)
        return with_status(result, self.status) if self.status else result

    def _notes(self, result: Trace) -> list[str]:
        notes = [self._ending(), *pass_notes(result, self.taken)]
        if self.env.predict:
            notes.append("Predicted: every parameter and buffer became a fake tensor as the "
                         "model was built, so no weight was kept in memory; the data stayed "
                         "real.")
        for line in dict.fromkeys(self.values_read):
            notes.append(f".item() of a fake tensor at {line} returned NaN (predict mode has "
                         "no values).")
        for line in dict.fromkeys(self.values_answered):
            notes.append(f"{line} tested a fake tensor's truth: answered as the usual case "
                         "(nothing out of range, no inf or NaN), which changes no dtype or shape.")
        return notes + self.files.notes()

    def _ending(self) -> str:
        """The note that says how the script's run ended."""
        label, taken, bound, stopped = self.label, self.taken, self.bound, self.stopped
        if stopped == "steps":
            return (f"{label} was stopped after its {nth(taken)} optimizer step, as its model's "
                    "next forward pass began.")
        if stopped == "bound":  # what was traced, why it stopped, and how to let it run on
            since, held = ("without an optimizer step", f"those {bound:,} passes and no "
                           "optimizer step") if not taken else (
                f"since its {nth(taken)} optimizer step",
                f"its {plural(taken, 'optimizer step')} and the {bound:,} passes after")
            why = f"--max-forwards {bound}"
            if self.max_forwards is None:
                why += (", the default for a script that has made "
                        f"{'an' if self.had_optimizer else 'no'} optimizer")
            return (f"{label} was stopped after {bound:,} forward passes of its model {since} "
                    f"({why}): the trace holds {held}; raise --max-forwards, or give 0 for no "
                    "bound, to let it run on.")
        if stopped is not None:  # failed after its last step
            return (f"After its {nth(taken)} optimizer step, {label} {stopped}; the trace holds "
                    "the run up to there.")
        how = "ended with os._exit(0)" if self.exited is not None else "ran to its end"
        return f"{label} {how} ({plural(taken, 'optimizer step')})."


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(), *(x for x in logging.root.manager.loggerDict.values()
                                   if isinstance(x, logging.Logger))]


def _close_log_handlers(before: set[logging.Handler]) -> None:
    """Flush every log handler, and close and detach those the script added, as
    `logging.shutdown` does at exit: a log file's last lines reach the disk, and ampscope's
    own messages after the run never go into the script's log."""
    for logger in _loggers():
        for handler in logger.handlers[:]:
            with contextlib.suppress(Exception):
                handler.flush()
            if handler not in before:
                logger.removeHandler(handler)
                with contextlib.suppress(Exception):
                    handler.close()


def _script_error(e: Exception, label: str, capture: Capture, device: str | None,
                  values_read: list[str] | None) -> AmpscopeError:
    """One line for a script that raised: what ampscope knows of the cause, or the script's
    own error with its file:line. The script's own error (a dtype mismatch included) carries
    status 1, as `python` ends on it; one that says ampscope cannot run the script (fake
    tensors' values, the emulated device's limits) carries none: ampscope's own, 2.
    `values_read`: in a predicted run, the lines whose `.item()` was answered with NaN."""
    where = user_line(e)
    if values_read is not None and data_dependent(e):
        return AmpscopeError(
            f"predict mode cannot run {label}: the code at {where or 'an unknown line'} reads a "
            "tensor's value (.item(), a comparison, printing a tensor), and fake tensors have "
            "none; run it for real at a smaller size, or guard that line"
        )
    if device is not None:
        device_error = device_api_error(e, device)
        if device_error is not None:
            return device_error
    diagnosis = diagnose(capture.failure)
    if diagnosis is not None:
        return with_status(DtypeMismatchError(diagnosis), 1)
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    at = f" at {where}" if where else ""
    if FP16_GRADIENTS in message:
        origin = fp16_gradients_origin(capture.ops_so_far())
        message += f" ({origin})" if origin else ""
    return with_status(AmpscopeError(f"{label} raised {type(e).__name__}{at}: {message}"
                                     f"{_torchrun_hint(e)}{_nan_hint(values_read)}"), 1)


def _nan_hint(values_read: list[str] | None) -> str:
    """Where a predicted run answered `.item()` with NaN before the error: a value that sets a
    size (an all-to-all's split sizes from expert routing) has no prediction."""
    if not values_read:
        return ""
    lines = ", ".join(dict.fromkeys(values_read))
    return (f" (predict mode answered .item() with NaN at {lines}: a value that decides a size, "
            "such as expert routing's split sizes, cannot be predicted; run it for real at a "
            "smaller size)")


def _torchrun_hint(e: Exception) -> str:
    """Where the error names a variable of torchrun's environment that is not set (a
    `KeyError: 'LOCAL_RANK'`, torchtitan's "LOCAL_RANK must be set", init_process_group's
    "environment variable RANK expected"): how to run the script as torchrun would."""
    text = f"{e!r} {e}"
    # What torchrun sets for each rank it starts; a script made for it reads them.
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        if name not in os.environ and re.search(rf"\b{name}\b", text):
            return (f" (the script expects torchrun's environment, and {name} is not set: "
                    "run it as ranks with `ampscope run --nproc N`, --nproc 1 for one)")
    return ""
