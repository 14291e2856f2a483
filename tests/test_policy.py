"""`ampscope policy`: the build's autocast policy per op, device against device, and the quiz."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ampscope.cli import main
from ampscope.precision import GlobalState
from ampscope.precision.quiz import QUIZ, quiz
from ampscope.records import dtype_name


def _json(capsys, *argv) -> dict:
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_quiz_answers_the_issue_on_cuda_and_cpu():
    cuda, cpu = quiz("cuda", torch.bfloat16), quiz("cpu", torch.bfloat16)
    assert cuda["x.sum()"]["bfloat16"] == "float32"  # sum comes out fp32 on CUDA...
    assert cuda["x.mean()"]["bfloat16"] == "bfloat16"  # ...but mean stays bf16
    assert cpu["x.sum()"]["bfloat16"] == "bfloat16"  # and on the CPU sum follows its input
    assert cuda["softmax(x, -1)"]["bfloat16"] == "float32"
    assert cpu["softmax(x, -1)"]["bfloat16"] == "bfloat16"
    assert cpu["x @ x"]["float32"] == cuda["x @ x"]["float32"] == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fake cuda tensors need a CPU-only build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_quiz_matches_the_builds_own_cuda_autocast(dtype):
    """The emulated answers equal AutocastCUDA's on fake cuda tensors (forward, no GPU)."""
    answers = quiz("cuda", dtype)
    state = GlobalState.save()
    try:
        with FakeTensorMode():
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            for expression, fn in QUIZ.items():
                for input_dtype in (dtype, torch.float32):
                    x = torch.rand(4, 4, device="cuda").to(input_dtype)
                    assert dtype_name(fn(x).dtype) == answers[expression][dtype_name(input_dtype)], \
                        (expression, input_dtype)
    finally:
        state.restore()


def test_policy_lists_ops_with_categories(capsys):
    data = _json(capsys, "policy", "--device", "cuda", "--dtype", "bf16", "--op", "softmax")
    assert data["schema"] == "ampscope.policy/1" and data["device"] == "cuda"
    categories = {o["op"]: o["category"] for o in data["ops"]}
    assert categories == {"log_softmax.int": "fp32_set_opt_dtype",
                          "softmax.int": "fp32_set_opt_dtype"}


def test_compare_cpu_cuda_shows_where_they_differ(capsys):
    data = _json(capsys, "policy", "--compare", "cpu", "cuda", "--dtype", "bf16")
    rows = {o["op"]: (o["cpu"], o["cuda"]) for o in data["ops"]}
    assert rows["cat"] == ("promote", "passthrough")
    assert rows["softmax.int"] == ("passthrough", "fp32_set_opt_dtype")
    assert rows["cross_entropy_loss"] == ("fp32", "passthrough")
    assert rows["layer_norm"] == ("passthrough", "fp32")
    assert "mm" not in rows  # lower precision on both


def test_policy_default_dtype_is_the_devices(capsys):
    assert _json(capsys, "policy", "--device", "cuda")["dtype"] == "float16"
    assert _json(capsys, "policy")["dtype"] == "bfloat16"
