"""`ValueChecks`: what a real run's values said, as plain records (no tensor is kept).

Recorded only when asked (`CaptureOptions.values`) and only where tensors hold values (never
in a predicted run): the first op that made inf or NaN out of finite inputs, how many ops
returned a non-finite value, the largest |x| each module returned, and the 16-bit parameters
whose updates rounded away in the optimizer step.

Namesakes, the same concern at other layers: `runs/value_checks.py` (the recorder) and
`analysis/checks/value_checks.py` (the rules that read these records).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class NonFinite:
    """An op whose floating output held inf or NaN while none of its floating inputs (nor a
    float argument, as masked_fill's -inf) did: where a non-finite value was made."""

    index: int  # in Trace.ops
    op: str  # "aten.mm.default"
    phase: str
    module: str | None
    source: str | None  # "train.py:12"
    kind: str  # "+inf", "-inf", "+inf and -inf" or "NaN"
    dtype: str  # the dtype of the (first) non-finite output


@dataclass(frozen=True)
class ModuleMax:
    """The largest |x| a module's forward calls returned in one dtype (inf or NaN included)."""

    module: str  # qualified name; "" is the root
    type: str  # its class
    dtype: str
    max_abs: float
    calls: int  # forward calls that returned a tensor of this dtype


@dataclass(frozen=True)
class StuckUpdate:
    """A float16/bfloat16 parameter, over the optimizer steps of the run: of its elements with
    a nonzero gradient (`updated`), how many came out of the step exactly as they went in."""

    parameter: str
    dtype: str
    stuck: int
    updated: int
    steps: int

    @property
    def fraction(self) -> float:
        return self.stuck / self.updated if self.updated else 0.0


@dataclass(frozen=True)
class ValueChecks:
    # The first op per phase that made a non-finite value from finite inputs, in the order
    # they ran (the first is the run's first).
    first_nonfinite: tuple[NonFinite, ...] = ()
    nonfinite_ops: int = 0  # ops whose floating output held inf or NaN
    checked_ops: int = 0  # ops with a floating output whose values were checked
    module_max: tuple[ModuleMax, ...] = ()
    stuck_updates: tuple[StuckUpdate, ...] = ()
    optimizer_steps: int = 0  # optimizer steps whose 16-bit parameters were compared

    def to_dict(self) -> dict:
        return {
            "first_nonfinite": [asdict(n) for n in self.first_nonfinite],
            "nonfinite_ops": self.nonfinite_ops,
            "checked_ops": self.checked_ops,
            # inf and NaN are no JSON numbers: a string then
            "module_max": [{**asdict(m), "max_abs": json_number(m.max_abs)}
                           for m in self.module_max],
            "stuck_updates": [asdict(s) for s in self.stuck_updates],
            "optimizer_steps": self.optimizer_steps,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ValueChecks:
        return cls(
            first_nonfinite=tuple(NonFinite(**n) for n in data.get("first_nonfinite", ())),
            nonfinite_ops=data.get("nonfinite_ops", 0),
            checked_ops=data.get("checked_ops", 0),
            module_max=tuple(ModuleMax(m["module"], m["type"], m["dtype"],
                                       float(m["max_abs"]), m["calls"])
                             for m in data.get("module_max", ())),
            stuck_updates=tuple(StuckUpdate(**s) for s in data.get("stuck_updates", ())),
            optimizer_steps=data.get("optimizer_steps", 0),
        )


def json_number(x: float) -> float | str:
    """`x`, or "inf"/"-inf"/"nan" (what float() reads back) where JSON has no number."""
    return x if x == x and abs(x) != float("inf") else str(x)
