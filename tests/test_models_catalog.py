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
