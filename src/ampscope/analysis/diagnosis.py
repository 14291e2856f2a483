"""Explaining a dtype mismatch: where it happened, what each argument was and where it came
from, and the usual fixes. Pure: reads the `FailedCall` the capture recorded. In a predicted
run, the error it quotes is the real kernel's, not the fake kernel's (runtime/predict.py,
`real_kernel_error`): what the real run would print."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from ampscope.records import FailedCall, module_label

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


def diagnose(failure: FailedCall | None) -> Diagnosis | None:
    """A diagnosis when the failure is a dtype mismatch; None for any other error."""
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
