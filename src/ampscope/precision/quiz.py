"""The policy quiz: what common expressions return under each device's autocast.

`ampscope policy --quiz` asks what `x.sum()`, `x.mean()`, softmax ... return on cpu, cuda and
mps; the answers are computed with the installed build (for real on the CPU, through the
emulation elsewhere), not written down.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampscope.records import dtype_name
from ampscope.runtime.emulation import TargetAutocast, autocast_region

QUIZ: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x.max()": lambda x: x.max(),
    "x.min()": lambda x: x.min(),
    "x.sum()": lambda x: x.sum(),
    "x.mean()": lambda x: x.mean(),
    "x.prod()": lambda x: x.prod(),
    "x.exp()": lambda x: x.exp(),
    "x.log()": lambda x: x.log(),
    "relu(x)": lambda x: torch.nn.functional.relu(x),
    "softmax(x, -1)": lambda x: torch.nn.functional.softmax(x, -1),
    "mse_loss(x, x)": lambda x: torch.nn.functional.mse_loss(x, x),
    "x @ x": lambda x: x @ x,
}


def quiz(device: str, dtype: torch.dtype) -> dict[str, dict[str, str]]:
    """What comes out of each QUIZ expression under `device`'s autocast with `dtype`, for an
    input in `dtype` and one in float32: {expression: {input dtype: output dtype}}.

    Run for real on the CPU, and through the emulation (runtime/emulation.py) for other
    devices, so the answers are the installed build's."""
    answers: dict[str, dict[str, str]] = {}
    inputs = {dtype_name(t): torch.rand(4, 4, dtype=t) + 0.5 for t in (dtype, torch.float32)}
    for expression, fn in QUIZ.items():
        answers[expression] = {}
        for name, x in inputs.items():
            if device == "cpu":
                with torch.autocast("cpu", dtype=dtype):
                    out = fn(x)
            else:
                with TargetAutocast(device, dtype), autocast_region(dtype):
                    out = fn(x)
            answers[expression][name] = dtype_name(out.dtype)
    return answers
