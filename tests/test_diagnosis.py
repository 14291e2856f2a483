"""A model that fails on a dtype mismatch gets a diagnosis: where, each argument's dtype and
origin, and the usual fixes."""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest
import torch
from torch import nn

import ampscope
from ampscope.analysis.diagnosis import diagnose
from ampscope.cli import main
from ampscope.errors import DtypeMismatchError
from ampscope.records import ArgumentOrigin, FailedCall


class HalfInTheMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x).half()  # the deliberate cast
        return self.out(h)


def line_of(cls, text: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if text in line)


def run_forward(model, batch):
    return model(**batch)


def test_the_diagnosis_names_module_dtypes_and_origins():
    with pytest.raises(DtypeMismatchError) as e:
        ampscope.trace(HalfInTheMiddle(), {"x": torch.randn(2, 4)}, setting="fp32",
                       workload=run_forward)
    d = e.value.diagnosis
    cast_line = line_of(HalfInTheMiddle, "the deliberate cast")
    use_line = line_of(HalfInTheMiddle, "return self.out(h)")
    assert d.summary.startswith(
        f"dtype mismatch in out: torch.nn.functional.linear at test_diagnosis.py:{use_line} "
        "got float16 and float32 and float32")
    assert "  1. float16 [2, 4]  from Tensor.half in (model) at " \
           f"test_diagnosis.py:{cast_line}" in d.lines
    assert "  2. float32 [2, 4]  from parameter out.weight" in d.lines
    assert any("x.to(torch.float32) before out" in line for line in d.lines)
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.fast
def test_a_model_input_in_the_wrong_dtype():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(DtypeMismatchError) as e:
        ampscope.trace(model, {"input": torch.randn(2, 4, dtype=torch.bfloat16)},
                       setting="fp32", workload=run_forward)
    lines = e.value.diagnosis.lines
    assert "  1. bfloat16 [2, 4]  from model input input" in lines
    assert "  2. float32 [4, 4]  from parameter 0.weight" in lines
    assert model[0].weight.dtype == torch.float32  # and the model is as it was


@pytest.mark.fast
def test_other_errors_are_not_diagnosed_as_dtype_mismatches():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("not a dtype problem")

    with pytest.raises(ValueError, match="not a dtype problem"):
        ampscope.trace(Broken(), {"x": torch.randn(2)}, workload=run_forward)
    same = FailedCall("torch.matmul", "fc", None,
                      (ArgumentOrigin("float32", (2,), "x"), ArgumentOrigin("float32", (2,), "y")),
                      "RuntimeError: expected scalar type Float")
    assert diagnose(same) is None  # one dtype only: something else went wrong


@pytest.mark.fast
@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_capture_adds_the_diagnosis_to_the_users_exception():
    model = HalfInTheMiddle()
    with pytest.raises(RuntimeError) as e, ampscope.capture(model):
        model(torch.randn(2, 4))
    assert any("dtype mismatch in out" in note for note in e.value.__notes__)


MISMATCHED_FACTORY = textwrap.dedent('''
    import torch
    from torch import nn
    from types import SimpleNamespace

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=16, block_size=8)
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

        def forward(self, idx, targets=None):
            x = self.emb(idx).bfloat16()
            logits = self.head(x)
            return nn.functional.cross_entropy(logits.view(-1, 16).float(), targets.view(-1))

    def build():
        return Mixed()
''')


@pytest.mark.fast
def test_cli_prints_the_diagnosis(tmp_path, monkeypatch, capsys):
    (tmp_path / "mixed_model.py").write_text(MISMATCHED_FACTORY)
    monkeypatch.chdir(tmp_path)
    code = main(["trace", "mixed_model:build", "--setting", "fp32", "--seq", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("ampscope: error while tracing mixed_model:build: dtype mismatch in "
                          "head: torch.nn.functional.linear at mixed_model.py:15")
    assert "from Tensor.bfloat16 in (model) at mixed_model.py:14" in err
    assert "usual fixes:" in err and "Traceback" not in err


class _ConvCast(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x.to(torch.bfloat16))


class _BmmCast(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch.bmm(x.to(torch.bfloat16), self.w)


@pytest.mark.fast
@pytest.mark.parametrize("model, x, func", [
    (_ConvCast, torch.randn(1, 3, 8, 8), "torch.nn.functional.conv2d"),
    (_BmmCast, torch.randn(2, 4, 4), "torch.bmm"),
])
@pytest.mark.parametrize("predict", [False, None])
def test_conv_and_bmm_mismatches_are_diagnosed(model, x, func, predict):
    """Not only linear/matmul: a conv (whose error names the bias) and a bmm, real and
    predicted, get the diagnosis with both dtypes."""
    with pytest.raises(DtypeMismatchError) as e:
        ampscope.trace(model(), x, workload="forward", predict=predict)
    first = str(e.value).splitlines()[0]
    assert "dtype mismatch in" in first and func in first
    assert "bfloat16" in first and "float32" in first
