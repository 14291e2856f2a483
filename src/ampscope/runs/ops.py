"""The aten ops that really ran: `OpRecorder` (a TorchDispatchMode) sits below autocast and
autograd and sees every op, including the `_to_copy` casts autocast inserted and every backward
and optimizer op, each recorded under the user-level call it ran in (runs/functions.py), which
tells which `_to_copy` is autocast's (docs/how-it-works.md#how-autocast-casts-are-recognised).

Namesakes, the same concern at another layer: `torchcompat/ops.py`."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ampscope.precision import matmul
from ampscope.records import (
    OP_ROW,
    OpCall,
    Phase,
)
from ampscope.runs import fake_cache, foreach, progress, shortcuts
from ampscope.runs.flops import formula as flop_formula
from ampscope.runs.flops import op_flops
from ampscope.runs.functions import PENDING, UserCalls
from ampscope.runs.memory import StorageTracker
from ampscope.runs.modules import ModuleTracker, PhaseClock
from ampscope.runs.tensor_meta import (
    PLAIN_TENSORS,
    data_dtypes,
    has_dtensor,
    local_tensor,
    local_values,
    metas_of,
    no_torch_function,
    results_of,
    walk,
)
from ampscope.runtime.compiled import in_compiled
from ampscope.torchcompat import ops as private_ops
from ampscope.torchcompat.autograd import current_autograd_node, graph_task_id
from ampscope.torchcompat.dispatch import (
    OpOverload,
    higher_order,
    op_schema,
    run_decomposed,
)
from ampscope.torchcompat.distributed import NAMESPACES as COLLECTIVE_NAMESPACES
from ampscope.torchcompat.distributed import CollectiveGroup, GroupSizeUnknown, collective_group
from ampscope.torchcompat.dynamo import UncompiledDispatchMode
from ampscope.torchcompat.fake import FakeTensor
from ampscope.tricks import Trick, enabled, fell_back

_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
log = logging.getLogger(__name__)


# Argument types that take a number as a value: Scalar ("number"), float, and Tensor, where a
# Python number arrives as itself (`x + 1e-12` is `aten.add.Tensor(x, 1e-12)`).
_VALUE_TYPES = frozenset({"number", "Optional[number]", "float", "Optional[float]", "Tensor"})
_SKIPPED_NAMESPACES = ("profiler", "prim")  # profiler markers; prim.device queries of fake tensors
_DETACH = torch.ops.aten.detach.default


class _OpFacts:
    """What the recorder needs to know of one op overload, worked out on its first call."""

    __slots__ = ("op", "name", "recorded", "cast", "flops", "trick", "precision", "collective",
                 "values")

    def __init__(self, func) -> None:
        self.op = func  # held: the facts are looked up by the op's id
        self.name = str(func)  # "aten.addmm.default", what the records hold
        # Not recorded: no computation (see _SKIPPED_NAMESPACES), or a detach, which changes no
        # dtype and reaches a mode or not by how the step runs
        # (docs/how-it-works.md#what-each-recorder-sees says why).
        self.recorded = func.namespace not in _SKIPPED_NAMESPACES and func is not _DETACH
        self.cast = func is private_ops.TO_COPY
        self.flops = flop_formula(func)
        # Which float32 precision setting governs it: "matmul", "conv", "rnn" or None.
        self.precision = matmul.precision_kind(self.name)
        # A collective, whose process group's size and span of ranks the record keeps.
        self.collective = func.namespace in COLLECTIVE_NAMESPACES
        # The arguments, by position and by name, that take a value: a Python int there is a
        # number the op computes with (`x * 2`, `masked_fill(mask, -10**9)`), elsewhere a dim
        # or a size. A Python float is a value wherever it is.
        self.values = _value_arguments(func)
        # The speed trick that may answer it on fake tensors (tricks.py), as its place in
        # _OP_TRICKS: the recorder's per-op test is then a tuple lookup (an Enum member
        # hashes in Python).
        self.trick = _OP_TRICKS.index(
            Trick.FOREACH if func.__name__.startswith(private_ops.FOREACH_PREFIX)
            else Trick.SHORTCUTS if func in shortcuts.OPS else Trick.FAKE_CACHE)


_op_facts: dict[int, _OpFacts] = {}
# The tricks that answer ops, in the order of their places (_FOREACH, ...).
_OP_TRICKS = (Trick.FOREACH, Trick.SHORTCUTS, Trick.FAKE_CACHE)
_FOREACH, _SHORTCUTS, _FAKE_CACHE = range(len(_OP_TRICKS))
_NONES = tuple((None,) * n for n in range(16))


def _value_arguments(func: OpOverload) -> frozenset[int | str]:
    """The positions and names of the op's arguments that take a value (_OpFacts.values)."""
    if not isinstance(func, OpOverload):  # a higher-order operator: no schema
        return frozenset()
    return frozenset(key for i, a in enumerate(op_schema(func).arguments)
                     if str(a.type) in _VALUE_TYPES for key in (i, a.name))


def _scalars(args: tuple, kwargs: dict, values: frozenset) -> tuple[float, ...]:
    """The Python numbers among an op's arguments that are values (OpCall.scalars): floats
    anywhere, ints where `values` (_OpFacts.values) says the argument takes one; never bools
    (`type(True) is bool`). Type tests in a plain loop: this runs for every op, and a
    comprehension (or enumerate) costs it two to four times as much."""
    found: tuple[float, ...] = ()
    i = 0
    for a in args:
        t = type(a)
        if t is float or (t is int and i in values):
            found += (float(a),)
        i += 1  # noqa: SIM113 - enumerate doubles this per-op loop's cost
    if kwargs:
        for k, a in kwargs.items():
            t = type(a)
            if t is float or (t is int and k in values):
                found += (float(a),)
    return found


class OpRecorder(UncompiledDispatchMode):
    supports_higher_order_operators = True  # run decomposed: each of their ops is recorded
    def __init__(self, tracker: ModuleTracker, phase: PhaseClock, functions: UserCalls,
                 names: dict[int, tuple[weakref.ref, str]]):
        super().__init__()
        # One row per recorded op (records.OP_ROW); `records()` makes them OpCalls.
        self.rows: list[tuple] = []
        # Called with (func, args) before each op runs; may raise as the op's real kernel would
        # (predict mode checks what fake tensors' meta kernels do not).
        self.check: Callable[[OpOverload, tuple], None] | None = None
        # Told of each op's results, to follow the storages they allocate (runs/memory.py).
        self.storages: StorageTracker | None = None
        # On fake tensors, the speed tricks that may answer ops (`use_tricks`; runs/__init__.py
        # lists them), and C++ reads of a fake tensor's device.
        self.tricks: frozenset[Trick] = frozenset()
        self._answering = (False,) * len(_OP_TRICKS)  # by _OpFacts.trick: is it on?
        self.prim_device: bool | None = False  # None: decided on the first fake device read
        # A note for each trick that failed during the run (its op ran the exact way).
        self.fallbacks: list[str] = []
        # Collectives whose process group's size could not be read: op name -> why (the first
        # reason of each op; its records keep `group` None, and the trace says so).
        self.unknown_groups: dict[str, str] = {}
        # Collectives whose group's size was read but not its ranks: op name -> why (their
        # records keep `group_span` None; a step time picks their link by the size).
        self.unknown_spans: dict[str, str] = {}
        self._cached = fake_cache.CachedAnswers()
        # The modules whose forward ran compiled code (runtime/compiled.py): their backward did.
        self._compiled_modules: set[str] = set()
        functions.op_log = self.rows
        self._tracker = tracker
        self._phase = phase
        self._functions = functions
        self._names = names  # id(tensor) -> (weakref, parameter/buffer name)
        # The device the run's ops stand for (a virtual device's, whose tensors live on the
        # CPU); None: each op's own tensors' device.
        self.device: str | None = None
        # Told of each op, when the run was started inside `progress.reporting`.
        found = progress.listener()
        self._progress = progress.Reporter(*found) if found is not None else None

    def records(self) -> list[OpCall]:
        return OP_ROW.records(self.rows)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor and (
                self.prim_device if self.prim_device is not None else self._prim_device()):
            # C++ code reading a fake tensor's device (the autograd engine for every gradient,
            # a foreach op's checks for every list entry) lands here: tens of thousands of
            # reads on a large model's step. The answer is the fake tensor's own, the one
            # FakeTensorMode gives, without the round trip through the modes below.
            fake = args[0]
            return _META if fake.fake_mode.in_kernel_invocation else fake.fake_device
        if kwargs is None:
            kwargs = {}
        if self.check is not None:
            self.check(func, args)
        # By id: an OpOverload hashes in Python; the facts hold the op, so its id stays its own.
        facts = _op_facts.get(id(func))
        if facts is None:
            if higher_order(func):  # flex_attention: the aten ops it runs are recorded
                return run_decomposed(self, func, args, kwargs)
            facts = _op_facts[id(func)] = _OpFacts(func)
        out = foreach.NOT_THINNED
        if self._answering[facts.trick]:
            try:
                out = self._answer(facts.trick, func, args, kwargs)
            except Exception as e:  # noqa: BLE001 - the exact path runs the op instead
                out = self._fell_back(_OP_TRICKS[facts.trick], e)
        if out is foreach.NOT_THINNED:
            out = func(*args, **kwargs)
        if facts.recorded:
            # Its reads are no user's calls (runs/tensor_meta.py): most of the recording's cost.
            with no_torch_function():
                self._record(func, facts, types, args, kwargs, out)
        return out

    def _record(self, func: OpOverload, facts: _OpFacts, types, args: tuple, kwargs: dict,
                out) -> None:
        """The op's row (records.OP_ROW), appended, and its results told to the storages."""
        functions = self._functions
        functions.ops_seen += 1
        inputs: list[torch.Tensor] = []
        walk(args, inputs)
        if kwargs:
            walk(kwargs.values(), inputs)
        seen_args, seen_kwargs, seen_out, named = args, kwargs, out, inputs
        if not PLAIN_TENSORS.issuperset(types) and has_dtensor(inputs):
            # A DTensor's op (tensor parallelism, FSDP2's sharded optimizer step): the rank
            # runs it on its local shards, and its FLOPs and shapes are theirs.
            seen_args, seen_kwargs, seen_out = local_values((args, kwargs, out))
            inputs = [local_tensor(t) for t in inputs]
        backward = graph_task_id() != -1  # -1 outside a backward pass
        module = self._tracker.current_in(backward)
        grad_fn = node = None
        if backward or functions.current_phase == "backward":
            # (not yet in the engine: the gradient seed of loss.backward())
            phase, caller, autocast_cast = Phase.BACKWARD, None, False
            node = current_autograd_node()
            if node is not None:
                grad_fn = node.name()
            # Inductor compiles a compiled forward's backward too: a module's backward ops are
            # compiled where its forward ops were.
            compiled = module in self._compiled_modules
        else:
            phase = self._phase.now()
            caller = functions.current
            autocast_cast = (facts.cast and caller is not None and not functions.current_is_cast
                             and functions.current_autocast is not None)
            compiled = in_compiled()
            if compiled and module is not None:
                self._compiled_modules.add(module)
        if facts.flops is not None:
            flops, flops_causal = op_flops(func, seen_args, seen_kwargs, seen_out, facts.flops)
        else:
            flops = flops_causal = 0
        results = results_of(seen_out)
        outputs = metas_of(results)
        group = self._group(facts.name, func, args, kwargs) if facts.collective else None
        rows = self.rows
        index = len(rows)
        if self.storages is not None:
            self.storages.on_op(index, results, outputs, node)
        rows.append((
            index, facts.name, module, phase,
            metas_of(inputs), outputs, autocast_cast, caller,
            None if caller is None else (
                functions.current_source if functions.current_source is not PENDING
                else functions.source_now()),
            self._names_of(named), grad_fn, flops, flops_causal, data_dtypes(inputs),
            None if facts.precision is None else self._fp32_precision(facts.precision, inputs),
            None if group is None else group.size,
            _scalars(args, kwargs, facts.values), compiled,
            None if group is None else group.span,
        ))
        if self._progress is not None:
            self._progress.op(index + 1, phase)

    def notes(self) -> list[str]:
        """What the trace says of the run's ops: each trick that failed, each collective whose
        process group's size is not known, and each whose group's ranks are not."""
        return [f"A speed trick was turned off: {note}." for note in self.fallbacks] + [
            f"The process group of {op} is not in its records: {why}; a distributed report "
            "takes its group to be the world." for op, why in self.unknown_groups.items()] + [
            f"The ranks of {op}'s process group are not in its records: {why}; a step time "
            "places the group by its size (NVLink up to a node's GPUs), which is wrong for a "
            "small group whose ranks lie on several nodes (FSDP's on a 2-D mesh)."
            for op, why in self.unknown_spans.items()]

    def _group(self, name: str, func: OpOverload, args: tuple, kwargs: dict
               ) -> CollectiveGroup | None:
        """The process group a collective ran over; None where it names none, or where its
        size cannot be read (kept in `unknown_groups`, for the trace's note). One whose ranks
        cannot be read has no span (kept in `unknown_spans`)."""
        try:
            group = collective_group(func, args, kwargs)
        except GroupSizeUnknown as e:
            self.unknown_groups.setdefault(name, str(e))
            return None
        if group is not None and group.why is not None:
            self.unknown_spans.setdefault(name, group.why)
        return group

    def _fp32_precision(self, kind: str, inputs: list[torch.Tensor]) -> str | None:
        """The fp32 precision a matmul-class op on float32 inputs ran with, read when it ran:
        a script may set TF32 at any point of its run."""
        if not inputs or inputs[0].dtype is not torch.float32:
            return None
        return matmul.fp32_precision(kind, self.device or inputs[0].device.type)

    def report_progress(self, ops: int, phase: str) -> None:
        """Tell the progress callback, if any, how many ops are recorded (a replay appends
        them without dispatching)."""
        if self._progress is not None:
            self._progress.op(ops, phase)

    def use_tricks(self, allowed: frozenset[Trick]) -> None:
        """Let the tricks in `allowed` answer ops (a predicted run's), those this torch build
        has (tricks.enabled)."""
        self.tricks = frozenset(t for t in allowed if t in _OP_TRICKS and enabled(t))
        self._answering = tuple(t in self.tricks for t in _OP_TRICKS)
        self.prim_device = None if Trick.PRIM_DEVICE in allowed else False

    def _prim_device(self) -> bool:
        # Decided when a fake tensor's device is first read: a real run never asks.
        self.prim_device = enabled(Trick.PRIM_DEVICE)
        return self.prim_device

    def _answer(self, trick: int, func: OpOverload, args: tuple, kwargs: dict):
        """The answer of the trick in place `trick` of _OP_TRICKS (or NOT_THINNED)."""
        if trick == _FOREACH:
            return foreach.thinned_call(func, args, kwargs)
        if trick == _SHORTCUTS:
            return shortcuts.answer(func, args, kwargs)
        return self._cached.call(func, args, kwargs)

    def _fell_back(self, trick: Trick, error: Exception):
        """A trick failed on an op: off for the rest of the run, the op runs the exact way."""
        self.tricks = self.tricks - {trick}
        self._answering = tuple(t in self.tricks for t in _OP_TRICKS)
        self.fallbacks.append(fell_back(trick, error))
        log.info("%s", self.fallbacks[-1])
        return foreach.NOT_THINNED

    def _names_of(self, inputs: list[torch.Tensor]) -> tuple[str | None, ...]:
        """The parameter or buffer name of each input, None for the others."""
        # Each (weak reference, name) or None; Any: with no name among them it is returned as is.
        found: tuple[Any, ...] = tuple(map(self._names.get, map(id, inputs)))
        if not any(found):  # no parameter or buffer among them (most ops): a shared tuple
            return _NONES[len(found)] if len(found) < len(_NONES) else found
        return tuple(entry[1] if entry is not None and entry[0]() is t else None
                     for entry, t in zip(found, inputs, strict=True))
