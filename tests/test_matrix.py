"""`ampscope matrix`: one workload under several settings, side by side."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

import ampscope
from ampscope.analysis.compare import build_matrix
from ampscope.cli import main
from ampscope.records import ModelInfo, Trace
from ampscope.render.matrix import render_matrix, short_names
from tests.helpers import blocks, call, check, setting_record

F32, BF16 = ("float32",), ("bfloat16",)


@pytest.fixture(scope="module")
def classic(request):
    from ampscope.models import gpt2
    lm = gpt2.load("gpt2-tiny")
    return ampscope.matrix(lm, seq=8)


def test_the_four_classic_settings_as_pytorch_runs_them(classic):
    m, traces = classic
    assert m.names == ("fp32", "bf16", "fp32+amp-bf16", "bf16+amp-bf16")
    rows = {r.name: r for r in m.rows}
    c_attn = rows["transformer.h.0–1.attn.c_attn"]
    assert c_attn.cells == ((F32, F32, ""), (BF16, BF16, ""), (F32, BF16, ""), (BF16, BF16, ""))
    assert c_attn.differs == (False, True, True, True)
    # LayerNorm on CPU follows its input: fp32 in the fp32-parameter settings, bf16 otherwise
    assert rows["transformer.h.0–1.ln_1"].cells == ((F32, F32, ""), (BF16, BF16, ""),
                                                    (F32, F32, ""), (BF16, BF16, ""))
    summary = {s.what: s.values for s in m.summary}
    assert summary["outputs"] == ("loss float32", "loss bfloat16", "loss float32", "loss float32")
    assert summary["gradients"] == ("float32", "bfloat16", "float32", "bfloat16")
    assert summary["optimizer exp_avg"] == ("float32", "bfloat16", "float32", "bfloat16")
    assert summary["autocast casts"][:2] == ("0", "0") and int(summary["autocast casts"][2]) > 0
    assert [t.setting.name for t in traces] == list(m.names)


def test_a_module_run_in_one_setting_only_gets_empty_cells():
    a = Trace(ModelInfo("m", "Net", 0), setting_record("fp32"), "train", modules=blocks(2))
    extra = blocks(2) + [call(99, "extra", "Linear", 1, (), ())]
    b = Trace(ModelInfo("m", "Net", 0), setting_record("bf16"), "train", modules=extra)
    m = build_matrix([a, b])
    assert m.rows[-1].name == "extra" and m.rows[-1].cells[0] is None
    assert m.rows[-1].differs == (False, True)


def test_short_names_are_relative_to_the_enclosing_row():
    assert short_names([("(model)", 0), ("h.0–11", 1), ("h.0–11.attn", 2),
                        ("h.0–11.attn.c_attn", 3), ("h.0–11.mlp", 2), ("lm_head", 1)]) == [
        "(model)", "  h.0–11", "    attn", "      c_attn", "    mlp", "  lm_head"]


def test_matrix_render_matches_golden():
    a = Trace(ModelInfo("toy", "Net", 0), setting_record("fp32"), "train", modules=blocks(3))
    b = Trace(ModelInfo("toy", "Net", 0), setting_record("fp32+amp-bf16"), "train",
              modules=blocks(3, odd=1))
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_matrix(build_matrix([a, b])))
    check("matrix.txt", out.getvalue())


def test_cli_matrix_json(capsys):
    code = main(["matrix", "gpt2-tiny", "--settings", "fp32,fp32+amp-bf16", "--seq", "4",
                 "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["schema"] == "ampscope.matrix/1"
    assert [s["name"] for s in data["settings"]] == ["fp32", "fp32+amp-bf16"]
    lm_head = next(r for r in data["modules"] if r["name"] == "lm_head")
    assert lm_head["cells"] == [{"in": ["float32"], "out": ["float32"], "matmul": None},
                                {"in": ["float32"], "out": ["bfloat16"], "matmul": None}]
    assert lm_head["differs"] == [False, True]


@pytest.mark.fast
def test_cli_matrix_bad_setting(capsys):
    code = main(["matrix", "gpt2-tiny", "--settings", "fp32,fp33"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown parameter dtype 'fp33'" in err


def test_opt_125m_per_layer_dtypes_in_the_four_classic_settings():
    """Hugging Face OPT-125m (random weights from its published config) as PyTorch runs it."""
    pytest.importorskip("transformers")
    m, _ = ampscope.matrix("opt-125m", seq=8)
    rows = {r.name: r.cells for r in m.rows}
    layer = "model.decoder.layers.0–11"  # all twelve decoder layers run alike in every setting
    lin = ((F32, F32, ""), (BF16, BF16, ""), (F32, BF16, ""), (BF16, BF16, ""))
    follows_input = ((F32, F32, ""), (BF16, BF16, ""), (F32, F32, ""), (BF16, BF16, ""))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert rows[f"{layer}.self_attn.{proj}"] == lin
    assert rows[f"{layer}.fc1"] == lin
    # layer_norm on CPU autocast follows its input, which is the fp32 residual stream
    assert rows[f"{layer}.self_attn_layer_norm"] == follows_input
    assert rows[f"{layer}.final_layer_norm"] == follows_input
    # out_proj and fc2 take what the previous Linear produced: bf16 under autocast
    assert rows[f"{layer}.fc2"] == ((F32, F32, ""), (BF16, BF16, ""), (BF16, BF16, ""),
                                   (BF16, BF16, ""))
    assert rows["lm_head"] == lin
    summary = {s.what: s.values for s in m.summary}
    # HF's causal-LM loss upcasts the logits: the loss is fp32 in every setting
    assert summary["outputs"] == ("loss float32",) * 4
    assert summary["gradients"] == ("float32", "bfloat16", "float32", "bfloat16")


@pytest.mark.fast
def test_a_failing_setting_becomes_a_column_that_says_why():
    """A model whose head is bf16 on purpose: under fp32 (no autocast) its matmul refuses
    mixed dtypes; the other settings are kept and the failure is recorded."""
    import torch
    from torch import nn


    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 4).to(torch.bfloat16)

        def forward(self, x):
            return self.head(self.body(x))

    def step(m, batch):
        return m(batch["x"])

    matrix, traces = ampscope.matrix(Mixed(), {"x": torch.randn(2, 4)},
                                     settings=["fp32+amp-bf16", "fp32"], workload=step)
    assert [t.setting.name for t in traces] == ["fp32+amp-bf16"]
    [(name, why)] = matrix.failures
    assert name == "fp32" and "dtype mismatch in head" in why
    assert matrix.to_dict()["failures"] == [{"setting": "fp32", "error": why}]
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render_matrix(matrix))
    assert "fp32 fails: dtype mismatch in head" in out.getvalue()


def test_a_float8_linear_cell_says_its_matmul_ran_in_fp8():
    """torchao's Float8Linear shows bf16 outside (its wrapper's dtype): the cell also says the
    matmul ran on float8 data, which the fp8 setting's dtypes alone would hide."""
    pytest.importorskip("torchao")
    m, _ = ampscope.matrix("gpt2-tiny", settings=["fp32+amp-bf16", "fp32+amp-bf16+fp8"], seq=16,
                           predict=True)
    rows = {r.name: r for r in m.rows}
    c_fc = rows["transformer.h.0–1.mlp.c_fc"]
    assert c_fc.cells[0][2] == "" and c_fc.cells[1][2] == "matmul in fp8 e4m3 × e4m3"
    assert c_fc.cells[0][:2] == c_fc.cells[1][:2] and c_fc.differs == (False, True)
    # gpt2-tiny's head (vocab 512 × 64) is converted too; its embeddings are not Linear layers
    assert rows["transformer.wte"].cells[1][2] == ""
    cell = next(r for r in m.to_dict()["modules"] if r["name"] == "transformer.h.0–1.mlp.c_fc")
    assert [c["matmul"] for c in cell["cells"]] == [None, "matmul in fp8 e4m3 × e4m3"]
