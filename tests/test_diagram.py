"""The dtype flow diagram, drawn from the trace of any model."""

from __future__ import annotations

from pathlib import Path

import pytest

import ampscope
from ampscope.analysis.diagram import build_diagram
from ampscope.cli import main


def steps(diagram, block=None):
    return [s for sec in diagram.sections if sec.block == block for s in sec.steps]


def test_gpt2_block_under_amp_bf16(gpt2_tiny):
    d = build_diagram(ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", seq=8))
    blocks = [sec for sec in d.sections if sec.block]
    assert [sec.label for sec in blocks] == ["transformer.h.0–1  (× 2, drawn once)"]
    block = blocks[0].block
    by_module = {s.module: s for s in steps(d, block)}
    c_attn = by_module[f"{block}.attn.c_attn"]
    assert (c_attn.func, c_attn.inputs, c_attn.output) == ("linear", ("float32",), "bfloat16")
    assert ("weight", "float32", "bfloat16") in c_attn.casts
    adds = [s for s in steps(d, block) if s.func == "add"]
    assert [(s.inputs, s.output, s.note) for s in adds] == [
        (("float32", "bfloat16"), "float32", "residual add, type promotion")] * 2
    prelude = [s.func for s in d.sections[0].steps]
    assert prelude == ["embedding", "embedding", "add"]
    loss = d.sections[-1].steps[-1]
    assert (loss.func, loss.output) == ("cross_entropy", "float32")
    assert d.outputs == (("loss", "float32"),)


def test_nanochat_explicit_cast_is_drawn_with_its_line(nanochat_tiny):
    d = build_diagram(ampscope.trace(nanochat_tiny, setting="fp32+amp-bf16", seq=8))
    cast = next(s for s in steps(d) if s.func == "float")
    assert (cast.inputs, cast.output) == (("bfloat16",), "float32")
    file, line = cast.note.removeprefix("explicit cast at ").split(":")
    import ampscope.models.nanochat as nc
    assert file == "nanochat.py"
    assert ".float()" in Path(nc.__file__).read_text().splitlines()[int(line) - 1]


def test_sampling_draws_the_first_model_call_only(nanochat_tiny):
    d = build_diagram(ampscope.trace(nanochat_tiny, setting="fp32", workload="generate",
                                     seq=8, new_tokens=3))
    assert sum(s.func == "embedding" for sec in d.sections for s in sec.steps) == 1


@pytest.mark.fast
def test_fp32_has_no_casts(gpt2_tiny):
    d = build_diagram(ampscope.trace(gpt2_tiny, setting="fp32", seq=8))
    assert not any(s.casts for sec in d.sections for s in sec.steps)


def test_cli_diagram(capsys):
    assert main(["trace", "gpt2-tiny", "--seq", "4", "--diagram"]) == 0
    out = capsys.readouterr().out
    assert "Dtype flow of one forward pass" in out
    assert "┌ transformer.h.0–1  (× 2, drawn once)" in out
    assert "autocast → bf16: " in out and "⇒" in out
