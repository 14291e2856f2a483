"""The plain records a capture emits (what a record is: records/__init__.py). Dtypes are torch
names without the `torch.` prefix.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from operator import itemgetter
from typing import Generic, TypeVar, cast

import torch


class _Named(str, enum.Enum):
    """A name from a fixed set that is also the string itself: `Phase.FORWARD == "forward"`,
    it hashes as the string (a dict keyed by "forward" finds it), prints and formats as the
    string, and JSON writes it as the string, so records, reports and documents read as if it
    were one. A document read back holds members too (`Trace.from_dict`)."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]
    __hash__ = str.__hash__


class Phase(_Named):
    """The part of a step an op, call or storage belongs to (sampling steps are forward).
    "evaluation": a forward pass of a run that trained which was not itself a training pass
    (an evaluation or sampling pass between steps: runs/passes.py)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVALUATION = "evaluation"


class PassKind(_Named):
    """What a forward pass of the model was for (runs/passes.py)."""

    TRAIN = "train"  # the backward pass reached its output before the optimizer stepped
    EVALUATION = "evaluation"  # no gradient, or never backpropagated
    SAMPLING = "sampling"  # the same, followed by a sampling op (multinomial, argmax, topk)
    # Backpropagated, but its gradients were cleared (set to None) before any optimizer step
    # read them: a reference or warm-up pass, not part of a step.
    DISCARDED = "discarded"


@dataclass(frozen=True, slots=True)
class PassRecord:
    """One forward pass of the model: a call of the model outside any other module."""

    kind: PassKind
    grad: bool  # gradients were recorded (not under no_grad or inference_mode)
    first_op: int  # the op records from first_op up to end_op (excluded) are this pass's and
    end_op: int  # what followed it up to the next pass (its backward, the optimizer step)
    tokens: int  # elements of its first integer input (batch × sequence); 0 without one


PHASES: tuple[Phase, ...] = tuple(Phase)


# User-level calls that change dtype on purpose, as `capture.ops.func_name` spells them. A cast
# aten op under one of these is the user's; under any other call while autocast is on, it is
# autocast's.
EXPLICIT_CASTS = frozenset({
    "Tensor.to", "Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double",
    "Tensor.type", "Tensor.type_as", "Tensor.long", "Tensor.int", "Tensor.short",
    "Tensor.bool", "Tensor.byte", "Tensor.char", "Tensor.cpu", "Tensor.cuda",
})


# Names under which a model's forward takes its targets: such inputs get the role "target".
TARGET_NAMES = frozenset({"targets", "target", "labels", "label", "y"})


_dtype_names: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def module_label(name: str | None) -> str:
    """How a record's module name reads: "" is the model itself; None means no module was
    running (an optimizer step)."""
    if name is None:
        return "(no module)"
    return name or "(model)"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a record keeps of one tensor argument or result."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModuleCall:
    """One call of one module, in call order. In the backward phase `inputs` are the
    gradients flowing in (grad_output) and `outputs` the gradients it produced (grad_input)."""

    index: int
    name: str  # qualified name in the traced model ("" for the root)
    type: str  # class name
    phase: Phase
    depth: int  # nesting depth: the root module is 0
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A call made by user code at the torch level (`F.linear`, `Tensor.float`), seen by a
    TorchFunctionMode: the dtypes the user passed, before autocast changes anything."""

    index: int
    func: str  # e.g. "torch.nn.functional.linear", "Tensor.float"
    module: str | None  # innermost module running ("" = the model itself, None = no module)
    phase: Phase
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    source: str | None  # "model.py:61" in user code
    autocast: str | None  # autocast dtype in force ("bfloat16"), None when disabled
    step: int = 0  # how many times the model had been called when this call ran (1 = first)


@dataclass(frozen=True, slots=True)
class OpCall:
    """One aten op that really ran, seen by a TorchDispatchMode below autocast and autograd."""

    index: int
    op: str  # "aten.addmm.default"
    module: str | None  # as in FunctionCall
    phase: Phase
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    # True for the `_to_copy` casts that autocast inserted (not asked for by user code).
    autocast_cast: bool
    # The user-level call this op ran under (index into FunctionCall list), if any.
    caller: int | None
    source: str | None
    # Names of parameters/buffers among the inputs, aligned with `inputs` (None = activation).
    input_names: tuple[str | None, ...]
    # In backward: the autograd node that ran it (e.g. "AddmmBackward0").
    grad_fn: str | None = None
    # FLOPs by PyTorch's convention (runs/flops.py; 0 for ops without a formula), and the
    # same with causal attention counted only on the score entries the mask keeps.
    flops: int = 0
    flops_causal: int = 0
    # Aligned with `inputs` when one of them is a tensor subclass that stores its data in
    # another dtype (torchao's float8 training tensor: bfloat16 outside, float8_e4m3fn inside):
    # that dtype, else None. Empty when no input is such a tensor (nearly every op).
    input_data: tuple[str | None, ...] = ()
    # For a matmul, convolution or RNN op on float32 inputs: the fp32 precision its backend
    # had when it ran ("ieee", "tf32", "bf16": `torch.backends.<backend>.fp32_precision`, which
    # `torch.set_float32_matmul_precision` and `allow_tf32` set too). None for other ops.
    fp32_precision: str | None = None
    # For a collective (c10d's ops): how many ranks its process group holds, which a tensor-
    # parallel all-reduce's shapes do not tell. None for other ops.
    group: int | None = None
    # The Python numbers the op was called with as values (`masked_fill(mask, -1e9)`, the
    # `1e-12` of `x + 1e-12`, a clamp's bounds), in argument order, as floats: every float
    # argument, and ints where the op takes a value (not a dim or a size). Empty for most ops.
    scalars: tuple[float, ...] = ()
    # Ran inside code compiled with Inductor (`torch.compile`; runtime/compiled.py), forward or
    # the backward of a module whose forward did: on a GPU it would be part of a fused kernel.
    compiled: bool = False
    # For a collective whose group's ranks were read: the lowest and highest global rank of its
    # group, which tell the nodes it spans (every member lies on a node between theirs): a
    # 2-D mesh's FSDP group of 8 is as small as its tensor-parallel one, but one rank a node.
    # None for other ops, and where the ranks could not be read (the trace says so).
    group_span: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ParameterRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    grad_dtype: str | None  # None when no gradient was produced
    # Other names of the same storage (tied weights such as wte/lm_head).
    tied_to: tuple[str, ...] = ()
    # A sharded parameter (a DTensor: FSDP2, tensor parallel) has `shape` as the full tensor's
    # and this as the shape of the shard this process stores (its local tensor; its gradient
    # is sharded alike). None for an ordinary tensor, which this process holds whole.
    local_shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class BufferRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    persistent: bool


@dataclass(frozen=True, slots=True)
class OptimizerStateRecord:
    param: str
    key: str  # "exp_avg", "exp_avg_sq", "step", "momentum_buffer"
    dtype: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...] | None = None  # of a sharded (DTensor) state: its local shard


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """A tensor the model holds outside its parameters and buffers: a plain tensor attribute
    of one of its modules (a rotary table made at run time, running statistics), or one inside
    an object passed to it (a KV cache), as it was at the end of the run."""

    name: str  # "blocks.0.attn.cache_k" (an attribute) or "past_key_values.layers[0].keys"
    where: str  # "attribute" or "argument"
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InputRecord:
    name: str
    role: str  # "input" or "target"
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArgumentOrigin:
    """One tensor argument of a failed call, and where it came from."""

    dtype: str
    shape: tuple[int, ...]
    origin: str  # "parameter fc.weight", "model input x", "F.linear in fc at model.py:12"


@dataclass(frozen=True, slots=True)
class FailedCall:
    """The user-level call that raised, as the function mode saw it."""

    func: str
    module: str | None
    source: str | None
    arguments: tuple[ArgumentOrigin, ...]
    error: str  # "RuntimeError: mat1 and mat2 must have the same dtype, ..."


class StorageCategory(_Named):
    """What a storage is, in the precedence runs/memory.py applies (first match wins)."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    OUTPUT = "output"
    AUTOCAST_CAST = "autocast_cast"
    FP8_CAST = "fp8_cast"
    FP8_SCALE = "fp8_scale"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"


STORAGE_CATEGORIES: tuple[StorageCategory, ...] = tuple(StorageCategory)


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One storage of the step: a block of memory that any number of tensors view (a view or
    a tied weight is no new storage). Live from op `created` through op `freed`, inclusive;
    see runs/memory.py for how it is seen and categorised, docs/memory.md for the limits."""

    id: int  # in the order the storages were first seen
    nbytes: int
    dtype: str  # of the first tensor seen on it
    shape: tuple[int, ...]  # of that tensor
    created: int | None  # index of the op that made it; None: it existed before the step
    freed: int | None  # index of the last op it was live through; None: live at the end
    category: StorageCategory
    names: tuple[str, ...] = ()  # "transformer.wte.weight", "lm_head.weight"; ".grad", ":exp_avg"
    module: str | None = None  # where it was made, as OpCall.module
    phase: Phase | None = None
    op: str | None = None  # the op that made it ("aten.mm.default")
    saved: bool = False  # saved by autograd for backward

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None


_Record = TypeVar("_Record")
_builders: dict[type, Callable[[Iterable[tuple]], list]] = {}


def from_rows(cls: type[_Record], rows: Iterable[tuple]) -> list[_Record]:
    """`[cls(*row) for row in rows]` for records built from a recorder's rows, each of which
    holds every field in order (a row of another length raises: a recorder's row has every
    field by construction, tests/test_capture.py).

    A frozen dataclass's generated `__init__` sets each field through `object.__setattr__`; a
    step's records (one per op, call and storage: tens of thousands on a large model) are
    instead filled as instances of a plain class with the same slots, by ordinary attribute
    stores, and then made records by `__class__` assignment, which CPython allows between
    classes of the same layout: a third of the cost. The records are the same: of the record
    class, equal to and hashing as `cls(*row)`, frozen as ever."""
    build = _builders.get(cls)
    if build is None:
        build = _builders[cls] = _builder(cls)
    return build(rows)


class RowLayout(Generic[_Record]):
    """A record's row, as the recorders keep it while a run goes on: a plain tuple of the
    record's dataclass fields, in their order (cheap to append by the hundred thousand), made
    records at the end by `records`. Positions are read from the dataclass, never written as
    numbers: `OP_ROW.at("caller")`, and `OP_ROW.replace(row, caller=3)` for a changed copy. A
    field added to the record moves every position with it (tests/test_architecture.py fails
    on a literal row index in the recorders)."""

    def __init__(self, cls: type[_Record]) -> None:
        self.cls = cls
        self.fields = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
        self._positions = {name: i for i, name in enumerate(self.fields)}

    def at(self, name: str) -> int:
        """The position of field `name` in a row."""
        return self._positions[name]

    def replace(self, row: tuple, **changes: object) -> tuple:
        """`row` with the named fields changed."""
        out = list(row)
        for name, value in changes.items():
            out[self._positions[name]] = value
        return tuple(out)

    def replacer(self, *names: str) -> Callable[..., tuple]:
        """`replace` for a hot loop: a function `(row, *values) -> row` with the fields
        `names` replaced by `values`, in that order. It picks every field out of `row +
        values` with one `itemgetter`, made once (both in C: the replay of repeated blocks
        copies tens of thousands of rows a step with it). Same result as `replace`
        (tests/test_capture.py)."""
        unknown = [n for n in names if n not in self._positions]
        if unknown:
            raise KeyError(f"{self.cls.__name__} has no field {unknown[0]!r}")
        width = len(self.fields)
        given = {name: width + i for i, name in enumerate(names)}  # where each value lands
        pick = itemgetter(*(given.get(f, i) for i, f in enumerate(self.fields)))

        def replace(row: tuple, *values: object) -> tuple:
            return pick(row + values)

        return replace

    def records(self, rows: Iterable[tuple]) -> list[_Record]:
        return from_rows(self.cls, rows)


def _builder(cls: type) -> Callable[[Iterable[tuple]], list]:
    names = [f.name for f in fields(cls)]
    if cls.__bases__ != (object,) or cls.__dict__.get("__slots__") != tuple(names):
        return lambda rows: [cls(*row) for row in rows]  # not a plain slotted record
    blank = type(f"_Blank{cls.__name__}", (), {"__slots__": tuple(names)})
    targets = ", ".join(f"record.{name}" for name in names)
    source = ("def build(rows):\n"
              "    records = []\n"
              "    append = records.append\n"
              "    for row in rows:\n"
              "        record = new(blank)\n"
              f"        {targets}, = row\n"
              "        record.__class__ = cls\n"
              "        append(record)\n"
              "    return records\n")
    scope = {"new": object.__new__, "blank": blank, "cls": cls}
    exec(source, scope)  # the source is made here, from the class's own fields
    return cast("Callable[[Iterable[tuple]], list]", scope["build"])  # `build`, defined above


# The rows the op recorder keeps (runs/ops.py) and the replay engine copies
# (runs/windows.py).
OP_ROW = RowLayout(OpCall)
FUNCTION_ROW = RowLayout(FunctionCall)
