"""`Capture`: one run of anything under all recorders at once → a `Trace` of plain records."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ampscope.precision.matmul import matmul_precision
from ampscope.records import (
    UNKNOWN_SETTING,
    FailedCall,
    ModelInfo,
    OpCall,
    SettingRecord,
    StorageRecord,
    Trace,
)
from ampscope.runs import inventory
from ampscope.runs.autocast_regions import RegionRecorder
from ampscope.runs.functions import FunctionRecorder, InferenceAsNoGrad
from ampscope.runs.memory import StorageTracker
from ampscope.runs.modules import ModuleTracker, PhaseClock
from ampscope.runs.observed import observed_setting
from ampscope.runs.ops import OpRecorder
from ampscope.runs.passes import PassLog
from ampscope.runs.repeats import BlockReplay
from ampscope.runs.replayed import ReplayDoubt
from ampscope.runs.tensor_meta import no_torch_function
from ampscope.runs.value_checks import ValueRecorder
from ampscope.torchcompat import modules as module_state
from ampscope.torchcompat.dispatch import OpOverload
from ampscope.torchcompat.dynamo import eager_stance
from ampscope.tricks import Trick, enabled

# Decisions (predicted or real, emulated, fallbacks) for `ampscope -v` and callers' logging.
log = logging.getLogger(__name__)

_MATMULS = frozenset({"torch.matmul", "torch.mm", "torch.bmm", "torch.addmm", "Tensor.matmul",
                       "Tensor.__matmul__", "Tensor.__rmatmul__", "Tensor.mm"})


_signatures: dict[Callable, inspect.Signature] = {}


def _forward_signature(module: nn.Module) -> inspect.Signature:
    """`inspect.signature(module.forward)`, worked out once per forward function (each step
    calls the model again, and the signature is tens of µs to work out)."""
    forward = module.forward
    function = getattr(forward, "__func__", None)
    if function is None:  # not a method: a forward set on the instance
        return inspect.signature(forward)
    if function not in _signatures:
        _signatures[function] = inspect.signature(forward)
    return _signatures[function]


def _step_name(optimizer) -> str:
    """"torch.optim.AdamW.step", as the optimizer's class is spelled publicly."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}.step"
    return f"{cls.__module__}.{cls.__qualname__}.step"


@dataclass(frozen=True)
class CaptureOptions:
    """How a `Capture` records, fixed when it is made.

    `judge` and `explain_failure` are given by the API (they are analysis, which capture
    does not import): the first fills `trace.findings` and `trace.diagnostics` when a `with`
    block ends, the second turns the call that raised into a note under the user's traceback.
    `op_check` sees every aten op before it runs (predict mode's matmul dtype check).

    `replay_blocks` (for a run on fake tensors) records repeated identical blocks once and
    replays the others (runs/repeats.py); `finish` raises `ReplayDoubt` when that turned
    out unsound, or when another speed trick failed during the run (the caller runs it again on
    the exact path). `thin` (by default as `replay_blocks`) lets the op recorder's speed tricks
    answer ops (runs/__init__.py lists them); one that fails is then off for the rest of the
    run, its op run the exact way, and the trace says so.

    For a script's run: `candidates`, the modules it makes (filled by the runner as the script
    runs), to find its model by a parameter when it never calls a module, only
    `module.forward(...)`; `optimizers`, the optimizers it makes, so that a module it calls
    first but does not train (a frozen encoder, a teacher) is not taken for the model;
    `on_model_forward`, called as each forward pass of the model begins
    (the runner bounds a run that never steps with it; it may raise to stop the run).
    `device`: on a virtual device, the device the run is on; `gpu`, the GPU it stands for
    (the observed setting's SettingRecord.gpu; a given `setting` carries its own). `rank_roles`: Trace.rank_roles.
    `values`: a real run also records what its values say (Trace.values, runs/value_checks.py)."""

    model_name: str | None = None
    setting: SettingRecord | None = None
    workload: str = "custom"
    op_check: Callable[[OpOverload, tuple], None] | None = None
    judge: Callable[[Trace], None] | None = None
    explain_failure: Callable[[FailedCall | None], str | None] | None = None
    replay_blocks: bool = False
    thin: bool | None = None
    on_model_forward: Callable[[], None] | None = None
    candidates: Collection[nn.Module] | None = None
    optimizers: Collection[torch.optim.Optimizer] | None = None
    device: str | None = None
    gpu: str | None = None
    rank_roles: bool = False
    values: bool = False


class Capture:
    """Records whatever runs inside `with Capture(model) as trace:`.

    The yielded `Trace` is filled in when the block exits. Nothing of the user's is changed:
    hooks and modes are removed on exit, also when the block raised.
    """

    def __init__(self, model: nn.Module | None, options: CaptureOptions | None = None) -> None:
        """`model=None`: a script's, found as it runs (`_adopt`, `_adopt_owner`)."""
        options = self.options = options or CaptureOptions()
        self.model = model
        self.trace = Trace(
            model=ModelInfo(options.model_name or type(model).__name__, type(model).__name__, 0),
            setting=options.setting or UNKNOWN_SETTING, workload=options.workload,
        )
        # Strong references until `finish`: a workload's optimizer is gone by the time the
        # inventory is taken, and its state is part of what the trace must report.
        self._optimizers: list[torch.optim.Optimizer] = []
        self._inputs: dict[str, torch.Tensor] | None = None
        self._arguments: dict[str, object] = {}
        self._thin = options.replay_blocks if options.thin is None else options.thin
        self._replay: BlockReplay | None = None
        self._values: ValueRecorder | None = None

    # -- recorders
    def _start(self) -> None:
        clock = self._clock = PhaseClock()
        tracker = self._tracker = ModuleTracker({})
        tracker.phase = clock
        tracker.on_root_forward = self._on_root_forward
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self._functions = FunctionRecorder(tracker, clock)
        self._ops = OpRecorder(tracker, clock, self._functions, self._names)
        self._ops.check = self.options.op_check
        self._ops.device = self.options.device
        self._passes = PassLog(self._ops.rows, self._functions.rows, tracker, self)
        tracker.on_root_forward_end = self._passes.end
        self._ops.use_tricks(frozenset(Trick) if self._thin else frozenset({Trick.PRIM_DEVICE}))
        self._storages = self._ops.storages = StorageTracker(self._ops.rows)
        # What `_stop` undoes, last first: every one of them, even when one fails.
        exits = self._exits = contextlib.ExitStack()
        self._regions = exits.enter_context(
            RegionRecorder(self._ops.rows, self._functions, self.options.device))
        exits.callback(self._storages.watch_resizes())
        exits.callback(register_optimizer_step_pre_hook(self._on_step_begin).remove)
        exits.callback(register_optimizer_step_post_hook(self._on_step_end).remove)
        if self.model is not None:
            self._watch(self.model)
        else:
            tracker.on_new_root = self._adopt
            self._functions.on_inputs = self._adopt_owner
        self._inference = exits.enter_context(InferenceAsNoGrad())
        # Compiled code runs eagerly while recorded: TorchDynamo compiles nothing under the
        # recorders' modes, and `fullgraph=True` would fail for it.
        exits.enter_context(eager_stance())
        if self.options.values:  # below the op recorder; its module hook before the tracker's
            self._values = exits.enter_context(
                ValueRecorder(tracker, self._ops.rows, self._names))
        exits.enter_context(tracker)
        exits.enter_context(self._functions)
        exits.callback(self._functions.step_end)  # the run failed inside a step
        exits.enter_context(self._ops)

    def _stop(self) -> None:
        try:
            self._exits.close()
        finally:
            # The recorders' callbacks are bound methods of this capture and its pass log: cycles
            # that would keep the trace and every record until the garbage collector ran (a
            # quarter of a second for a 70B step's, paid by whatever runs next). Nothing calls
            # them once the hooks are gone.
            tracker = self._tracker
            tracker.on_root_forward = tracker.on_root_forward_end = tracker.on_new_root = None
            self._passes.close()
            self._matmul_precision = matmul_precision()  # as the run left it
            self._functions.on_inputs = None

    def _watch(self, model: nn.Module) -> None:
        """Name the model's modules, parameters and buffers for the recorders."""
        # One walk of a model of thousands of modules, every path to each module (as
        # named_parameters(remove_duplicate=False) takes them); a module goes by its first name.
        modules = list(model.named_modules(remove_duplicate=False))
        names: dict[nn.Module, str] = {}
        for prefix, m in modules:
            names.setdefault(m, prefix)
        self._tracker.add_names(names)
        # Every name of each tensor (tied weights have several): the recorders name it by its
        # first, and its storage by all of them.
        for kind in ("parameter", "buffer"):
            for prefix, m in modules:
                held = module_state.parameters(m) if kind == "parameter" else module_state.buffers(m)
                for key, t in held.items():
                    if t is None:
                        continue
                    name = f"{prefix}.{key}" if prefix else key
                    self._names.setdefault(id(t), (weakref.ref(t), name))
                    self._functions.origins.setdefault(id(t), (weakref.ref(t), f"{kind} {name}"))
                    self._storages.register(t, kind, name)
        self._exits.callback(
            model.register_forward_pre_hook(self._on_model_call, with_kwargs=True).remove)
        self._exits.callback(self._tracker.watch_direct_calls(model, self._on_model_call))
        if self.options.replay_blocks and enabled(Trick.REPLAY):
            self._replay = BlockReplay(self._tracker, self._functions, self._ops, self._storages)
            self._exits.callback(self._replay.install(model))

    def _adopt(self, module: nn.Module, args: tuple) -> None:
        """The first module a script calls outside any other becomes the model: or the module
        that holds it, when the script called that one's forward(...) directly."""
        root = self._outermost(lambda m: any(c is module for c in m.modules()))
        if not self._trained(root or module):
            return  # the model is the one the script's optimizer trains: it comes later
        if root is not None and root is not module:
            self._adopt_root(root)
            return
        self._take_model(module)
        self._on_model_call(module, args, {})  # its pre-hook was registered after this call

    def _trained(self, module: nn.Module) -> bool:
        """Whether `module` may be the model: it holds a parameter an optimizer the script made
        trains, or no optimizer holds any yet (a sampler, or one made after the first call)."""
        trained = {id(p) for o in self.options.optimizers or ()
                   for group in o.param_groups for p in group["params"]}
        return not trained or any(id(p) in trained for p in module.parameters())

    def _adopt_owner(self, func: str, inputs: list[torch.Tensor]) -> None:
        """A script that calls `model.forward(...)` directly runs no module hook: the model is
        then the outermost module made by the script that holds a parameter the call uses.
        Only compute calls count (`F.linear`, `F.embedding`, a matmul): while the model is being
        built, its initialisation reads and fills parameters of modules not attached yet."""
        if not (func.startswith("torch.nn.functional.") or func in _MATMULS):
            return
        params = [t for t in inputs if isinstance(t, nn.Parameter)]
        if params:
            root = self._outermost(lambda m: any(p is q for q in m.parameters() for p in params))
            if root is not None and self._trained(root):
                self._adopt_root(root)

    def _outermost(self, holds: Callable[[nn.Module], bool]) -> nn.Module | None:
        """The outermost module the script made for which `holds` is true, if any."""
        modules = list(self.options.candidates or ())
        children = {id(c) for m in modules for c in m.children()}
        return next((m for m in modules if id(m) not in children and holds(m)), None)

    def _adopt_root(self, root: nn.Module) -> None:
        """The model, found while its forward already runs (called directly): its later calls
        are recorded as model calls."""
        self._take_model(root)
        if self._tracker.innermost_forward() is None:  # its forward(...) runs now, called directly
            self._tracker.enter_running(root, self._on_model_call)

    def _take_model(self, model: nn.Module) -> None:
        """A script's model, found: watched from now on, and no other module is looked for."""
        self.model = model
        self._tracker.on_new_root = None
        self._functions.on_inputs = None
        self._watch(model)

    def _on_root_forward(self) -> None:
        # A new step begins: also inside optimizer.step(closure), where an optimizer that takes
        # a closure (LBFGS; Lightning runs every step this way) runs forward and backward.
        self._clock.after_backward = False
        self._clock.in_optimizer_step = False
        self._functions.step_end()  # a step that raised, caught by the user's code
        self._functions.step += 1
        if self.options.on_model_forward is not None:
            self.options.on_model_forward()

    def _on_model_call(self, module, args, kwargs) -> None:
        running = self._tracker.innermost_forward()
        if running is None or running.depth == 0:  # the model itself, called outside any module
            self._passes.begin(args, kwargs, running.index if running is not None
                               else self._tracker.call_count())
        try:
            bound = _forward_signature(module).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
        # Objects passed to the model (a KV cache) hold tensors of the model's: kept until
        # `finish` takes their inventory, as they are at the end of the run.
        for k, v in bound.items():
            if not isinstance(v, (torch.Tensor, int, float, bool, str, type(None))):
                self._arguments[k] = v
        if self._inputs is None:
            self._inputs = {k: v for k, v in bound.items() if isinstance(v, torch.Tensor)}
            for k, v in self._inputs.items():
                self._functions.origins[id(v)] = (weakref.ref(v), f"model input {k}")
                self._storages.register(v, "input", k)

    def _on_step_begin(self, optimizer, args, kwargs) -> None:
        if not any(o is optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)
        self._clock.step_begun()
        # A PyTorch optimizer's own step, given no closure, is one call
        # (FunctionRecorder.step_begin; docs/how-it-works.md#what-each-recorder-sees).
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
        pytorch_step = getattr(type(optimizer).step, "__module__", "").startswith("torch.")
        if closure is None and pytorch_step:
            with no_torch_function():
                device = next((p.device.type for group in optimizer.param_groups
                               for p in group["params"]), "cpu")
            # this hook's caller: the optimizer's step wrapper, under the user's call
            self._functions.step_begin(_step_name(optimizer), device, sys._getframe(1))

    def _on_step_end(self, optimizer, args, kwargs) -> None:
        self._clock.in_optimizer_step = False
        self._functions.step_end()
        # The gradients it stepped on are named now: a script's `zero_grad()` may free them
        # before the run ends, and they were gradients all the same.
        with no_torch_function():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    entry = self._names.get(id(p))
                    grad = p.grad if isinstance(p, torch.Tensor) else None
                    if entry is not None and entry[0]() is p and grad is not None:
                        self._storages.register(grad, "gradient", entry[1] + ".grad")

    def name_registries(self) -> list[dict[int, tuple[weakref.ref, Any]]]:
        """The recorders' weak references to the tensors they name, by id (a predicted
        script's `model.to()` must drop and restore them around each swap: script/predicted.py).
        Each with its own kind of name (Any): a str, or also a call's row index."""
        return [self._names, self._functions.origins]

    def memory_now(self) -> tuple[int, int]:
        """Bytes live now and at most so far in the run, in 512-byte blocks (for a virtual
        device's torch.cuda.memory_allocated() and max_memory_allocated())."""
        return self._storages.live_bytes, self._storages.peak_bytes

    def ops_so_far(self) -> list[OpCall]:
        """The op records of the run up to now (a script that raised: up to where it did)."""
        return self._ops.records()

    def hold_storages(self) -> None:
        """The script's end: what is alive now is alive at the end of the record
        (`StorageTracker.hold`)."""
        self._storages.hold()

    @property
    def failure(self):
        """The user-level call that raised during the run, if one did (a `FailedCall`)."""
        return self._functions.failure

    # -- running
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the body; leaves the trace unfinished (call `finish`)."""
        self._start()
        try:
            yield
        finally:
            self._stop()

    def __enter__(self) -> Trace:
        self._start()
        return self.trace

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop()
        explain = self.options.explain_failure
        if exc is not None and explain is not None and hasattr(exc, "add_note"):  # Python >= 3.11
            text = explain(self.failure)
            if text is not None:  # shown under the user's own traceback
                exc.add_note("ampscope: " + text)
        if exc_type is None:
            self.finish()
            if self.options.judge is not None:
                self.options.judge(self.trace)

    def _storage_records(self, outputs: Mapping[str, object], names: dict[int, list[str]],
                         params: list[nn.Parameter]) -> list[StorageRecord]:
        """Name what the step's storages are at its end, then take their records. `names`:
        the parameters' (`inventory.parameters_and_names`); `params`: the model's parameters."""
        storages = self._storages
        for p in params:
            if p.grad is not None:
                storages.register(p.grad, "gradient", names[id(p)][0] + ".grad")
        for optimizer in self._optimizers:
            for q, state in optimizer.state.items():
                param = names.get(id(q), ["<not in model>"])[0]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        storages.register(value, "optimizer_state", f"{param}:{key}")
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor):
                storages.register(value, "output", name)
        return storages.records(self.trace.ops)

    def finish(self, inputs: dict[str, torch.Tensor] | None = None,
               outputs: dict[str, torch.Tensor] | None = None) -> Trace:
        """Fill the trace from the recorders and the model's current tensors."""
        # The model is known by now: given, or adopted while the script ran (a script run that
        # called none stops before this: script/__init__.py).
        model, trace = cast(nn.Module, self.model), self.trace
        if self._replay is not None:
            self._replay.check()
        if self._ops.fallbacks and self.options.replay_blocks:  # the caller runs it again
            raise ReplayDoubt(self._ops.fallbacks[0])
        # First: a run that trained relabels its other passes' ops and calls.
        trace.passes = self._passes.records()
        # One walk of a model of thousands of modules for both.
        params, names = inventory.parameters_and_names(model)
        cls = type(model).__name__
        trace.model = ModelInfo(self.options.model_name or cls, cls, sum(p.numel() for p in params))
        trace.modules = self._tracker.records()
        trace.calls = self._functions.records()
        trace.ops = self._ops.records()
        trace.autocast_regions = self._regions.records()
        if self._values is not None:
            trace.values, self._values = self._values.records(trace.ops, trace.modules), None
        if self.options.setting is None:  # known by now: `finish` runs on a model
            trace.setting = observed_setting(model, self.options.device, trace,
                                             self._matmul_precision, self.options.gpu)
        trace.parameters = inventory.parameters(names, params)
        if self.options.rank_roles:
            trace.rank_roles = inventory.job_roles(params)
        trace.buffers = inventory.buffers(model)
        trace.optimizer_state = inventory.optimizer_state(self._optimizers, names)
        trace.storages = self._storage_records(outputs or {}, names, params)
        trace.held = inventory.held_state(model, self._arguments, params)
        self._arguments = {}
        self._optimizers = []
        trace.inputs = inventory.named_tensors(inputs if inputs is not None else (self._inputs or {}))
        self._inputs = None  # the trace keeps records, not the user's tensors
        if outputs:
            trace.outputs = inventory.named_tensors(outputs, role="output")
        notes = []
        if self._replay is not None and self._replay.replayed:
            notes.append(
                f"{self._replay.replayed} calls of identical blocks were not dispatched: their "
                "records are those of a recorded twin, replayed (the blocks and their inputs "
                "matched; see docs/how-it-works.md).")
        if self._storages.saved_unknown:
            notes.append(
                "Activations under activation checkpointing are counted as temporaries: this "
                "torch (before 2.10) can only read a saved tensor by unpacking it, which would "
                "run checkpointing's hooks; the memory peak is the same.")
        # (a trick's failure, said here in a run that cannot run again; unknown group sizes)
        notes += self._ops.notes()
        if self._inference.used:
            notes.append(
                "torch.inference_mode() ran as torch.no_grad() while traced: composite ops "
                "(linear, to) then split into the ops a device runs (addmm, _to_copy), with the "
                "same dtypes, and autocast sees each part as it does there.")
        for note in notes:
            trace.notes.append(note)
            log.info("%s", note)
        return trace
