"""Numerics: divergence from a high-precision reference, and ranges against number formats."""

from __future__ import annotations

import json

import pytest
import torch

import ampscope
from ampscope.analysis.numerics import NumericsReport, divergence, ranges, tensor_range
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.runs.values import Values

BF16_EPS = 2.0**-7


@pytest.fixture(scope="module")
def gpt2_tiny_train():
    return ampscope.numerics("gpt2-tiny", settings=["fp32", "fp32+amp-bf16", "bf16"],
                             reference="fp64", workload="train", seq=32)


def _setting(report, name):
    return next(s for s in report.settings if s.setting == name)


def test_fp32_against_an_fp32_reference_is_exactly_zero():
    report = ampscope.numerics("gpt2-tiny", settings=["fp32"], reference="fp32",
                               workload="train", seq=16)
    s = report.settings[0]
    assert s.modules and all(m.divergence.exact for m in s.modules)
    assert s.loss.exact and all(d.exact for _, d in s.grads)


def test_bf16_error_is_of_the_order_of_bf16_eps_per_op_and_grows_with_depth(gpt2_tiny_train):
    bf16 = _setting(gpt2_tiny_train, "bf16")
    first_linear = next(m for m in bf16.modules if m.name == "transformer.h.0.attn.c_attn")
    # bf16 keeps 8 significant bits: rounding one value errs by at most eps/2 relative.
    assert BF16_EPS / 16 < first_linear.divergence.rel_l2 < BF16_EPS
    for name in ("bf16", "fp32+amp-bf16"):
        blocks = [b.divergence.rel_l2 for b in _setting(gpt2_tiny_train, name).blocks]
        assert len(blocks) == 2 and blocks[1] > blocks[0]
    fp32 = _setting(gpt2_tiny_train, "fp32")
    assert all(1e-9 < b.divergence.rel_l2 < 1e-5 for b in fp32.blocks)  # fp32 rounding, not 0


def test_cuda_autocast_loses_more_in_the_loss_than_cpu_autocast():
    """On CUDA, cross_entropy's log_softmax runs in bf16 (not on CUDA's fp32 list); on the CPU
    the whole loss is on the fp32 list (docs/emulation.md)."""
    report = ampscope.numerics("gpt2-tiny", settings=["fp32+amp-bf16", "cuda:fp32+amp-bf16"],
                               reference="fp64", workload="train", seq=32)
    cpu, cuda = (s.loss.rel_l2 for s in report.settings)
    assert cuda > 10 * cpu


def test_divergence_by_hand():
    r = torch.tensor([3.0, 4.0])
    d = divergence(torch.tensor([3.0, 4.5]), r)
    assert d.rel_l2 == pytest.approx(0.5 / 5) and d.max_abs == pytest.approx(0.5)
    assert d.sqnr_db == pytest.approx(10 * torch.log10(torch.tensor(25 / 0.25)).item())
    assert divergence(r, r).exact and divergence(r, r).cosine == pytest.approx(1.0)


@pytest.mark.fast
def test_range_against_formats_by_hand():
    # 1e5 > fp16 max 65504; 1e-8 < 2^-25 (half fp16's smallest subnormal) flushes to zero;
    # 1e-6 lies between that and fp16's smallest normal 2^-14: subnormal; 1.0 is fine.
    r = tensor_range("activation", "x", torch.tensor([1e5, 1e-8, 1e-6, 1.0, 0.0]))
    fp16 = r.formats["float16"]
    assert (fp16.overflow, fp16.flush_to_zero, fp16.subnormal) == (0.25, 0.25, 0.25)
    bf16 = r.formats["bfloat16"]
    assert (bf16.overflow, bf16.flush_to_zero, bf16.subnormal) == (0.0, 0.0, 0.0)
    e4m3 = r.formats["float8_e4m3fn"]  # max 448, smallest subnormal 2^-9
    assert (e4m3.overflow, e4m3.flush_to_zero) == (0.25, 0.5)
    assert r.amax == 1e5 and r.numel == 5


def test_gradients_that_fp16_would_flush_are_counted():
    values = Values(grads={"w": torch.full((10,), 1e-9, dtype=torch.float64),
                           "b": torch.tensor([1.0, 1e-9], dtype=torch.float64)})
    report = NumericsReport("m", "train", "fp64", ranges=ranges(values))
    assert report.fp16_gradient_underflow() == (11, 12)


def test_numerics_cli_json(capsys):
    code = main(["numerics", "gpt2-tiny", "--settings", "bf16", "--seq", "8", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["schema"] == "ampscope.numerics/1"
    assert data["reference"] == "fp64" and [s["setting"] for s in data["settings"]] == ["bf16"]
    assert data["settings"][0]["blocks"][0]["container"] == "transformer.h"


def test_numerics_refuses_other_workloads():
    with pytest.raises(AmpscopeError, match="forward or train"):
        ampscope.numerics("gpt2-tiny", workload="generate")


def test_a_nan_divergence_is_written_as_nan_not_minus_inf():
    from ampscope.analysis.numerics import Divergence, _div

    written = _div(Divergence(float("nan"), float("inf"), 0.5, float("-inf")))
    assert written == {"rel_l2": "nan", "max_abs": "inf", "cosine": 0.5, "sqnr_db": "-inf"}


def test_an_emulated_numerics_setting_is_named_in_the_header():
    import io

    from rich.console import Console

    import ampscope
    from ampscope.render.numerics import render_numerics

    report = ampscope.numerics("gpt2-tiny", settings=["fp32+amp-bf16", "cuda:fp32+amp-bf16"],
                               seq=8)
    assert report.emulated == ["cuda:fp32+amp-bf16"]
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_numerics(report))
    assert "emulated: cuda:fp32+amp-bf16" in out.getvalue()
