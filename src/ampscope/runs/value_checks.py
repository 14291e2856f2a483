"""`ValueRecorder`: what a real run's values say, for the checks of kinds 3 and 4 (values out
of the format's range, updates that round away), recorded when `CaptureOptions.values` asks.

- Each op's floating outputs are reduced to their min and max (`torch.aminmax`, one reduction
  per output, NaN-propagating): the op that first made inf or NaN out of finite inputs, and how
  many ops returned one. A dispatch mode of its own, entered just below the op recorder
  (runs/ops.py), so that its op order is the recorder's and its index the op's record's; its
  reductions run with every mode off, so no recorder sees them.
- An input's min and max are known from the op that made it (kept by tensor, valid while the
  tensor's version counter, shared with its views, has not moved): inputs cost no reduction,
  except tensors made outside the run (parameters, data) once each and those an op writes in
  place (before it runs). A view's values are its base's (an upper bound for a part of them).
- Each module's forward outputs: their min and max, read from the op that made them.
- Each float16/bfloat16 parameter an optimizer steps on: copied when the step begins, compared
  when it ends: the elements whose gradient was nonzero that came out unchanged.

Reductions stay on the device, as 0-d tensors: they are read in batches (one transfer every
few thousand reductions, and at the end), so a GPU run is not synchronised after every op.
Tensor subclasses, fake and meta tensors, and dtypes other than float16/bfloat16/float32/float64
are not looked at.

Namesakes, the same concern at other layers: `records/value_checks.py` (the records) and
`analysis/checks/value_checks.py` (the rules that judge them).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ampscope.nested import tensors_in, walk
from ampscope.records import ModuleCall, OpCall, Phase, dtype_name
from ampscope.records.value_checks import ModuleMax, NonFinite, StuckUpdate, ValueChecks
from ampscope.runs.modules import ModuleTracker, in_backward
from ampscope.runs.tensor_meta import results_of
from ampscope.torchcompat.autograd import write_count
from ampscope.torchcompat.dispatch import (
    disable_torch_dispatch,
    higher_order,
    modes_off,
    no_torch_function,
    op_schema,
    run_decomposed,
)
from ampscope.torchcompat.dynamo import UncompiledDispatchMode

_PLAIN = frozenset({torch.Tensor, nn.Parameter})
_CHECKED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_HALF = frozenset({torch.float16, torch.bfloat16})
_DETACH = torch.ops.aten.detach.default
# Ops whose output is uninitialised memory: whatever bits it holds are no computation's.
_GARBAGE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                      "empty_permuted", "resize_"})
_FLUSH = 4096  # 0-d results read back at once
_CANDIDATES = 1000  # ops kept that made a non-finite value (the first per phase is reported)
_FINITE = -1  # the slot of a tensor with no element


class _Facts:
    """What the recorder needs of one op overload, worked out on its first call."""

    __slots__ = ("op", "name", "recorded", "view", "written", "garbage", "scalars")

    def __init__(self, func) -> None:
        self.op = func  # held: the facts are looked up by the op's id
        self.name = str(func)  # "aten.mm.default", as the op's record names it
        # As the op recorder: profiler markers, prim queries and detaches have no record.
        self.recorded = func.namespace not in ("profiler", "prim") and func is not _DETACH
        self.view = bool(func.is_view)
        self.written = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        self.garbage = func.overloadpacket.__name__ in _GARBAGE
        # It takes Python numbers as values (masked_fill's, full's): one may be inf or NaN.
        self.scalars = any(kind in str(a.type) for a in op_schema(func).arguments
                           for kind in ("number", "float"))


_facts: dict[int, _Facts] = {}


def _checked(t) -> bool:
    return (type(t) in _PLAIN and t.dtype in _CHECKED and t.layout is torch.strided
            and not t.is_meta)


class ValueRecorder(UncompiledDispatchMode):
    """Enter it below the op recorder and before the module tracker (its module hook must see
    the tracker's call still open); `records` when the run is over."""

    supports_higher_order_operators = True

    def __init__(self, tracker: ModuleTracker, op_rows: list,
                 names: dict[int, tuple[weakref.ref, str]]) -> None:
        super().__init__()
        self._tracker, self._rows, self._names = tracker, op_rows, names
        self._pending: list[torch.Tensor] = []  # 0-d results not read yet, by slot
        self._values: list[float] = []  # read ones, by slot (min at 2k, max at 2k + 1)
        # id(tensor) -> (weak reference, version, slot, written in place): tensors whose min
        # and max are known
        self._known: dict[int, tuple[weakref.ref, int, int, bool]] = {}
        self._prune_at = 1 << 14
        # (op index, op name, input slots, output slots, output dtypes, constant non-finite,
        # uninitialised), for the ops not judged yet
        self._ops: list[tuple] = []
        self._candidates: list[tuple[int, str, str, str]] = []  # index, op, kind, dtype
        self._nonfinite_ops = self._checked_ops = 0
        self._module_slots: list[tuple[int, str, int]] = []  # module call index, dtype, slot
        self._steps: dict[int, list[tuple]] = {}  # id(optimizer) -> its open step's copies
        self._stuck: list[tuple[str, str, int, int]] = []  # name, dtype, stuck, updated
        self._step_count = 0
        self._handles: list = []

    # -- entering
    def __enter__(self) -> ValueRecorder:
        super().__enter__()
        self._handles = [register_module_forward_hook(self._module_output),
                         register_optimizer_step_pre_hook(self._step_begin),
                         register_optimizer_step_post_hook(self._step_end)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    # -- slots
    def _measure(self, t: torch.Tensor, written: bool = False) -> int:
        """A slot for `t`'s min and max, reduced now (with every mode off); `written`: by an op
        in place, whose version counter may move once more as the op returns."""
        if t.numel() == 0:
            return _FINITE
        low, high = torch.aminmax(t)
        slot = len(self._values) + len(self._pending)
        self._pending += (low, high)
        self._known_as(t, slot, written)
        return slot

    def _known_as(self, t: torch.Tensor, slot: int, written: bool = False) -> None:
        known = self._known
        known[id(t)] = (weakref.ref(t), write_count(t), slot, written)
        if len(known) > self._prune_at:  # drop the tensors that are gone
            for key in [k for k, (ref, *_) in known.items() if ref() is None]:
                del known[key]
            self._prune_at = max(self._prune_at, 2 * len(known))

    def _slot(self, t: torch.Tensor) -> int:
        """`t`'s slot: known from the op that made it, or reduced now."""
        entry = self._known.get(id(t))
        if entry is not None and entry[0]() is t:
            # autograd counts an in-place write after the op has run: once more then
            version, known, written = write_count(t), entry[1], entry[3]
            if version != -1 and (version == known or (written and version == known + 1)):
                return entry[2]
        return self._measure(t)

    # -- ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if higher_order(func):  # flex_attention: its aten ops come through one by one
            return run_decomposed(self, func, args, kwargs)
        if kwargs is None:
            kwargs = {}
        facts = _facts.get(id(func))
        if facts is None:
            facts = _facts[id(func)] = _Facts(func)
        if not _PLAIN.issuperset(types) or not (facts.recorded or facts.view):
            return func(*args, **kwargs)
        index = len(self._rows)  # the op recorder appends this op's record when it returns
        before: dict[int, int] = {}
        if facts.written:
            with disable_torch_dispatch(), no_torch_function():  # (modes_off, for less)
                for t in self._written(facts, args, kwargs):
                    before[id(t)] = self._slot(t)
        out = func(*args, **kwargs)
        with disable_torch_dispatch(), no_torch_function():
            self._after(index, facts.name, facts, args, kwargs, out, before)
            if len(self._pending) >= _FLUSH:
                self._flush()
        return out

    @staticmethod
    def _written(facts: _Facts, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for i, name in facts.written:
            value = args[i] if i < len(args) else kwargs.get(name)
            if value is not None:
                walk((value,), found)
        return [t for t in found if _checked(t)]

    def _after(self, index: int, name: str, facts: _Facts, args: tuple, kwargs: dict, out,
               before: dict[int, int]) -> None:
        inputs: list = []
        walk(args, inputs)
        if kwargs:
            walk(kwargs.values(), inputs)
        inputs = [t for t in inputs if _checked(t)]
        outputs = results_of(out)
        if facts.written:  # in place: what it wrote is its output
            seen = {id(t) for t in outputs}
            outputs += [t for t in self._written(facts, args, kwargs) if id(t) not in seen]
        outputs = [t for t in outputs if _checked(t)]
        if not outputs:
            return
        if facts.view:  # the same values as its input, seen through another shape
            if inputs:
                base = before.get(id(inputs[0]))
                slot = base if base is not None else self._slot(inputs[0])
                for t in outputs:
                    self._known_as(t, slot)
            return
        in_slots = tuple(before[id(t)] if id(t) in before else self._slot(t) for t in inputs)
        out_slots = tuple(self._measure(t, id(t) in before) for t in outputs)
        self._ops.append((index, name, in_slots, out_slots,
                          tuple(dtype_name(t.dtype) for t in outputs),
                          facts.scalars and _nonfinite_constant(args, kwargs), facts.garbage))

    # -- modules
    def _module_output(self, module: nn.Module, args, output) -> None:
        if in_backward():  # a checkpointed block's recomputation: its forward call was seen
            return
        call = self._tracker.innermost_forward()  # this hook runs before the tracker's closes it
        if call is None or call.module_id != id(module):
            return
        with modes_off(), torch.no_grad():
            for t in tensors_in(output):
                if _checked(t):
                    self._module_slots.append((call.index, dtype_name(t.dtype), self._slot(t)))

    # -- optimizer steps
    def _step_begin(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if getattr(optimizer, "bf16_stochastic_round", False):  # rounds up or down at random
            return
        copies = []
        with modes_off(), torch.no_grad():
            for g, group in enumerate(optimizer.param_groups):
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor):
                    lr = lr.item()
                if lr == 0:  # a warmup's first step: nothing is meant to move
                    continue
                for i, p in enumerate(group["params"]):
                    grad = getattr(p, "grad", None)
                    if (type(p) not in _PLAIN or p.dtype not in _HALF or p.is_meta
                            or grad is None or not _checked(grad)):
                        continue
                    entry = self._names.get(id(p))
                    name = entry[1] if entry is not None and entry[0]() is p \
                        else f"param_groups[{g}][{i}]"
                    copies.append((p, name, p.detach().clone(), grad != 0))
        if copies:
            self._steps[id(optimizer)] = copies

    def _step_end(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        copies = self._steps.pop(id(optimizer), None)
        if not copies:
            return
        self._step_count += 1
        with modes_off(), torch.no_grad():
            for p, name, before, moving in copies:
                if _has_master(optimizer.state.get(p), p):
                    continue
                stuck = ((p.detach() == before) & moving).sum()
                slot = len(self._values) + len(self._pending)
                self._pending += (stuck, moving.sum())
                self._stuck.append((name, dtype_name(p.dtype), slot, slot + 1))

    # -- reading back
    def _flush(self) -> None:
        """Read the pending results (one transfer per device and dtype), then judge the ops
        recorded so far."""
        pending, start = self._pending, len(self._values)
        self._values.extend([0.0] * len(pending))
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(pending):
            groups.setdefault((t.device, t.dtype), []).append(i)
        for positions in groups.values():
            read = torch.stack([pending[i] for i in positions]).tolist()
            for i, value in zip(positions, read, strict=True):
                self._values[start + i] = float(value)
        self._pending = []
        for index, name, ins, outs, dtypes, constant, garbage in self._ops:
            if garbage:
                continue
            self._checked_ops += 1
            kinds = [(kind, dtype) for slot, dtype in zip(outs, dtypes, strict=True)
                     if (kind := self._kind(slot))]
            if not kinds:
                continue
            self._nonfinite_ops += 1
            # where it was made: not from an input that held it, nor from a constant
            if not constant and not any(self._kind(s) for s in ins) \
                    and len(self._candidates) < _CANDIDATES:
                self._candidates.append((index, name, *kinds[0]))
        self._ops = []

    def _kind(self, slot: int) -> str:
        """"" for finite values, else which non-finite values the slot's tensor held."""
        if slot == _FINITE:
            return ""
        low, high = self._values[slot], self._values[slot + 1]
        if low != low or high != high:
            return "NaN"
        kinds = [k for k, on in (("+inf", high == math.inf), ("-inf", low == -math.inf)) if on]
        return " and ".join(kinds)

    def _max_abs(self, slot: int) -> float:
        if slot == _FINITE:
            return 0.0
        low, high = self._values[slot], self._values[slot + 1]
        return math.nan if low != low or high != high else max(-low, high)

    def records(self, ops: list[OpCall], modules: list[ModuleCall]) -> ValueChecks:
        """The records, once the run is over and its ops' and modules' records are final
        (their phases relabelled)."""
        with modes_off():
            self._flush()
        self._known, self._steps = {}, {}
        return ValueChecks(
            first_nonfinite=self._firsts(ops), nonfinite_ops=self._nonfinite_ops,
            checked_ops=self._checked_ops, module_max=self._module_max(modules),
            stuck_updates=self._stuck_updates(), optimizer_steps=self._step_count)

    def _firsts(self, ops: list[OpCall]) -> tuple[NonFinite, ...]:
        firsts: dict[str, NonFinite] = {}
        for index, name, kind, dtype in self._candidates:
            op = ops[index] if index < len(ops) and ops[index].op == name else None
            phase = str(op.phase) if op is not None else Phase.FORWARD.value
            if phase not in firsts:
                firsts[phase] = NonFinite(index, name, phase, op.module if op else None,
                                          op.source if op else None, kind, dtype)
        return tuple(firsts.values())

    def _module_max(self, modules: list[ModuleCall]) -> tuple[ModuleMax, ...]:
        found: dict[tuple[str, str], list] = {}  # (module, dtype) -> [type, max, calls]
        for call_index, dtype, slot in self._module_slots:
            call = modules[call_index] if call_index < len(modules) else None
            if call is None or call.phase not in (Phase.FORWARD, Phase.EVALUATION):
                continue
            entry = found.setdefault((call.name, dtype), [call.type, 0.0, 0])
            value, high = self._max_abs(slot), entry[1]
            entry[1] = math.nan if value != value or high != high else max(high, value)
            entry[2] += 1
        return tuple(ModuleMax(name, kind, dtype, high, calls)
                     for (name, dtype), (kind, high, calls) in found.items())

    def _stuck_updates(self) -> tuple[StuckUpdate, ...]:
        found: dict[tuple[str, str], list[int]] = {}
        for name, dtype, stuck, updated in self._stuck:
            entry = found.setdefault((name, dtype), [0, 0, 0])
            entry[0] += int(self._values[stuck])
            entry[1] += int(self._values[updated])
            entry[2] += 1
        return tuple(StuckUpdate(name, dtype, *counts) for (name, dtype), counts in found.items())


def _nonfinite_constant(args: tuple, kwargs: dict) -> bool:
    """A float argument that is inf or NaN (masked_fill's -inf, full's -inf): the op's
    non-finite output is the program's constant, not a value out of range."""
    return any(type(x) is float and not math.isfinite(x)
               for v in (*args, *kwargs.values())
               for x in (v if type(v) in (list, tuple) else (v,)))


def _has_master(state: dict | None, p: torch.Tensor) -> bool:
    """The optimizer keeps a float32 copy of `p` (master weights) that `p` is the rounding of:
    its small updates accumulate there, and `p` moves when they add up."""
    for value in (state or {}).values():
        if (isinstance(value, torch.Tensor) and type(value) in _PLAIN
                and value.dtype == torch.float32 and value.shape == p.shape
                and torch.equal(value.to(p.dtype), p)):
            return True
    return False
