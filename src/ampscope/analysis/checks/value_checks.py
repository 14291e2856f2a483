"""What a real run's values say (`Trace.values`, recorded on request): inf or NaN made from
finite values (AMP303), activations close to their format's largest value (AMP304), 16-bit
weights whose updates round away (AMP401). Silent where the values were not looked at.

Namesakes, the same concern at other layers: `runs/value_checks.py` (the recorder) and
`records/value_checks.py` (its records).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import UNSCALE, UPDATE_SCALE, count, named, where
from ampscope.analysis.findings import listed
from ampscope.records import Phase, Trace, module_label
from ampscope.records.value_checks import ModuleMax, NonFinite, StuckUpdate

# The largest finite value of each floating format.
_LIMITS = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
           "float32": 3.4028234663852886e38}
# Significant bits (the stored mantissa and the implicit one).
_BITS = {"float16": 11, "bfloat16": 8}
# A module whose outputs reach half the largest value is one doubling from inf.
_NEAR = 0.5
# A parameter flagged when this share of its elements with a nonzero gradient did not move.
# Healthy 16-bit steps leave only outliers unchanged (weights many times larger than their
# neighbours, gradients many times smaller): a few percent at most. A tenth is no outlier
# effect but the step size itself sitting below the weights' half-ulp.
_STUCK = 0.10


def _where(trace: Trace, found: NonFinite) -> str:
    if found.index < len(trace.ops) and trace.ops[found.index].op == found.op:
        return where(trace.ops[found.index])
    return ".".join(found.op.split(".")[:2]) + (f" at {found.source}" if found.source else "")


def _nonfinite_fix(found: NonFinite) -> str:
    if found.kind == "NaN":
        return ("find the 0/0, inf − inf, 0 · inf, or the sqrt or log of a negative number at "
                "that line (a division by a value that rounded to zero in "
                f"{found.dtype}: add an epsilon that {found.dtype} can hold, or compute it in "
                "float32)")
    if found.dtype == "float16":
        return ("keep that computation out of float16: run it in bfloat16 (float32's range: "
                "torch.autocast(dtype=torch.bfloat16)) or in float32 (.float() on its inputs, "
                "or torch.autocast(enabled=False) around it); or bring its values down "
                "(normalise its input, a smaller init or scale of its weights)")
    return (f"a value beyond {found.dtype}'s largest ({_LIMITS.get(found.dtype, math.inf):.3g}): "
            "find the exp, pow or product that grows without bound at that line, and bound "
            "its input (subtract the max before exp, clamp)")


@rule("AMP303", "non-finite-values", "error",
      "an op made inf or NaN out of finite values")
def non_finite_values(trace: Trace) -> Iterator[Hit]:
    values = trace.values
    if values is None or not values.first_nonfinite:
        return
    # A GradScaler is there to meet inf/NaN gradients: it skips that step and lowers the scale.
    scaled = bool(named(trace, UNSCALE, UPDATE_SCALE))
    found = [n for n in values.first_nonfinite
             if not (scaled and n.phase in (Phase.BACKWARD, Phase.OPTIMIZER))]
    if not found:
        return
    first = found[0]
    evidence = [f"{_where(trace, first)} returned {first.kind} in {first.dtype} in the "
                f"{first.phase} pass, from inputs that held no inf or NaN",
                f"{count(values.nonfinite_ops, 'op')} of {values.checked_ops:,} returned inf "
                "or NaN in all"]
    if first.dtype in _LIMITS and "inf" in first.kind:
        evidence.append(f"{first.dtype}'s largest finite value is {_LIMITS[first.dtype]:,.6g}: "
                        "a result beyond it is inf")
    evidence += [f"the first in the {n.phase} pass: {_where(trace, n)} ({n.kind}, {n.dtype})"
                 for n in found[1:]]
    yield Hit(
        f"{_where(trace, first)} made {first.kind} values ({first.dtype}) out of finite ones "
        f"in the {first.phase} pass.",
        tuple(evidence),
        "every value computed from them is inf or NaN: the loss, the gradients and, after the "
        "optimizer step, the weights (a GradScaler skips such a step, and every step while it "
        "lasts)",
        _nonfinite_fix(first), first.source)


def _module_source(trace: Trace, module: str) -> str | None:
    return next((o.source for o in trace.ops if o.module == module and o.source
                 and o.phase in (Phase.FORWARD, Phase.EVALUATION)), None)


def _near(m: ModuleMax) -> bool:
    limit = _LIMITS.get(m.dtype)
    return limit is not None and math.isfinite(m.max_abs) and m.max_abs >= _NEAR * limit


@rule("AMP304", "activations-near-format-limit", "warning",
      "a module's outputs within a factor 2 of their format's largest value")
def activations_near_limit(trace: Trace) -> Iterator[Hit]:
    values = trace.values
    if values is None:
        return
    near = [m for m in values.module_max if _near(m)]
    if not near:
        return
    first = near[0]
    limit = _LIMITS[first.dtype]

    def label(m: ModuleMax) -> str:
        return f"{module_label(m.module)} ({m.type})"

    yield Hit(
        f"{label(first)} returned values up to {first.max_abs:,.0f} in {first.dtype}, "
        f"{first.max_abs / limit:.0%} of the largest {first.dtype} can hold.",
        (*(f"{label(m)}: max |x| = {m.max_abs:,.0f} in {m.dtype} over "
           f"{count(m.calls, 'forward call')}" for m in near[:5]),
         *((f"and {count(len(near) - 5, 'more module')}",) if len(near) > 5 else ()),
         f"{first.dtype}'s largest finite value is {limit:,.6g}; beyond it a value is inf"),
        "an input a little larger than this run's (another batch, a later step as the weights "
        "grow) makes it inf, and the loss NaN after it",
        "compute it in bfloat16 (float32's range) or float32, or keep its activations' scale "
        "down: normalise before it, scale its weights' init, or the residual branch",
        _module_source(trace, first.module))


def _stuck_line(s: StuckUpdate) -> str:
    return (f"{s.parameter} ({s.dtype}): {s.stuck:,} of {s.updated:,} elements with a nonzero "
            f"gradient did not change ({s.fraction:.1%})"
            + (f" over {count(s.steps, 'step')}" if s.steps > 1 else ""))


@rule("AMP401", "updates-round-away", "warning",
      "16-bit weights that do not move when the optimizer updates them")
def updates_round_away(trace: Trace) -> Iterator[Hit]:
    values = trace.values
    if values is None:
        return
    stuck = [s for s in values.stuck_updates if s.updated and s.fraction >= _STUCK]
    if not stuck:
        return
    stuck.sort(key=lambda s: -s.fraction)
    dtypes = sorted({s.dtype for s in stuck})
    step = next((c.source for c in trace.calls
                 if c.phase == Phase.OPTIMIZER and c.func.endswith(".step") and c.source), None)
    yield Hit(
        f"Updates round away: {stuck[0].fraction:.0%} of the elements of {stuck[0].parameter} "
        f"with a nonzero gradient came out of the optimizer step unchanged"
        + (f", and {count(len(stuck) - 1, 'more parameter')} lost at least "
           f"{_STUCK:.0%}" if len(stuck) > 1 else "") + ".",
        (*(_stuck_line(s) for s in stuck[:5]),
         *((f"and {count(len(stuck) - 5, 'more parameter')}: "
            f"{listed([s.parameter for s in stuck[5:]], 3)}",) if len(stuck) > 5 else ()),
         *(f"{d} keeps {_BITS[d]} significant bits: an update below 2^-{_BITS[d] + 1} of the "
           f"weight (its relative half-ulp; 2^-{_BITS[d]} just below a power of 2) rounds back "
           "to the weight" for d in dtypes)),
        "those weights do not train: each step's update is lost, not delayed, and the loss "
        "stalls while the gradients look healthy",
        "keep float32 master weights: float32 parameters with the forward under "
        "torch.autocast(dtype=torch.bfloat16), or an optimizer that keeps a float32 copy of "
        "each parameter and writes its rounding back (or rounds stochastically); a larger "
        "learning rate is not the fix: the smallest updates still round away, and the others "
        "grow too large",
        step)
