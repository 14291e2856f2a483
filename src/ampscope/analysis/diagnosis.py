"""Explaining a dtype error: a dtype mismatch, or a constant the tensor's dtype cannot hold
(`masked_fill(mask, -1e9)` on float16): where it happened, what each argument was and where
it came from, and the usual fixes. Pure: reads the `FailedCall` the capture recorded. In a predicted
run, the error it quotes is the real kernel's, not the fake kernel's (runtime/predict.py,
`real_kernel_error`): what the real run would print."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from ampscope.records import FailedCall, OpCall, module_label
from ampscope.torchcompat.ops import TO_COPY_NAME

_FLOATS = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Diagnosis:
    summary: str  # one line
    lines: tuple[str, ...]  # the arguments and the fixes

    def text(self) -> str:
        return "\n".join((self.summary, *self.lines))


def is_dtype_mismatch(failure: FailedCall | None) -> TypeGuard[FailedCall]:
    # How PyTorch words a dtype mismatch: the same words a predicted run recognises when it
    # asks the real kernel for its own (runtime/predict.py; imported here, as it imports torch,
    # which the view of a child process's failure does not need otherwise).
    from ampscope.runtime.predict import DTYPE_MISMATCH

    if failure is None or not DTYPE_MISMATCH.search(failure.error):
        return False
    return len({a.dtype for a in failure.arguments if a.dtype in _FLOATS}) > 1


def _fixes(failure: FailedCall) -> list[str]:
    params = [a for a in failure.arguments if a.origin.startswith(("parameter ", "buffer "))]
    others = [a for a in failure.arguments if a not in params and a.dtype in _FLOATS]
    fixes = ["run the forward pass under torch.autocast(device_type, dtype=...), which casts "
             "the arguments of matmul-like ops to one dtype"]
    if params and others:
        p, o = params[0], others[0]
        fixes.append(f"cast the activation to the parameters' dtype ({o.dtype} → {p.dtype}), "
                     f"e.g. x.to(torch.{p.dtype}) before {module_label(failure.module)}")
        fixes.append(f"or cast the module to the activation's dtype "
                     f"({module_label(failure.module)}.to(torch.{o.dtype}))")
    else:
        fixes.append("cast one argument to the other's dtype where it is made (see 'from' above)")
    return fixes


# How PyTorch words a scalar its tensor's dtype cannot hold (c10's checked conversion).
_OVERFLOW = re.compile(r"cannot be converted to type (?:c10|at)::(\w+) without overflow")
_C10_NAMES = {"Half": "float16", "BFloat16": "bfloat16", "Float": "float32"}
_LIMITS = {"float16": "65504", "bfloat16": "3.39e38", "float32": "3.40e38"}


def _overflow(failure: FailedCall) -> Diagnosis | None:
    found = _OVERFLOW.search(failure.error)
    dtype = _C10_NAMES.get(found.group(1)) if found else None
    if dtype is None:
        return None
    where = module_label(failure.module)
    at = f" at {failure.source}" if failure.source else ""
    tensor = next((a for a in failure.arguments if a.dtype == dtype), None)
    came = f" (it came from {tensor.origin})" if tensor is not None else ""
    summary = (f"a constant out of {dtype}'s range in {where}: {failure.func}{at} was given a "
               f"value beyond ±{_LIMITS[dtype]} for a {dtype} tensor{came} ({failure.error})")
    lines = ["arguments:"]
    lines += [f"  {i}. {a.dtype} {list(a.shape)}  from {a.origin}"
              for i, a in enumerate(failure.arguments, 1)]
    lines += ["usual fixes:",
              "  - use the tensor's own limit, torch.finfo(t.dtype).min, not a float32 constant "
              "(-1e9, torch.finfo(torch.float32).min)",
              "  - or compute that part in float32 (t.float()) and cast back after the softmax"]
    return Diagnosis(summary, tuple(lines))


def diagnose(failure: FailedCall | None) -> Diagnosis | None:
    """A diagnosis when the failure is a dtype mismatch or a constant its tensor's dtype
    cannot hold; None for any other error."""
    if failure is not None and _OVERFLOW.search(failure.error):
        return _overflow(failure)
    if not is_dtype_mismatch(failure):
        return None
    where = module_label(failure.module)
    at = f" at {failure.source}" if failure.source else ""
    summary = (f"dtype mismatch in {where}: {failure.func}{at} got "
               + " and ".join(a.dtype for a in failure.arguments) + f" ({failure.error})")
    lines = ["arguments:"]
    for i, a in enumerate(failure.arguments, 1):
        lines.append(f"  {i}. {a.dtype} {list(a.shape)}  from {a.origin}")
    lines.append("usual fixes:")
    lines += [f"  - {fix}" for fix in _fixes(failure)]
    return Diagnosis(summary, tuple(lines))


# The cast op's name without its overload ("aten._to_copy").
_TO_COPY = TO_COPY_NAME.rsplit(".", 1)[0] + "."
# GradScaler's refusal, raised in Python before any op runs (torch/amp/grad_scaler.py).
FP16_GRADIENTS = "Attempting to unscale FP16 gradients"


def fp16_gradients_origin(ops: list[OpCall]) -> str | None:
    """Where a script's float16 parameters came from, for GradScaler's refusal to unscale their
    gradients: the lines that cast tensors from float32 to float16 before the model first ran
    (`model.half()`, `.to(torch.float16)`); None where none did."""
    first_use = next((o.index for o in ops if any(o.input_names)), len(ops))
    lines: dict[str, int] = {}
    for o in ops[:first_use]:
        if (o.op.startswith((_TO_COPY, "aten.to.")) and o.source and o.inputs
                and o.outputs and o.inputs[0].dtype == "float32"
                and o.outputs[0].dtype == "float16"):
            lines[o.source] = lines.get(o.source, 0) + 1
    if not lines:
        return None
    casts = ", ".join(f"{line} ({n} tensor{'s' if n > 1 else ''})" for line, n in lines.items())
    return (f"the parameters became float16 at {casts}; keep them float32 and run the forward "
            "under torch.autocast(dtype=torch.float16)")
