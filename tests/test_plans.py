"""`ampscope fit --gpus N`: parallel plans searched from traced ranks, their peaks derived by
rules (analysis/plans.py) that must equal a traced plan to the byte.

The truth for each derived figure is the same plan traced whole — rank 0 of N on fake tensors
and PyTorch's fake process group, FSDP2 (and tensor parallelism) applied to the full model at
the depth and micro-batch asked — which the rules never see."""

from __future__ import annotations

import json

import pytest

from ampscope.api.parallel_plans import derived_peaks, traced_peaks
from ampscope.cli import main

# (model, GPUs, tp, checkpointing, depth, micro-batch, setting, policy): each family the search
# tries, on models of three families (a Llama with grouped-query attention and tensor
# parallelism, nanoGPT's GPT-2 with tied embeddings, nanochat), at their full depth.
CASES = [
    ("llama-3.2-1b", 8, 1, False, 16, 5, "bf16", None),
    ("llama-3.2-1b", 8, 2, True, 16, 3, "bf16", None),
    ("llama-3.2-1b", 8, 4, False, 16, 1, "fp32", "param=bf16,reduce=fp32"),
    ("gpt2", 4, 1, True, 12, 4, "fp32", "param=bf16,reduce=fp32"),
    ("nanochat-d4", 2, 1, False, 4, 7, "bf16", None),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-tp{c[2]}-ac{int(c[3])}-b{c[5]}" for c in CASES])
def test_derived_peaks_equal_the_traced_plan(case):
    model, gpus, tp, checkpoint, depth, batch, setting, policy = case
    options = dict(tp=tp, checkpoint=checkpoint, depth=depth, batch=batch, setting=setting,
                   mp_policy=policy, seq=64)
    traced = traced_peaks(model, gpus, **options)
    assert set(traced) == {"forward", "backward", "optimizer"}
    assert derived_peaks(model, gpus, **options) == traced


def test_the_search_answers_with_its_plans(capsys):
    """gpt2 on 4 GPUs of 2 GiB at seq 512: FSDP only (its blocks are not Llama's), with and
    without checkpointing; each plan's batch is the largest whose derived peak fits."""
    code = main(["fit", "gpt2", "--gpus", "4", "--memory", "2GiB", "-s", "bf16", "--seq", "512",
                 "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "ampscope.plans/1" and report["depth"] == 12
    plans = {(p["dp"], p["tp"], p["checkpoint"]): p for p in report["plans"]}
    assert set(plans) == {(4, 1, False), (4, 1, True)}
    assert "Tensor parallelism of 2, 4 is not offered" in report["notes"][0]
    best = report["plans"][0]
    assert best["checkpoint"] and best["batch"] > plans[4, 1, False]["batch"] > 0
    for p in report["plans"]:
        assert p["tokens"] == p["dp"] * p["batch"] * 512
        assert p["peak_bytes"] <= 2 * 2**30
        # the next batch does not fit: its derived peak is over the budget
        over = derived_peaks("gpt2", 4, checkpoint=p["checkpoint"], depth=12,
                             batch=p["batch"] + 1, setting="bf16", seq=512)
        assert max(over.values()) > 2 * 2**30
    assert "Searching the plans of gpt2 on 4 GPUs" in err


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be at least 1, not 0"),
    (["--gpus", "2", "--seq", "auto"], "--seq auto does not apply with --gpus"),
    (["--mp-policy", "param=bf16"], "--mp-policy only applies with --gpus N"),
    (["--gpus", "2", "--seq", "100000"], "exceeds gpt2-tiny's context length"),
])
def test_bad_plan_searches_are_one_line(argv, message, capsys):
    code = main(["fit", "gpt2-tiny", "--memory", "1GiB", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_model_whose_blocks_differ_is_refused(tmp_path, monkeypatch, capsys):
    """The depth rule takes the first blocks for all: a model whose third block is wider is
    one line, not a wrong answer."""
    (tmp_path / "uneven_model.py").write_text(
        "from torch import nn\n"
        "from ampscope.models.gpt2 import GPT, GPTConfig\n"
        "def build():\n"
        "    model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=2,"
        " n_embd=64))\n"
        "    model.transformer.h[2].mlp.c_fc = nn.Linear(64, 512)\n"
        "    model.transformer.h[2].mlp.c_proj = nn.Linear(512, 64)\n"
        "    return model\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["fit", "uneven_model:build", "--gpus", "2", "--memory", "1GiB", "--seq", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "block 2 differs from block 0" in err and "Traceback" not in err


def test_a_build_without_collectives_on_fake_tensors_is_told_in_one_line(monkeypatch, capsys):
    """torch 2.9's c10d collectives have no Meta kernels, so no rank can be predicted there:
    each predicting command says so before it runs anything."""
    from ampscope.torchcompat import distributed

    monkeypatch.setattr(distributed, "fake_collectives", lambda: False)
    code = main(["fit", "gpt2-tiny", "--gpus", "2", "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert code == 2 and "fit --gpus needs PyTorch's collectives to run on fake tensors" in err
    code = main(["run", "--nproc", "2", "--predict", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and "run --nproc --predict needs PyTorch's collectives" in err
