"""`ampscope run`: the user's own script, unmodified, traced the way `python -m cProfile` runs it.

The script runs as `__main__` with its own `sys.argv`, its folder first on `sys.path` (as
`python train.py` puts it), under a `Capture` that adopts the first module the script calls
outside any other as the model. After `steps` optimizer steps the run is stopped by an
exception the script's own `except Exception:` cannot catch, so its later code (more steps,
evaluation, checkpointing) never runs. On a device this machine lacks, the script runs on the
virtual device (precision/virtual_device.py), so its device checks, `torch.cuda` calls and
`torch.autocast("cuda")` regions behave as on the target. With `predict`, it runs on fake
tensors: its model is never materialised, whatever its size.

Nothing of the caller's is lost: `sys.argv`, `sys.path` and torch's global state (autocast,
matmul precision, default dtype, grad mode, RNG) are restored, also when the script raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import traceback
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from ampscope.analysis.diagnosis import diagnose
from ampscope.analysis.findings import derive_findings, plural
from ampscope.analysis.summary import forward_passes
from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.nested import tensors_in
from ampscope.precision import DEVICES, GlobalState, default_autocast_dtype, device_available
from ampscope.precision.emulation import Emulation, device_api_error
from ampscope.precision.predict import (
    check_matmul_dtypes,
    data_dependent,
    fake_mode,
    foreach_defaults_as_real,
    gc_paused,
    quiet_fake_tensor_log,
)
from ampscope.precision.virtual_device import VirtualDevice, patched
from ampscope.recorders.session import Capture
from ampscope.recorders.source import user_source
from ampscope.records import Trace
from ampscope.torchcompat.dispatch import no_torch_function
from ampscope.torchcompat.fake import FakeTensor, FakeTensorMode

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)


class _StopScript(BaseException):
    """Raised after the last traced optimizer step: unwinds the script past its own
    `except Exception:` handlers."""


def run_script(target: str, argv: Sequence[str] = (), *, module: bool = False,
               device: str | None = None, steps: int = 1, predict: bool = False,
               virtual: bool | None = None) -> Trace:
    """Run a script (`target` a path) or a module (`module=True`, `target` a dotted name) with
    `argv` as its arguments, stop it after `steps` optimizer steps (a script that never steps
    runs to its end), and return what its model did.

    `device` is the device the script should believe it has ("cuda", "mps", "xpu"); on a
    machine without it, the script runs on the virtual device and the trace says "emulated".
    `predict=True` runs it on fake tensors. `virtual=True` uses the virtual device even where
    the device exists (to compare the two on a GPU machine); None: only where it does not.
    Inside `ampscope.exact_path()` a predicted run takes no speed trick (`run --exact`)."""
    if steps < 1:
        raise AmpscopeError("--steps must be at least 1: the run stops after that many "
                            "optimizer steps")
    if device is not None and device not in DEVICES:
        raise AmpscopeError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    label, run = _runner(target, argv, module)
    emulated = device is not None and (not device_available(device) if virtual is None
                                       else virtual)
    capture = Capture(None, model_name=None, workload="script", findings=derive_findings,
                      thin=predict)
    capture.device = device
    virtual = VirtualDevice(device) if emulated and device is not None else None
    fake = fake_mode() if predict else None
    if fake is not None:
        capture._op_check = check_matmul_dtypes
    taken = 0
    values_read: list[str] = []  # lines whose .item() of a fake tensor returned NaN
    saves_skipped: list[str] = []  # torch.save calls of fake tensors, not written

    def count_step(optimizer, args, kwargs) -> None:
        nonlocal taken
        taken += 1
        if taken >= steps:
            raise _StopScript

    state = GlobalState.save()
    stopped = False
    try:
        with contextlib.ExitStack() as stack:
            if virtual is not None:
                assert device is not None
                stack.enter_context(Emulation(device, default_autocast_dtype(device)))
            if fake is not None:
                stack.enter_context(_fake_model(fake, virtual))
            capture.candidates = weakref.WeakSet()
            stack.enter_context(_made_modules(capture.candidates))
            stack.enter_context(capture.recording())
            stack.callback(register_optimizer_step_post_hook(count_step).remove)
            if virtual is not None:
                stack.enter_context(virtual.active(memory=capture.memory_now))
            if fake is not None:
                stack.enter_context(_swappable(capture, virtual, fake))
                stack.enter_context(_fake_values(values_read))
                stack.enter_context(_no_fake_saves(saves_skipped))
            try:
                run()
            except _StopScript:
                stopped = True
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise AmpscopeError(f"{label} exited with status {e.code} before its "
                                        f"{_nth(steps)} optimizer step") from e
    except (AmpscopeError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise _script_error(e, label, capture, device if emulated else None, predict) from e
    finally:
        state.restore()
    if capture.model is None:
        raise AmpscopeError(f"nothing was captured: {label} ran no nn.Module (call your model "
                            "in the script, or trace it with `ampscope trace package.module:"
                            "factory`)")
    result = capture.finish()
    result.mode = "predict" if predict else "run"
    result.workload = "train" if taken else "forward"
    notes = [f"{label} was stopped after its {_nth(taken)} optimizer step." if stopped else
             f"{label} ran to its end ({taken} optimizer steps)."]
    passes = forward_passes(result)
    if taken and passes > taken:
        notes.append(f"The model ran {passes} forward passes for {plural(taken, 'optimizer step')} "
                     f"(gradient accumulation): each pass is its own forward and backward phase "
                     "in the trace; counts and tokens cover them all.")
    if predict:
        notes.append("Predicted: every parameter and buffer became a fake tensor as the model "
                     "was built, so no weight was kept in memory; the data stayed real.")
    for line in dict.fromkeys(values_read):
        notes.append(f".item() of a fake tensor at {line} returned NaN (predict mode has no "
                     "values).")
    for what in dict.fromkeys(saves_skipped):
        notes.append(f"{what} was not written: it held fake tensors, which have no values "
                     "(predict mode); a file already there was left as it was.")
    for note in notes:
        log.info("%s", note)
    if virtual is not None:
        notes += virtual.notes()
    result.notes = notes + result.notes
    result.findings = derive_findings(result)
    return result


def _nth(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _runner(target: str, argv: Sequence[str], module: bool):
    """What runs the script, and how messages name it."""
    if module:
        import importlib.util

        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise AmpscopeError(f"no module named {target!r} (run from the folder that holds "
                                "its package, or give a script's path)")

        def run_module() -> None:
            with _script_argv([target, *argv], os.getcwd()):
                runpy.run_module(target, run_name="__main__", alter_sys=True)

        return f"python -m {target}", run_module
    path = Path(target)
    if path.exists() and not path.is_file():  # a folder, or a FIFO that would block
        raise AmpscopeError(f"{target}: not a regular file; give the path of a .py file, or -m "
                            "package.module")
    if not path.is_file():
        raise AmpscopeError(f"no script at {target} (give the path of a .py file, or -m "
                            "package.module)")

    def run_path() -> None:
        with _script_argv([str(path), *argv], str(path.resolve().parent)):
            runpy.run_path(str(path), run_name="__main__")

    return path.name, run_path


@contextlib.contextmanager
def _made_modules(made: weakref.WeakSet) -> Iterator[None]:
    """Every nn.Module the script makes, while it runs (nn.Module.__init__ sees them all)."""
    import torch

    original = torch.nn.Module.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.add(self)

    torch.nn.Module.__init__ = __init__
    try:
        yield
    finally:
        torch.nn.Module.__init__ = original


@contextlib.contextmanager
def _fake_model(fake: FakeTensorMode, virtual: VirtualDevice | None) -> Iterator[None]:
    """Predict mode for a script: every parameter and buffer a module registers becomes a fake
    tensor at once (each real one lives only until it is converted), while the script's data
    stays real; an op on a fake tensor and a real one runs on the fake mode. On a virtual
    device each fake one is where its real one was (on the CPU, until `model.to(device)`
    copies it, as on the device)."""
    import torch
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    def fake_parameter(module, name, param):
        if param is None or isinstance(param, FakeTensor):
            return None
        with no_torch_function():  # the conversion is ampscope's, not the script's
            data = placed(fake.from_tensor(param.detach()), param)
            return torch.nn.Parameter(data, requires_grad=param.requires_grad)

    def fake_buffer(module, name, buffer):
        if buffer is None or isinstance(buffer, FakeTensor):
            return None
        with no_torch_function():
            return placed(fake.from_tensor(buffer), buffer)

    def placed(stand_in, real):
        if virtual is not None:
            virtual.place_like(stand_in, real)
        return stand_in

    # `nn.Parameter(data)` makes a plain tensor a parameter in C++, unseen by function modes,
    # but a tensor subclass (a fake tensor) through `data.detach().requires_grad_()`: calls a
    # real run never makes (module.to() re-wraps every weight), kept out of the trace.
    make_parameter = torch.nn.Parameter.__new__

    def parameter(cls, data=None, requires_grad=True):
        if isinstance(data, FakeTensor):
            with no_torch_function():
                return make_parameter(cls, data, requires_grad)
        return make_parameter(cls, data, requires_grad)

    with contextlib.ExitStack() as stack:
        stack.callback(register_module_parameter_registration_hook(fake_parameter).remove)
        stack.callback(register_module_buffer_registration_hook(fake_buffer).remove)
        stack.enter_context(patched(torch.nn.Parameter, "__new__", parameter))
        stack.enter_context(quiet_fake_tensor_log())
        stack.enter_context(gc_paused())
        stack.enter_context(foreach_defaults_as_real())
        yield


@contextlib.contextmanager
def _fake_values(read: list[str]) -> Iterator[None]:
    """`.item()` of a fake tensor (a loss printed for the log) returns NaN, and the line is
    noted; any other read of a value (`if loss < best`) still stops the run."""
    import torch
    from torch.overrides import TorchFunctionMode

    item = torch.Tensor.item

    class FakeValues(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is item and isinstance(args[0], FakeTensor):
                read.append(user_source(skip=2) or "an unknown line")
                return float("nan")
            return func(*args, **(kwargs or {}))

    with FakeValues():
        yield


@contextlib.contextmanager
def _no_fake_saves(skipped: list[str]) -> Iterator[None]:
    """`torch.save` of anything holding a fake tensor (a checkpoint of the model or optimizer)
    writes nothing: the file would hold no weights, and would replace the user's last real
    checkpoint. The call is noted; a save of real tensors only (data, token tables) is made."""
    import torch

    original = torch.save

    def save(obj, f, *args, **kwargs):
        if not any(isinstance(t, FakeTensor) for t in tensors_in([obj])):
            return original(obj, f, *args, **kwargs)
        where = user_source(skip=2)  # the line that called torch.save
        name = f"torch.save(..., {os.fspath(f)!r})" if isinstance(f, (str, os.PathLike)) \
            else "torch.save(...) to a file object"
        skipped.append(name + (f" at {where}" if where else ""))
        return None

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


@contextlib.contextmanager
def _swappable(capture: Capture, virtual: VirtualDevice | None,
               fake: FakeTensorMode) -> Iterator[None]:
    """`model.to(...)` in a fake run: PyTorch swaps each fake parameter with its converted copy
    (`torch.utils.swap_tensors`), which refuses tensors that have weak references, and the
    recorders hold weak references to the tensors they name. For each swap, those references
    are dropped, the swap is made, and they are put back on the same objects (a parameter keeps
    its name; its device tag follows its new contents)."""
    import torch.utils

    original = torch.utils.swap_tensors
    registries = [capture._names, capture._functions.origins]
    on_cpu = virtual.mode.on_cpu if virtual is not None else None
    converter = fake.fake_tensor_converter.meta_converter
    memos = [converter.tensor_memo]

    def swap_tensors(t1, t2) -> None:
        # Names only: the popped weak references themselves must die before the swap.
        held = [(r, {i: r.pop(i)[1] for i in (id(t1), id(t2)) if i in r}) for r in registries]
        tags = None
        if on_cpu is not None:
            tags = (on_cpu.discard(t1), on_cpu.discard(t2))
        for memo in memos:  # the fake mode's memo of tensors it converted: weak values
            for key in [k for k, v in memo.items() if v is t1 or v is t2]:
                del memo[key]
        original(t1, t2)
        for registry, entries in held:
            for i, name in entries.items():
                t = t1 if i == id(t1) else t2
                registry[i] = (weakref.ref(t), name)
        if on_cpu is not None and tags is not None:
            if tags[1]:
                on_cpu.add(t1)
            if tags[0]:
                on_cpu.add(t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _script_argv(argv: list[str], first_path: str) -> Iterator[None]:
    """`sys.argv` and `sys.path[0]` as `python script.py ARGS` sets them; both come back, and
    the modules the script imported from its own folder are forgotten, so the next run
    imports them again (their import-time device checks included)."""
    saved_argv, saved_path, saved_modules = sys.argv[:], sys.path[:], set(sys.modules)
    folder = os.path.abspath(first_path) + os.sep
    sys.argv = argv
    sys.path.insert(0, first_path)
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.abspath(path).startswith(folder):
                del sys.modules[name]


def _script_error(e: Exception, label: str, capture: Capture, device: str | None,
                  predict: bool) -> AmpscopeError:
    """One line for a script that raised: what ampscope knows of the cause, or the script's
    own error with its file:line."""
    where = _user_line(e)
    if predict and data_dependent(e):
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
        return DtypeMismatchError(diagnosis)
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    at = f" at {where}" if where else ""
    return AmpscopeError(f"{label} raised {type(e).__name__}{at}: {message}")


def _user_line(e: BaseException) -> str | None:
    """`file.py:line` of the innermost frame of the traceback outside PyTorch and ampscope."""
    import torch

    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep,
            os.path.dirname(runpy.__file__) + os.sep + "runpy.py")
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not frame.filename.startswith(skip) and "importlib" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return None
