"""What an fp8 training step did, from its records: which Linear layers ran their matmuls in
fp8 and in which formats, which stayed in higher precision, and the casts and scales it made.

Read from the ops, not from the setting, so a model that a script or a factory converted itself
is described the same way: a matmul ran in fp8 when its operands held fp8 data
(`OpCall.input_data`), a cast into fp8 is a `_to_copy` to a float8 dtype with the scale found
by `records.fp8`.

Namesakes, the same concern at another layer: `precision/fp8.py`, `records/fp8.py`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ampscope.analysis.flow import FlowRow, collapse_blocks
from ampscope.records import Finding, Trace
from ampscope.records.fp8 import DIM_MULTIPLE, GemmRoles, fp8_casts, short_fp8
from ampscope.torchcompat.ops import TO_COPY_NAME

FP8_CAUSE = "fp8-training"


@dataclass(frozen=True)
class Fp8Step:
    converted: list[str]  # modules whose matmuls ran in fp8, in call order
    linear: list[str]  # Linear modules whose matmuls did not (left out by the module filter)
    matmuls: Counter  # (phase, "float8_e4m3fn × float8_e4m3fn") → count
    casts: Counter  # (phase, fp8 dtype) → count
    granularity: Counter  # "tensorwise" / "rowwise" → casts
    scale_dtypes: Counter  # dtype of the scales → count
    helper_casts: int  # other casts in the converted modules (computing scales, back to bf16)
    cast_bytes: int = 0
    odd_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # linear → weight shape
    # (phase, "input" / "weight" / "output gradient") → the fp8 formats its matmul operands
    # held, in the order they first ran
    roles: dict[tuple[str, str], Counter] = field(default_factory=dict)


def fp8_step(trace: Trace) -> Fp8Step | None:
    """The fp8 facts of a trace, or None when nothing ran in fp8."""
    matmuls: Counter = Counter()
    converted: dict[str, None] = {}
    weights = {name.removesuffix(".weight"): p.shape for p in trace.parameters
               for name in (p.name, *p.tied_to)}
    gemm_roles = GemmRoles()
    roles: dict[tuple[str, str], Counter] = {}
    for o in trace.ops:
        if o.flops and any(d is not None for d in o.input_data):
            pair = " × ".join(d or m.dtype for d, m in zip(o.input_data, o.inputs, strict=False))
            matmuls[(o.phase, pair)] += 1
            if o.module is not None:
                converted.setdefault(o.module, None)
            if len(o.inputs) == 2 and o.outputs:
                operands = gemm_roles.of(o.phase, o.module, o.inputs[0].shape,
                                         o.outputs[0].shape, weights.get(o.module or ""))
                for role, data in zip(operands, o.input_data, strict=False):
                    if data is not None:  # an operand left in high precision was not cast
                        roles.setdefault((o.phase, role), Counter())[data] += 1
    casts = fp8_casts(trace.ops)
    if not matmuls and not casts:
        return None
    cast_ops = {c.op for c in casts}
    linear = list(dict.fromkeys(m.name for m in trace.modules
                                if m.phase == "forward" and m.type == "Linear"
                                and m.name not in converted))
    # (a tied lm_head's weight is listed under its embedding: `tied_to`)
    odd = {name: weights[name] for name in linear
           if name in weights and any(d % DIM_MULTIPLE for d in weights[name])}
    helper = sum(1 for o in trace.ops if o.op == TO_COPY_NAME
                 and o.module in converted and o.index not in cast_ops)
    return Fp8Step(
        converted=list(converted), linear=linear, matmuls=matmuls,
        casts=Counter((trace.ops[c.op].phase, trace.ops[c.op].outputs[0].dtype) for c in casts),
        granularity=Counter(c.granularity for c in casts),
        scale_dtypes=Counter(c.scale.dtype for c in casts if c.scale is not None),
        helper_casts=helper,
        cast_bytes=sum(s.nbytes for s in trace.storages if s.category == "fp8_cast"),
        odd_dims=odd, roles=roles,
    )


def fp8_matmul_note(ops) -> str:
    """"matmul in fp8 e4m3 × e4m3" for the first of `ops` that ran on fp8 data (a module's or a
    call's ops); "" when none did. Its operands show a higher dtype outside (their wrapper's),
    which is all the modules table and the diagram would otherwise say."""
    for o in ops:
        if o.flops and any(d is not None for d in o.input_data):
            return "matmul in fp8 " + " × ".join(
                short_fp8(d) if d else m.dtype
                for d, m in zip(o.input_data, o.inputs, strict=False))
    return ""


def fp8_module_notes(trace: Trace, phase: str = "forward") -> dict[str, str]:
    """Module → the fp8 formats its matmuls ran in, for the modules that ran one in `phase`."""
    by_module: dict[str, list] = {}
    for o in trace.ops:
        if o.phase == phase and o.module is not None and o.input_data:
            by_module.setdefault(o.module, []).append(o)
    return {m: note for m, ops in by_module.items() if (note := fp8_matmul_note(ops))}


def fp8_modules(trace: Trace) -> set[str]:
    """Modules whose matmuls ran in fp8: their casts are the fp8 recipe's, not the user's."""
    return {o.module for o in trace.ops
            if o.module is not None and o.flops and any(d is not None for d in o.input_data)}


def collapsed(names: Iterable[str]) -> str:
    """Distinct names, repeated blocks on one name ("transformer.h.0–11.mlp.c_fc"), at most
    four names."""
    rows = [r.name for r in collapse_blocks([FlowRow(n, "", (), ()) for n in dict.fromkeys(names)])]
    return ", ".join(rows[:4]) + (f" and {len(rows) - 4} more" if len(rows) > 4 else "")


_PLURAL = {"input": "inputs", "weight": "weights", "output gradient": "output gradients"}


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def roles_in_words(roles: dict[tuple[str, str], Counter]) -> str:
    """Which operands were cast to which format, by phase: "inputs and weights to
    float8_e4m3fn in forward; output gradients to float8_e5m2, weights and inputs again to
    float8_e4m3fn in backward"."""
    parts: list[str] = []
    seen: set[str] = set()  # the roles cast in an earlier phase
    for phase in ("forward", "backward"):
        by_format: dict[str, list[str]] = {}
        for (p, role), formats in roles.items():
            if p == phase:
                by_format.setdefault(" or ".join(formats), []).append(role)
        groups = [f"{_and([_PLURAL[r] for r in rs])}{' again' if set(rs) <= seen else ''} to {fmt}"
                  for fmt, rs in by_format.items()]
        if groups:
            parts.append(", ".join(groups) + f" in {phase}")
        seen |= {role for p, role in roles if p == phase}
    return "; ".join(parts)


def _by_phase(counts: Counter) -> str:
    """"forward 12 float8_e4m3fn; backward 6 float8_e5m2": (phase, what) counts, by phase."""
    return "; ".join(
        f"{phase} " + ", ".join(f"{n} {what}" for (p, what), n in counts.items() if p == phase)
        for phase in ("forward", "backward") if any(p == phase for p, _ in counts))


def fp8_findings(trace: Trace) -> list[Finding]:
    step = fp8_step(trace)
    if step is None:
        return []
    n_linear = len(step.converted) + len(step.linear)
    recipe = f", recipe {trace.setting.fp8}" if trace.setting.fp8 else ""
    emulated = (" (emulated: the operands hold real fp8 values, the matmul runs on them in higher "
                "precision)" if trace.setting.fp8 and (trace.setting.device == "cpu"
                                                        or trace.setting.emulated) else "")
    matmuls = _by_phase(step.matmuls)
    findings = [Finding(
        f"{len(step.converted)} of {n_linear} Linear layers run their matmuls in fp8{recipe}: "
        f"{matmuls}{emulated}.", FP8_CAUSE)]
    if step.casts:
        casts = _by_phase(step.casts)
        scales = ", ".join(f"{n} {g}" for g, n in step.granularity.items())
        scale_dtype = "/".join(step.scale_dtypes) or "no"
        roles = f"{roles_in_words(step.roles)} ({casts})" if step.roles else casts
        findings.append(Finding(
            f"Casts to fp8 ({step.cast_bytes / 1e6:.2f} MB): {roles}; each with a {scale_dtype} "
            f"scale from the tensor's amax ({scales}); {step.helper_casts} more casts in these "
            "layers compute the scales and return results to the activations' dtype. Weights "
            "keep their dtype: they are cast again at every matmul.", FP8_CAUSE))
    if step.linear:
        why = (f" (dims not multiples of {DIM_MULTIPLE}: "
               + ", ".join(f"{n} {'×'.join(map(str, s))}" for n, s in step.odd_dims.items()) + ")"
               if step.odd_dims else "")
        findings.append(Finding(
            f"{collapsed(step.linear)} stay{'s' if len(step.linear) == 1 else ''} in higher "
            f"precision: left out by the module filter{why}.", FP8_CAUSE))
    return findings
