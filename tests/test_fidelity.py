"""Fidelity: where a predicted or emulated run could say something other than the real one.

Each test checks one mechanism against a truth ampscope does not compute: the CPU kernels
themselves (run here on real tensors), PyTorch's CUDA source, the build's own CUDA autocast
registrations, or a derivation by hand.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from jsonschema import Draft202012Validator
from rich.console import Console
from torch import nn

import ampscope
from ampscope import schemas
from ampscope.errors import DtypeMismatchError
from ampscope.render.matrix import MARK, render_matrix
from ampscope.runtime.autocast_policy import read_policy

BF16 = torch.bfloat16


class _Norms(nn.Module):
    """bf16 activations through fp32-weighted norms, no autocast: the CPU kernels keep the
    statistics in float32 here (the parameters' dtype), not in the input's bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(5)
        self.bn = nn.BatchNorm1d(3)  # training mode: batch statistics, saved mean and invstd
        self.gn = nn.GroupNorm(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.bfloat16(), (5,), self.ln.weight, self.ln.bias)
        z = self.bn(x.bfloat16())
        g = self.gn(x.bfloat16())
        return y.float().sum() + z.float().sum() + g.float().sum()


def _ops(predict: bool) -> list[tuple[str, list[str], list[str]]]:
    torch.manual_seed(0)
    t = ampscope.trace(_Norms(), {"x": torch.randn(4, 3, 5)}, setting="fp32", predict=predict,
                       workload=lambda m, b: m(b["x"]).backward())
    return [(o.op, [m.dtype for m in o.inputs], [m.dtype for m in o.outputs]) for o in t.ops]


def test_predicted_norm_statistics_are_the_cpu_kernels_dtypes_op_for_op():
    """A: a predicted run on the CPU records every op, forward and backward, in the dtypes the
    real run records. Truth: the same step run for real on CPU tensors (the CPU kernels
    themselves), and the kernels called directly below."""
    real, predicted = _ops(predict=False), _ops(predict=True)
    norms = [r for r in real if "norm" in r[0]]
    assert len(norms) == 6  # layer, batch and group norm, each with its backward
    assert predicted == real
    # What the CPU kernels give, called by hand: fp32 statistics with fp32 weights...
    x, w = torch.randn(2, 5, dtype=BF16), torch.randn(5)
    aten = torch.ops.aten
    assert [t.dtype for t in aten.native_layer_norm(x, [5], w, w, 1e-5)] == \
        [BF16, torch.float32, torch.float32]
    xb, c = torch.randn(4, 3, 5, dtype=BF16), torch.randn(3)
    assert [t.dtype for t in aten.native_batch_norm(xb, c, c, c.clone(), c.abs(), True, 0.1,
                                                    1e-5)] == [BF16, torch.float32, torch.float32]
    # ...and the trace's forward norms say the same.
    forward = {op: outs for op, _, outs in norms if not op.endswith("backward.default")}
    assert forward["aten.native_layer_norm.default"] == ["bfloat16", "float32", "float32"]
    assert forward["aten.native_batch_norm.default"] == ["bfloat16", "float32", "float32"]


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.bfloat16())  # fp32 weight, bf16 input, no autocast: refused


class _Lerp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(x.bfloat16(), self.w, 0.5)  # its meta kernel refuses, in other words


def _error(model: nn.Module, setting: str, predict: bool) -> str:
    with pytest.raises(DtypeMismatchError) as e:
        ampscope.trace(model, {"x": torch.randn(2, 8 if isinstance(model, _Linear) else 4)},
                       setting=setting, predict=predict, workload=lambda m, b: m(b["x"]))
    return str(e.value).splitlines()[0]


def _real_words(call) -> str:
    with pytest.raises(RuntimeError) as e:
        call()
    return str(e.value).splitlines()[0]


@pytest.mark.fast
def test_a_predicted_dtype_mismatch_quotes_the_real_kernel():
    """B: the predicted run's error quotes what the real kernel says, not the fake kernel's (or
    ampscope's) words. Truth: the CPU kernels called here on real tensors; for CUDA's `mm`,
    PyTorch's CUDA source (`addmm_out_cuda_impl` in ATen's cuda/Blas.cpp checks
    `mat1.dtype() == mat2.dtype()` and prints two TypeMetas)."""
    linear = _real_words(lambda: F.linear(torch.zeros(2, 8, dtype=BF16), torch.zeros(8, 8),
                                          torch.zeros(8)))
    assert linear == "mat1 and mat2 must have the same dtype, but got BFloat16 and Float"
    for predict in (False, True):
        for setting in ("fp32", "cuda:fp32"):  # F.linear checks in the shared addmm meta
            assert f"(RuntimeError: {linear})" in _error(_Linear(), setting, predict)
    # PyTorch's meta kernel for lerp refuses too, with "torch.bfloat16"-style names.
    lerp = _real_words(lambda: torch.lerp(torch.zeros(4, dtype=BF16), torch.zeros(4), 0.5))
    assert "c10::BFloat16" in lerp
    assert f"(RuntimeError: {lerp})" in _error(_Lerp(), "fp32", predict=True)
    # mm on a predicted CUDA run: the CUDA kernel's words, not the CPU's "m1 and m2".
    from ampscope.runtime.predict import fake_mode, real_kernel_error

    mode = fake_mode()
    with mode:
        a = torch.empty(2, 3, dtype=BF16, device="cuda")
        b = torch.empty(3, 2, device="cuda")
    assert str(real_kernel_error(torch.ops.aten.mm.default, (a, b), {})) == \
        "expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float"
    assert real_kernel_error(torch.ops.aten.mm.default, (b.t(), b), {}) is None  # it runs


def test_a_cuda_autocast_finding_agrees_with_the_ops_it_ran():
    """C: on CUDA cross_entropy is no autocast op; its log_softmax keeps the bf16 input's dtype
    and only nll_loss is cast to float32. The finding names what ran in float32 and what did
    not. Truth: the build's own CUDA autocast registrations, and the recorded ops."""
    cuda = read_policy("cuda", BF16)
    assert "aten::cross_entropy_loss" not in cuda
    assert cuda["aten::nll_loss"].category == "fp32"
    assert cuda["aten::log_softmax.int"].category == "fp32_set_opt_dtype"  # dtype= is given
    assert read_policy("cpu", BF16)["aten::cross_entropy_loss"].category == "fp32"

    t = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", seq=8, predict=True)
    [call] = [c.index for c in t.calls if c.func.endswith("cross_entropy")]
    ran = {o.op: o.outputs[0].dtype for o in t.ops if o.caller == call and not o.autocast_cast}
    assert ran == {"aten._log_softmax.default": "bfloat16",
                   "aten.nll_loss_forward.default": "float32"}
    [text] = [f.text for f in t.findings if f.text.startswith("cross_entropy")]
    assert text.startswith("cross_entropy's nll_loss_forward runs in float32 under autocast: "
                           "autocast policy (float32 list; 1 cast")
    assert text.endswith("; its _log_softmax runs in bfloat16.")


class _Mixed(nn.Module):
    """A bf16 head after an fp32 body: under fp32 (no autocast) its matmul is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4).to(BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.fast
def test_a_failing_first_setting_stays_the_baseline_of_the_matrix():
    """D: the first setting asked for is the one compared with; when it fails, its column says
    so and no cell is compared with the second setting's as if that were the baseline. Truth:
    the CPU kernel refuses fp32 × bf16 (called here); the rest by hand: nothing ran to compare
    with."""
    _real_words(lambda: F.linear(torch.zeros(2, 4), torch.zeros(4, 4, dtype=BF16)))
    settings = ["fp32", "fp32+amp-bf16", "bf16"]
    matrix, traces = ampscope.matrix(_Mixed(), {"x": torch.randn(2, 4)}, settings=settings,
                                     workload=lambda m, b: m(b["x"]))
    assert [t.setting.name for t in traces] == settings[1:]
    assert matrix.columns == tuple(settings) and matrix.baseline == "fp32"
    assert matrix.baseline_failed
    # bf16 differs from fp32+amp-bf16 (its body runs in bf16), but neither is the baseline.
    body = next(r for r in matrix.rows if r.name == "body")
    assert body.cells[0] != body.cells[1]
    assert all(d is None for r in (*matrix.rows, *matrix.summary) for d in r.differs)
    doc = matrix.to_dict()
    assert doc["baseline"] == {"setting": "fp32", "failed": True}
    Draft202012Validator(schemas.load("matrix")).validate(doc)
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(render_matrix(matrix))
    text = out.getvalue()
    header = next(line for line in text.splitlines() if "module" in line)
    assert header.index("fp32") < header.index("fp32+amp-bf16") < header.index("bf16 ")
    assert "fails (below)" in text and "fp32 failed: no cell is compared" in text
    assert MARK not in text
    # With a first setting that runs, the comparison is against it, as before.
    ok, _ = ampscope.matrix(_Mixed(), {"x": torch.randn(2, 4)}, settings=settings[1:] + ["fp32"],
                            workload=lambda m, b: m(b["x"]))
    assert ok.baseline == "fp32+amp-bf16" and not ok.baseline_failed
    assert next(r for r in ok.rows if r.name == "body").differs == (False, True)
