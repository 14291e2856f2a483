"""What several test files share: hand-built records and the golden-file check.

Fixtures that build models live in conftest.py; this module holds plain helpers, imported as
`from tests.helpers import ...`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

import ampscope
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.analysis.numerics import (
    BlockDivergence,
    Divergence,
    ModuleDivergence,
    NumericsReport,
    SettingNumerics,
    TensorRange,
    tensor_range,
)
from ampscope.api import tokens_of
from ampscope.records import ModuleCall, SettingRecord, TensorMeta
from ampscope.render.html import report_html

GOLDEN = Path(__file__).parent / "golden"

F32, BF16, I64 = TensorMeta("float32", (2, 4)), TensorMeta("bfloat16", (2, 4)), TensorMeta("int64", (2,))


def call(i, name, type_, depth, ins, outs, phase="forward"):
    return ModuleCall(i, name, type_, phase, depth, ins, outs)


def blocks(n, odd=None, order=None):
    """Calls of a model with n blocks h.i (each: Block > fc); block `odd` runs fc in fp32."""
    calls = [call(0, "", "Net", 0, (I64,), (F32,))]
    for i in order or range(n):
        out = F32 if i == odd else BF16
        calls.append(call(len(calls), f"h.{i}", "Block", 1, (F32,), (out,)))
        calls.append(call(len(calls), f"h.{i}.fc", "Linear", 2, (F32,), (out,)))
    calls.append(call(len(calls), "head", "Linear", 1, (F32,), (BF16,)))
    return calls



def setting_record(name: str = "fp32", *, device: str = "cpu", emulated: bool = False,
                   param_dtype: str | None = "float32", autocast_dtype: str | None = None,
                   matmul_precision: str = "highest") -> SettingRecord:
    """A setting as a trace records it, for hand-built traces."""
    return SettingRecord(name, device, emulated, param_dtype, autocast_dtype, matmul_precision)


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("AMPSCOPE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


# --- the HTML report (tests/test_report.py, tests/test_report_browser.py) ---------------

SETTINGS = ["fp32", "fp32+amp-bf16"]


def divergence(x: float) -> Divergence:
    return Divergence(rel_l2=x, max_abs=x, cosine=1 - x, sqnr_db=-20 * math.log10(x))


def hand_numerics() -> NumericsReport:
    """A numerics report built by hand: two settings, two blocks (no model run)."""
    settings = [
        SettingNumerics(name, [ModuleDivergence("", "GPT", 1, divergence(3 * e))],
                        [BlockDivergence("transformer.h", i, divergence(e * (i + 1)))
                         for i in range(2)], divergence(e / 10), [])
        for name, e in (("fp32+amp-bf16", 2e-3), ("bf16", 4e-3))
    ]
    ranges: list[TensorRange] = [
        tensor_range("activation", "transformer.h.1", torch.tensor([1e5, 1.0])),
        tensor_range("gradient", "lm_head.weight", torch.tensor([1e-9, 1e-3])),
    ]
    return NumericsReport("gpt2-tiny", "train", "fp64", settings, ranges)


def gpt2_tiny_report() -> dict:
    """gpt2-tiny's train step under fp32 and fp32+amp-bf16 (8 tokens), its reports, and the
    page with every section (what `ampscope report gpt2-tiny` computes, plus numerics)."""
    matrix, traces = ampscope.matrix("gpt2-tiny", settings=SETTINGS, seq=8)
    flops = [flop_report(t, tokens=tokens_of(t)) for t in traces]
    memory = [memory_report(t) for t in traces]
    numerics = hand_numerics()
    html = report_html(traces, matrix, memory=memory, flops=flops, numerics=numerics)
    return {"matrix": matrix, "traces": traces, "flops": flops, "memory": memory,
            "numerics": numerics, "html": html}
