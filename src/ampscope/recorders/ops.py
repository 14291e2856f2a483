"""Op calls at both levels.

`FunctionRecorder` (a TorchFunctionMode) sees what user code called — `F.linear`, `x.float()` —
with the dtypes it passed, above autocast. `OpRecorder` (a TorchDispatchMode) sits below
autocast and autograd and sees the aten ops that really ran, including the `_to_copy` casts
autocast inserted and every backward and optimizer op.

An aten `_to_copy` is an autocast cast when it runs inside a user-level call that is not itself
a cast (`F.linear` under autocast casts its input, weight and bias) while autocast is on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

from ampscope.precision import AUTOCAST_DEVICES
from ampscope.recorders.flops import op_flops
from ampscope.recorders.memory import StorageTracker
from ampscope.recorders.modules import ModuleTracker, PhaseClock
from ampscope.recorders.source import user_source
from ampscope.recorders.tensors import data_dtypes, meta_of, metas, tensors_in
from ampscope.records import (
    EXPLICIT_CASTS,
    ArgumentOrigin,
    FailedCall,
    FunctionCall,
    OpCall,
    dtype_name,
    module_label,
)

# Calls that run a backward pass: they and the ops they dispatch belong to the backward phase.
BACKWARD_CALLS = frozenset({"Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"})
_CAST_OPS = frozenset({torch.ops.aten._to_copy.default})

_name_cache: dict[Callable, str] = {}


def func_name(func: Callable) -> str:
    """Readable name of a torch-level callable: "torch.nn.functional.linear", "Tensor.float"."""
    name = _name_cache.get(func)
    if name is None:
        name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
        name = name.replace("torch.Tensor.", "Tensor.").replace("torch._C.TensorBase.", "Tensor.")
        if name.startswith("TensorBase."):
            name = "Tensor." + name[len("TensorBase."):]
        _name_cache[func] = name
    return name


_op_names: dict = {}


def op_name(func) -> str:
    name = _op_names.get(func)
    if name is None:
        name = _op_names[func] = str(func)
    return name


# Ops that are no computation: the profiler range `Optimizer.step` opens.
_SKIPPED_NAMESPACES = ("profiler", "prim")  # profiler markers; prim.device queries of fake tensors
_DETACH = torch.ops.aten.detach.default


def _unmark_round_trips(ops: list[OpCall], start: int, result_dtype: str | None) -> None:
    """Casts a function makes itself are not autocast's: autocast casts a call's inputs and
    never casts its result back, so a cast out of the dtype the call returns (bf16 → fp32) and
    the cast back (fp32 → bf16) under one call are the function's own (CPU `rms_norm` computes
    in fp32 this way). `analysis.causes` applies the same rule."""
    casts = [i for i in range(start, len(ops)) if ops[i].autocast_cast]
    pairs = {(ops[i].inputs[0].dtype, ops[i].outputs[0].dtype) for i in casts}
    for i in casts:
        src, dst = ops[i].inputs[0].dtype, ops[i].outputs[0].dtype
        if (dst, src) in pairs and result_dtype in (src, dst):
            ops[i] = replace(ops[i], autocast_cast=False)


class FunctionRecorder(TorchFunctionMode):
    def __init__(self, tracker: ModuleTracker, phase: PhaseClock,
                 names: dict[int, tuple[weakref.ref, str]] | None = None):
        super().__init__()
        self.calls: list[FunctionCall] = []
        # Where tensors came from, for explaining a failure: parameters and buffers (`names`),
        # model inputs (added by the session) and the outputs of recorded calls.
        self.origins: dict[int, tuple[weakref.ref, str]] = dict(names or {})
        self.failure: FailedCall | None = None
        self.op_log: list[OpCall] | None = None  # the OpRecorder's list, set by it
        self.step = 0  # calls of the model so far, counted by the session
        # Set while a script's model is not known yet: shown each call's tensor inputs.
        self.on_inputs: Callable[[str, list[torch.Tensor]], None] | None = None
        self.ops_seen = 0  # bumped by OpRecorder: tells whether a call dispatched anything
        self._tracker = tracker
        self._phase = phase
        # What the dispatch mode needs to know about the call now running.
        self.current: int | None = None
        self.current_is_cast = False
        self.current_autocast: str | None = None
        self.current_source: str | None = None
        self.current_phase: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # .shape, .dtype, .grad: attribute reads
            return func(*args, **kwargs)
        name = func_name(func)
        outer = (self.current, self.current_is_cast, self.current_autocast, self.current_source)
        inputs = tensors_in(args)
        if kwargs:
            tensors_in(kwargs, inputs)
        device = inputs[0].device.type if inputs else "cpu"
        autocast = (
            dtype_name(torch.get_autocast_dtype(device))
            if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device)
            else None
        )
        if self.on_inputs is not None:
            self.on_inputs(name, inputs)
        source = user_source(skip=2)
        index = len(self.calls)
        ops_before = self.ops_seen
        # Phase and module as the call starts: `loss.backward()` starts in the forward phase by
        # the clock, but it and everything it dispatches (the ones_like seed) are backward.
        phase = "backward" if name in BACKWARD_CALLS else self._phase.now()
        module = self._tracker.current()
        outer_phase, self.current_phase = self.current_phase, phase
        self.current, self.current_is_cast = index, name in EXPLICIT_CASTS
        self.current_autocast, self.current_source = autocast, source
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if self.failure is None:  # the innermost user-level call that raised
                self.failure = FailedCall(
                    name, module, source, tuple(ArgumentOrigin(m.dtype, m.shape, self.origin_of(t))
                                                for t, m in zip(inputs, map(meta_of, inputs),
                                                                strict=True)),
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                )
            raise
        finally:
            self.current, self.current_is_cast, self.current_autocast, self.current_source = outer
            self.current_phase = outer_phase
        outputs = metas(out)
        if autocast is not None and self.ops_seen - ops_before >= 2 and self.op_log is not None:
            _unmark_round_trips(self.op_log, ops_before, outputs[0].dtype if outputs else None)
        # A call that neither returns a tensor nor runs an op (size(), dim()) is no dtype fact.
        if outputs or self.ops_seen != ops_before:
            where = f"{name} in {module_label(module)}" + (f" at {source}" if source else "")
            for t in tensors_in(out):
                self.origins[id(t)] = (weakref.ref(t), where)
            self.calls.append(FunctionCall(
                index=index, func=name, module=module,
                phase=phase, inputs=tuple(meta_of(t) for t in inputs), outputs=outputs,
                source=source, autocast=autocast, step=self.step,
            ))
        return out


    def origin_of(self, t: torch.Tensor) -> str:
        entry = self.origins.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return "unknown (made outside any recorded call)"


class OpRecorder(TorchDispatchMode):
    def __init__(self, tracker: ModuleTracker, phase: PhaseClock, functions: FunctionRecorder,
                 names: dict[int, tuple[weakref.ref, str]]):
        super().__init__()
        self.ops: list[OpCall] = []
        # Called with (func, args) before each op runs; may raise as the op's real kernel would
        # (predict mode checks what fake tensors' meta kernels do not).
        self.check: Callable[[torch._ops.OpOverload, tuple], None] | None = None
        # Told of each op's results, to follow the storages they allocate (recorders/memory.py).
        self.storages: StorageTracker | None = None
        functions.op_log = self.ops
        self._tracker = tracker
        self._phase = phase
        self._functions = functions
        self._names = names  # id(tensor) -> (weakref, parameter/buffer name)

    def _name_of(self, t: torch.Tensor) -> str | None:
        entry = self._names.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.check is not None:
            self.check(func, args)
        out = func(*args, **kwargs)
        if func.namespace in _SKIPPED_NAMESPACES:
            return out
        if func is _DETACH:
            # Not recorded: a detach changes no dtype, and which detaches reach a mode depends
            # on how it runs. Autograd saving or unpacking an op's output goes through Python
            # dispatch only because a mode is active (DebugMode leaves those out too); with
            # fake tensors (predict mode) every detach arrives that way, so AccumulateGrad's
            # and the user's could not be told apart from autograd's own.
            return out
        self._functions.ops_seen += 1
        inputs = tensors_in(args)
        if kwargs:
            tensors_in(kwargs, inputs)
        functions = self._functions
        phase = self._phase.now()
        if phase != "backward" and functions.current_phase == "backward":
            phase = "backward"  # the gradient seed of loss.backward(), before the engine runs
        caller = functions.current if phase != "backward" else None
        autocast_cast = (
            func in _CAST_OPS
            and caller is not None
            and not functions.current_is_cast
            and functions.current_autocast is not None
        )
        grad_fn = node = None
        if phase == "backward":
            node = torch._C._current_autograd_node()
            grad_fn = node.name() if node is not None else None
        flops, flops_causal = op_flops(func, args, kwargs, out)
        results = tensors_in(out)
        outputs = tuple(meta_of(t) for t in results)
        if self.storages is not None:
            self.storages.on_op(len(self.ops), results, outputs, node)
        self.ops.append(OpCall(
            index=len(self.ops), op=op_name(func), module=self._tracker.current(), phase=phase,
            inputs=tuple(meta_of(t) for t in inputs), outputs=outputs,
            autocast_cast=autocast_cast, caller=caller,
            source=functions.current_source if caller is not None else None,
            input_names=tuple(self._name_of(t) for t in inputs), grad_fn=grad_fn,
            flops=flops, flops_causal=flops_causal, input_data=data_dtypes(inputs),
        ))
        return out


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
        self._saved: tuple | None = None

    def __enter__(self) -> InferenceAsNoGrad:
        cls = torch.autograd.grad_mode.inference_mode
        self._saved = (cls.__enter__, cls.__exit__)
        watcher = self

        def __enter__(ctx) -> None:
            ctx._grad_was = torch.is_grad_enabled()
            if ctx.mode:
                watcher.used = True
                torch.set_grad_enabled(False)

        def __exit__(ctx, *exc) -> None:
            torch.set_grad_enabled(ctx._grad_was)

        cls.__enter__, cls.__exit__ = __enter__, __exit__
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            cls = torch.autograd.grad_mode.inference_mode
            cls.__enter__, cls.__exit__ = self._saved
            self._saved = None
