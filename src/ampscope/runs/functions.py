"""User-level calls: what user code called — `F.linear`, `x.float()` — with the dtypes it passed,
above autocast (`FunctionRecorder`, a TorchFunctionMode), and `torch.inference_mode()` blocks
run as `no_grad` blocks while a run is recorded (`InferenceAsNoGrad`). The op recorder
(runs/ops.py) reads the call in progress through the `UserCalls` protocol.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ampscope.patches import patch
from ampscope.precision import AUTOCAST_DEVICES
from ampscope.records import (
    EXPLICIT_CASTS,
    FUNCTION_ROW,
    OP_ROW,
    ArgumentOrigin,
    FailedCall,
    FunctionCall,
    Phase,
    dtype_name,
    module_label,
)
from ampscope.runs.modules import ModuleTracker, PhaseClock
from ampscope.runs.source import source_from
from ampscope.runs.tensor_meta import (
    meta_of,
    metas_of,
    results_of,
    walk,
)
from ampscope.runtime.autocast_key import key_state
from ampscope.torchcompat.autograd import graph_task_id
from ampscope.torchcompat.dispatch import (
    function_stack_depth,
    pop_function_mode,
    push_function_mode,
)
from ampscope.torchcompat.ops import TENSOR_BASE_PREFIX

# Calls that run a backward pass: they and the ops they dispatch belong to the backward phase.
BACKWARD_CALLS = frozenset({"Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"})
# A call's source line not looked up yet. Typed Any: a sentinel kept where a source line
# (str | None) is declared.
PENDING: Any = object()
_PRIM_DEVICE = torch.ops.prim.device.default

_name_cache: dict[Callable, str] = {}
log = logging.getLogger(__name__)


def func_name(func: Callable) -> str:
    """Readable name of a torch-level callable: "torch.nn.functional.linear", "Tensor.float"."""
    name = _name_cache.get(func)
    if name is None:
        name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
        own = getattr(func, "__name__", None)
        if own and getattr(torch, own, None) is func and (
                name.rsplit(".", 1)[-1] != own or name.startswith("_VariableFunctionsClass.")):
            # PyTorch's own lookup names some functions by another (torch.mm as torch.spmm),
            # and knows others (torch's foreach norm) only by the class that holds them
            name = f"torch.{own}"
        name = name.replace("torch.Tensor.", "Tensor.").replace(TENSOR_BASE_PREFIX, "Tensor.")
        if name.startswith("TensorBase."):
            name = "Tensor." + name[len("TensorBase."):]
        _name_cache[func] = name
    return name


# An op record while the run goes on: OpCall's fields in order (records.OP_ROW).
_AUTOCAST_CAST, _INPUTS, _OUTPUTS = (OP_ROW.at(f) for f in ("autocast_cast", "inputs", "outputs"))
# A user-level call's record: FunctionCall's fields in order (records.FUNCTION_ROW).
_FUNC, _MODULE, _SOURCE = (FUNCTION_ROW.at(f) for f in ("func", "module", "source"))


def _unmark_round_trips(rows: list[tuple], start: int, result_dtype: str | None) -> None:
    """Casts a function makes itself are not autocast's: autocast casts a call's inputs and
    never casts its result back, so a cast out of the dtype the call returns (bf16 → fp32) and
    the casts back (fp32 → bf16) after it, under one call, are the function's own (CPU
    `rms_norm` computes in fp32 this way). `analysis.causes` pairs them the same way."""
    casts = [i for i in range(start, len(rows)) if rows[i][_AUTOCAST_CAST]]
    kinds = [(rows[i][_INPUTS][0].dtype, rows[i][_OUTPUTS][0].dtype) for i in casts]
    out_of_result: set[tuple[str, str]] = set()  # the function's casts out, seen so far
    for n, (i, (src, dst)) in enumerate(zip(casts, kinds, strict=True)):
        # Order tells them apart: autocast casts the inputs before the function runs, so a cast
        # into the result's dtype is the function's own only after its cast out of it (the
        # math attention path's casts back to bf16 are; autocast's casts of fp32 q and k to
        # bf16 before it are not).
        cast_out = src == result_dtype and (dst, src) in kinds[n + 1:]
        cast_back = dst == result_dtype and (dst, src) in out_of_result
        if cast_out:
            out_of_result.add((src, dst))
        if cast_out or cast_back:
            rows[i] = OP_ROW.replace(rows[i], autocast_cast=False)


def _autocast_dtype(device: str) -> str | None:
    """Autocast's dtype at `device`'s dispatch key now (what casts the call's tensors: in an
    emulated run, the target's autocast at the CPU's key), None while it is off there."""
    if device in AUTOCAST_DEVICES:
        enabled, dtype = key_state(device)
        return dtype_name(dtype) if enabled else None
    return None


def _take_off_stack(mode: TorchFunctionMode) -> int | None:
    """Take `mode` off the torch function mode stack, wherever it stands, leaving the others as
    they were: how many modes were below it (None, and nothing changed, if it is not there)."""
    above = []
    found = False
    while function_stack_depth():
        top = pop_function_mode()
        if top is mode:
            found = True
            break
        above.append(top)
    depth = function_stack_depth() if found else None
    for m in reversed(above):
        push_function_mode(m)
    return depth


def _put_back_on_stack(mode: TorchFunctionMode, depth: int) -> None:
    """Put `mode` back at `depth` (or on top, if fewer modes stand there now)."""
    above = []
    while function_stack_depth() > depth:
        above.append(pop_function_mode())
    push_function_mode(mode)
    for m in reversed(above):
        push_function_mode(m)


class UserCalls(Protocol):
    """What the op recorder (runs/ops.py) reads of the user-level call in progress, and
    the two things it tells back: the whole channel between the two recorders, which the
    `FunctionRecorder` it is given at construction provides."""

    current: int | None  # the row of the call in progress; None outside any
    current_is_cast: bool  # that call is itself a cast (x.float(), .to(dtype))
    current_autocast: str | None  # autocast's dtype when that call started
    current_source: Any  # its file:line, or PENDING until looked up (`source_now`)
    current_phase: str | None
    op_log: list[tuple] | None  # the op recorder's rows (casts a call made are unmarked there)
    ops_seen: int  # aten ops recorded so far, counted by the op recorder

    def source_now(self) -> str | None: ...


class FunctionRecorder(TorchFunctionMode):
    def __init__(self, tracker: ModuleTracker, phase: PhaseClock):
        super().__init__()
        # One row per recorded call: FunctionCall's fields in order (built by `records`).
        self.rows: list[tuple] = []
        # Where tensors came from, for explaining a failure: parameters, buffers and model
        # inputs (added by the session) and the outputs of recorded calls (as the index of the
        # row of the call that made them, put in words only when asked).
        self.origins: dict[int, tuple[weakref.ref, str | int]] = {}
        self.failure: FailedCall | None = None
        self.op_log: list[tuple] | None = None  # the OpRecorder's rows, set by it
        self.step = 0  # calls of the model so far, counted by the session
        # Set while a script's model is not known yet: shown each call's tensor inputs.
        self.on_inputs: Callable[[str, list[torch.Tensor]], None] | None = None
        self.ops_seen = 0  # bumped by OpRecorder: tells whether a call dispatched anything
        # While an autocast region records (runs/autocast_regions.py): the device types of the
        # calls' first tensors, which decide whose autocast casts them.
        self.devices: set[str] | None = None
        self._tracker = tracker
        self._phase = phase
        # What the dispatch mode needs to know about the call now running. Its source line is
        # found only when asked (`source_now`): from `current_frame`, the frame that called.
        self.current: int | None = None
        self.current_is_cast = False
        self.current_autocast: str | None = None
        self.current_source: str | None = None  # or PENDING
        self.current_frame: FrameType | None = None
        self.current_phase: str | None = None
        # While a PyTorch optimizer steps (`step_begin`): the recorder's place on the mode stack,
        # and what `current_*` were before.
        self._step_depth: int | None = None
        self._step_outer: tuple = ()
        self._step_ops_before = 0
        self._step_name = ""

    def source_now(self) -> str | None:
        """The source line of the user-level call now running."""
        source = self.current_source
        if source is PENDING:
            source = self.current_source = source_from(self.current_frame)
        return source

    def records(self) -> list[FunctionCall]:
        return FUNCTION_ROW.records(self.rows)

    def step_begin(self, name: str, device: str, frame: FrameType | None) -> None:
        """A PyTorch optimizer's `step()` begins: it is recorded as one call, `name`, made at
        the user's line that `frame` stands under, and its ops are that call's. The recorder
        leaves the mode stack until `step_end`: the torch calls inside are PyTorch's own
        (docs/how-it-works.md#what-each-recorder-sees says why)."""
        if self._step_depth is not None:
            return
        depth = _take_off_stack(self)
        if depth is None:  # not recording calls now
            return
        self._step_depth = depth
        self._step_outer = (self.current, self.current_is_cast, self.current_autocast,
                            self.current_source, self.current_frame, self.current_phase)
        self._step_ops_before = self.ops_seen
        index = len(self.rows)
        # A cast inside the step is the optimizer's own, never autocast's (autocast casts the
        # inputs of matmul-like ops, which no PyTorch optimizer runs), even when the user steps
        # inside an autocast region: the step counts as an explicit cast for its ops.
        self.current, self.current_is_cast = index, True
        self.current_autocast, self.current_source = _autocast_dtype(device), source_from(frame)
        self.current_frame, self.current_phase = frame, Phase.OPTIMIZER
        self._step_name = name

    def step_end(self) -> None:
        """The step returned, or raised (then this is called at the next model call or at the
        end of the run): its call recorded when it ran ops, the recorder back in place."""
        if self._step_depth is None:
            return
        index, autocast, source = self.current, self.current_autocast, self.current_source
        _put_back_on_stack(self, self._step_depth)
        self._step_depth = None
        (self.current, self.current_is_cast, self.current_autocast, self.current_source,
         self.current_frame, self.current_phase) = self._step_outer
        if self.ops_seen != self._step_ops_before:
            self.rows.append((index, self._step_name, self._tracker.current_in(False),
                              Phase.OPTIMIZER, (), (), source, autocast, self.step))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if getattr(func, "__name__", "") == "__get__":  # .shape, .dtype, .grad: attribute reads
            return func(*args, **kwargs)
        if func is _PRIM_DEVICE:  # a fake tensor's device, asked by PyTorch (thousands a step)
            return func(*args, **kwargs)
        name = _name_cache.get(func) or func_name(func)
        outer = (self.current, self.current_is_cast, self.current_autocast, self.current_source,
                 self.current_frame)
        inputs: list[torch.Tensor] = []
        walk(args, inputs)
        if kwargs:
            walk(kwargs.values(), inputs)
        device = inputs[0].device.type if inputs else "cpu"
        autocast = _autocast_dtype(device)
        if inputs and self.devices is not None:
            self.devices.add(device)
        if self.on_inputs is not None:
            self.on_inputs(name, inputs)
        frame = sys._getframe(1)
        index = len(self.rows)
        ops_before = self.ops_seen
        # Phase and module as the call starts: `loss.backward()` starts in the forward phase by
        # the clock, but it and everything it dispatches (the ones_like seed) are backward.
        backward = graph_task_id() != -1  # -1 outside a backward pass
        phase = Phase.BACKWARD if backward or name in BACKWARD_CALLS else self._phase.now()
        module = self._tracker.current_in(backward)
        outer_phase, self.current_phase = self.current_phase, phase
        self.current, self.current_is_cast = index, name in EXPLICIT_CASTS
        self.current_autocast, self.current_source, self.current_frame = autocast, PENDING, frame
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if self.failure is None:  # the innermost user-level call that raised
                self.failure = FailedCall(
                    name, module, self.source_now(),
                    tuple(ArgumentOrigin(m.dtype, m.shape, self.origin_of(t))
                          for t, m in zip(inputs, map(meta_of, inputs), strict=True)),
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                )
            raise
        finally:
            source = self.current_source
            (self.current, self.current_is_cast, self.current_autocast, self.current_source,
             self.current_frame) = outer
            self.current_phase = outer_phase
        results = results_of(out)
        outputs = metas_of(results)
        if autocast is not None and self.ops_seen - ops_before >= 2 and self.op_log is not None:
            _unmark_round_trips(self.op_log, ops_before, outputs[0].dtype if outputs else None)
        # A call that neither returns a tensor nor runs an op (size(), dim()) is no dtype fact.
        if outputs or self.ops_seen != ops_before:
            if source is PENDING:
                source = source_from(frame)
            origins = self.origins
            for t in results:  # the call that made it: its row, read only when asked
                origins[id(t)] = (weakref.ref(t), index)
            self.rows.append((index, name, module, phase, metas_of(inputs), outputs,
                              source, autocast, self.step))
        return out

    def origin_of(self, t: torch.Tensor) -> str:
        entry = self.origins.get(id(t))
        if entry is not None and entry[0]() is t:
            where = entry[1]
            if isinstance(where, int):  # the row of the recorded call that made it
                row = self.rows[where]
                name, module, source = row[_FUNC], row[_MODULE], row[_SOURCE]
                where = f"{name} in {module_label(module)}" + (f" at {source}" if source else "")
            return where
        return "unknown (made outside any recorded call)"


class InferenceAsNoGrad:
    """While entered, `torch.inference_mode()` blocks run as `torch.no_grad()` blocks.

    Under inference mode autograd is skipped, so composite ops (`linear`, `to`, `square`) reach
    the recorders whole and autocast never sees their parts, where a device decomposes them
    first (its backend runs the parts through autocast again): the trace would show `linear`
    instead of `addmm`, count 0 FLOPs and miss autocast's casts. Under no_grad the parts are the
    device's, with the same dtypes, and nothing is saved for backward either. `used` tells
    whether a block ran, for the trace's notes.
    """

    def __init__(self) -> None:
        self.used = False
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> InferenceAsNoGrad:
        cls = torch.autograd.grad_mode.inference_mode

        def __enter__(ctx) -> None:
            ctx.ampscope_grad_was = torch.is_grad_enabled()
            if ctx.mode:
                self.used = True
                torch.set_grad_enabled(False)

        def __exit__(ctx, *exc) -> None:
            torch.set_grad_enabled(ctx.ampscope_grad_was)

        self._undo = [patch(cls, "__enter__", __enter__), patch(cls, "__exit__", __exit__)]
        return self

    def __exit__(self, *exc) -> None:
        undo, self._undo = self._undo, []
        for each in reversed(undo):
            each()
