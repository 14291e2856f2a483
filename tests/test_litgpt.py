"""litgpt, unmodified: `litgpt pretrain` (Lightning Fabric's training loop) on its pythia-14m
config with local text files, under `ampscope run --device cuda` with `--precision bf16-mixed`
and `bf16-true`. The tokenizer and the text are made here (a byte-level BPE trained on
generated words; no download); litdata prepares the token chunks as litgpt's TextFiles asks.

pythia-14m (GPT-NeoX: 6 layers of width 128, MLP 512, biases, untied head, vocabulary padded
to 50,304): the embedding and the head 50,304·128 each; per layer two LayerNorms 2·256, qkv
128·384 + 384, the attention projection 128·128 + 128, the MLP 128·512 + 512 and 512·128 + 128,
198,272 in all; the final LayerNorm 256: 14,067,712 parameters."""

from __future__ import annotations

import json
import math

import pytest

from ampscope.cli import main
from tests.helpers import generated_texts, save_bpe_tokenizer

pytest.importorskip("litgpt", reason="litgpt is installed by `make setup`")
pytest.importorskip("litdata")
pytest.importorskip("tokenizers")

PARAMETERS = 14_067_712


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """Four text files and a tokenizer folder (tokenizer.json, tokenizer_config.json)."""
    texts = generated_texts(80, words=300, longest=300)
    (tmp_path / "data").mkdir()
    for part in range(4):
        (tmp_path / "data" / f"part{part}.txt").write_text("\n".join(texts[part::4]))
    save_bpe_tokenizer(tmp_path / "tok", texts, vocab_size=800,
                       special_tokens=["<|endoftext|>", "<unk>"],
                       config={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                               "tokenizer_class": "PreTrainedTokenizerFast"})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _pretrain(workspace, capsys, precision: str) -> tuple[dict, str]:
    out = workspace / f"{precision}.json"
    code = main(["run", "--device", "cuda", "--quiet", "--json", str(out), "-m", "litgpt", "--",
                 "pretrain", "pythia-14m", "--data", "TextFiles",
                 "--data.train_data_path", "data", "--data.num_workers", "0",
                 "--tokenizer_dir", "tok", "--precision", precision,
                 "--train.max_steps", "2", "--train.micro_batch_size", "2",
                 "--train.global_batch_size", "2", "--train.max_seq_length", "64",
                 "--eval.final_validation", "false", "--eval.interval", "1000",
                 "--logger_name", "csv", "--devices", "1", "--out_dir", "out"])
    text, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.read_text()), " ".join(text.split())


def _parameter_elements(document: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in document["tensors"]["parameters"]:
        counts[p["dtype"]] = counts.get(p["dtype"], 0) + math.prod(p["shape"])
    return counts


@pytest.mark.slow
def test_litgpt_pretrain_bf16_mixed(workspace, capsys):
    document, said = _pretrain(workspace, capsys, "bf16-mixed")
    # Fabric's bf16-mixed: float32 weights, the model's forward under autocast bfloat16.
    assert (document["setting"]["param_dtype"], document["setting"]["autocast_dtype"]) == \
        ("float32", "bfloat16")
    assert _parameter_elements(document) == {"float32": PARAMETERS}
    assert "setting as-run (float32 weights, autocast bfloat16" in said
    assert "2 evaluation passes" in said  # litgpt's validation sanity check, kept apart


@pytest.mark.slow
def test_litgpt_pretrain_bf16_true(workspace, capsys):
    document, said = _pretrain(workspace, capsys, "bf16-true")
    # Fabric's bf16-true: the weights themselves bfloat16, no autocast, AdamW's moments too.
    assert (document["setting"]["param_dtype"], document["setting"]["autocast_dtype"]) == \
        ("bfloat16", None)
    assert _parameter_elements(document) == {"bfloat16": PARAMETERS}
    assert "AMP402 optimizer-state-in-16-bit" in said
