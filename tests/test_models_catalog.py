"""One entry of models/catalog.py is all a named model needs: a test-only GPT-2 preset, added
there and nowhere else, is listed (by `ampscope models` too), built and traced."""

from __future__ import annotations

import json

import pytest

import ampscope
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.models import catalog, gpt2, list_models, resolve


def gpt2_parameters(V: int, T: int, C: int, L: int) -> int:
    """nanoGPT's GPT-2 with biases: wte (tied to lm_head) and wpe; per layer two LayerNorms,
    c_attn, attention's c_proj, c_fc and the MLP's c_proj; the final LayerNorm."""
    layer = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    return V * C + T * C + L * layer + 2 * C


V, T, C, L = 100, 32, 32, 3
EXTRA = catalog.Entry("gpt2-test", "gpt2", gpt2_parameters(V, T, C, L),
                      "GPT-2 as in nanoGPT's model.py, 3 layers × 32",
                      dict(block_size=T, vocab_size=V, n_layer=L, n_head=2, n_embd=C))


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(catalog, "MODELS", (*catalog.MODELS, EXTRA))


def test_the_count_is_derived_as_for_gpt2():
    assert gpt2_parameters(50257, 1024, 768, 12) == catalog.entry("gpt2").parameters
    assert EXTRA.parameters == 42_400  # 3200 + 1024 + 3 × 12704 + 64


@pytest.mark.usefixtures("registered")
def test_one_entry_is_listed_and_counted(capsys):
    assert main(["models", "--json", "-"]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert listed[-1] == {"name": "gpt2-test", "family": "gpt2", "parameters": 42_400,
                          "description": "GPT-2 as in nanoGPT's model.py, 3 layers × 32"}
    assert list(gpt2.PRESETS)[-1] == "gpt2-test"
    assert list_models()[-1] == EXTRA.info  # counted by building it on the meta device


@pytest.mark.usefixtures("registered")
def test_one_entry_is_built():
    lm = resolve("gpt2-test")
    assert (lm.name, lm.family, lm.vocab_size, lm.max_seq_len) == ("gpt2-test", "gpt2", V, T)
    assert len(lm.module.transformer.h) == L
    assert lm.num_parameters == 42_400


@pytest.mark.usefixtures("registered")
def test_one_entry_is_traced(capsys):
    assert main(["trace", "gpt2-test", "-s", "bf16", "--seq", "8", "--predict",
                 "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "gpt2-test" and data["model"]["parameters"] == 42_400
    params = {p["name"]: p for p in data["tensors"]["parameters"]}
    assert params["transformer.wte.weight"]["shape"] == [V, C]
    assert sum(name.endswith(".attn.c_attn.weight") for name in params) == L
    assert {p["dtype"] for p in params.values()} == {"bfloat16"}
    trace = ampscope.trace("gpt2-test", setting="fp32", seq=8, predict=True)
    assert trace.model.parameters == 42_400
    assert {p.dtype for p in trace.parameters} == {"float32"}


def test_without_its_entry_it_is_unknown():
    with pytest.raises(AmpscopeError, match="^unknown model 'gpt2-test'"):
        resolve("gpt2-test")
    with pytest.raises(KeyError, match="unknown gpt2 preset 'gpt2-test'; known: gpt2, "):
        gpt2.load("gpt2-test")


# -- a named model with some of its preset's fields changed: NAME[field=value,...]

def test_changed_fields_build_that_model(capsys):
    # gpt2-tiny is V 512, T 64, C 64, 2 layers; one more layer, counted by the same formula.
    lm = resolve("gpt2-tiny[n_layer=3]", device="meta")
    assert lm.num_parameters == gpt2_parameters(512, 64, 64, 3) == 186_944
    assert lm.name == "gpt2-tiny[n_layer=3]"
    assert main(["trace", "gpt2-tiny[n_layer=3, bias=False]", "--seq", "8", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    # No biases: per layer the two LayerNorms' (C each), c_attn's 3C, attention's c_proj C,
    # c_fc's 4C and the MLP's c_proj C, 11C in all; and the final LayerNorm's C.
    assert document["model"]["parameters"] == 186_944 - 3 * 11 * 64 - 64


def test_changed_fields_reach_a_zoo_config():
    pytest.importorskip("transformers")
    small = "n_layer=1,n_embd=64,n_head=2,vocab_size=128"

    def attention_ops(spec: str) -> set[str]:
        t = ampscope.trace(spec, seq=8, setting="cuda:fp32+amp-bf16", workload="forward")
        return {o.op for o in t.ops if "softmax" in o.op or "attention" in o.op}

    # transformers' default here is SDPA; "eager" is its hand-written attention.
    assert any("attention" in op for op in attention_ops(f"gpt2-hf[{small}]"))
    assert attention_ops(f"gpt2-hf[attn_implementation=eager,{small}]") == \
        {"aten._softmax.default"}


@pytest.mark.parametrize("spec, said", [
    ("gpt2-tiny[n_layerz=3]", "unexpected keyword argument 'n_layerz'"),
    ("gpt2-tiny[n_layer]", "'n_layer' is not field=value"),
    ("gpt2-tiny[n_layer=3", "write changed fields as NAME[field=value,...]"),
    ("gpt3[n_layer=3]", "unknown model 'gpt3'; did you mean 'gpt2'?"),
])
def test_a_bad_change_is_one_line(spec, said):
    with pytest.raises(AmpscopeError, match=None) as raised:
        resolve(spec, device="meta")
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_split_spec_reads_literals_and_words():
    assert catalog.split_spec("gpt2[n_layer=4, bias=False, dropout=0.1, attention=manual]") == \
        ("gpt2", {"n_layer": 4, "bias": False, "dropout": 0.1, "attention": "manual"})
    assert catalog.split_spec("gpt2") == ("gpt2", {})


def test_a_changed_spec_is_printed_as_written(capsys):
    """Brackets in a model name are text, not console markup."""
    assert main(["fit", "gpt2-tiny[n_layer=3]", "--memory", "1GiB", "--seq", "8",
                 "--no-variants"]) == 0
    assert "Probing gpt2-tiny[n_layer=3] (predicted" in capsys.readouterr().out
