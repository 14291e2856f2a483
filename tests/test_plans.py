"""`ampscope fit --gpus N`: parallel plans searched from traced ranks, their peaks derived by
rules (analysis/plans.py) that must equal a traced plan to the byte.

The truth for each derived figure is the same plan traced whole — rank 0 of N on fake tensors
and PyTorch's fake process group, FSDP2 (and tensor parallelism) applied to the full model at
the depth and micro-batch asked — which the rules never see."""

from __future__ import annotations

import json

import pytest

from ampscope.api.parallel_plans import derived_peaks, derived_plan, traced_peaks
from ampscope.cli import main
from ampscope.render.style import format_bytes

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
    """gpt2 on 4 H100s held to 2 GiB at seq 512: FSDP only (its blocks are not Llama's), with
    and without checkpointing; each plan's batch is the largest whose derived reserved peak
    fits, its step time is the derived one at that batch, and the plans rank by tokens/s."""
    code = main(["fit", "gpt2", "--gpus", "4", "--gpu", "h100", "--memory", "2GiB", "-s", "bf16",
                 "--seq", "512", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "ampscope.plans/1" and report["depth"] == 12
    plans = {(p["dp"], p["tp"], p["checkpoint"]): p for p in report["plans"]}
    assert set(plans) == {(4, 1, False), (4, 1, True)}
    assert "Tensor parallelism of 2, 4 is not offered" in report["notes"][0]
    assert report["accelerator"] == "h100" and report["memory_bytes"] == 2 * 2**30
    assert plans[4, 1, True]["batch"] > plans[4, 1, False]["batch"] > 0
    rates = [p["tokens_per_second"] for p in report["plans"]]
    assert rates == sorted(rates, reverse=True)
    for p in report["plans"]:
        assert p["tokens"] == p["dp"] * p["batch"] * 512
        options = dict(checkpoint=p["checkpoint"], depth=12, setting="bf16", seq=512, gpu="h100")
        peaks, time, reserved = derived_plan("gpt2", 4, batch=p["batch"], **options)
        assert p["peak_bytes"] == max(peaks.values()) <= reserved == p["reserved_bytes"] \
            <= 2 * 2**30
        assert time is not None and p["step_seconds"] == time.seconds > 0
        assert p["tokens_per_second"] == p["tokens"] / time.seconds
        assert p["bound"] == max(time.by_bound, key=time.by_bound.__getitem__)
        assert 0 < p["mfu"] < 1
        # the next batch does not fit: its derived reserved peak is over the budget
        _, _, over = derived_plan("gpt2", 4, batch=p["batch"] + 1, **options)
        assert over is not None and over > 2 * 2**30
    assert "Searching the plans of gpt2 on 4 GPUs" in err


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be a whole number from 1 to 65,536 (the GPUs of one job), "
                      "not 0"),
    (["--gpus", "2", "--seq", "0"], "--seq must be at least 1 token, not 0"),
    (["--gpus", "2", "--seq", "auto"], "--seq auto does not apply with --gpus"),
    (["--mp-policy", "param=bf16"], "--mp-policy only applies with --gpus N"),
    (["--gpus", "2", "--seq", "100000"], "exceeds gpt2-tiny's context length"),
])
def test_bad_plan_searches_are_one_line(argv, message, capsys):
    code = main(["fit", "gpt2-tiny", "--memory", "1GiB", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("gpus", ["-4", "0", "65537", "99999999999999999999"])
def test_gpus_out_of_range_is_one_line_before_any_progress(gpus, capsys):
    """A count of GPUs no search takes is refused first: no "Searching the plans … on -4
    GPUs", no TypeError from the device mesh."""
    code = main(["fit", "gpt2-tiny", "--memory", "1GiB", "--gpus", gpus, "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Searching" not in err
    assert err.strip() == (f"ampscope: error: --gpus must be a whole number from 1 to 65,536 "
                           f"(the GPUs of one job), not {gpus}")


def test_no_plan_that_fits_is_one_line_and_exit_2(capsys):
    """gpt2-tiny in 64 KiB a GPU: every family traced at micro-batch 1 too, none fits; the
    nearest is named with its peak, as `fit` names its smallest probe."""
    code = main(["fit", "gpt2-tiny", "--gpus", "2", "--memory", "64KiB", "-s", "bf16", "--seq",
                 "16", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("ampscope: error: gpt2-tiny does not fit on 2 GPUs of 64 KiB "
                           "(--memory) under cuda:bf16 at seq 16 in any plan, even at "
                           "micro-batch 1: the smallest peak per rank is ")
    derived = {checkpoint: derived_plan("gpt2-tiny", 2, checkpoint=checkpoint, depth=2, batch=1,
                                        setting="bf16", seq=16) for checkpoint in (False, True)}
    peaks = {checkpoint: max(d[0].values()) for checkpoint, d in derived.items()}
    assert min(peaks.values()) > 64 * 2**10
    nearest = peaks[True] < peaks[False]
    name = "FSDP 2 + checkpointing" if nearest else "FSDP 2"
    reserved = format_bytes(derived[nearest][2])
    assert line.endswith(f" ({name}, {reserved} reserved); more GPUs, a shorter --seq or a "
                         "larger GPU would buy room")
    assert "  FSDP 2: does not fit at micro-batch 1" in err


def test_a_search_that_reaches_its_limit_says_so(capsys):
    """gpt2-tiny at seq 16 in 1 TiB a GPU: every plan fits micro-batch 4,096, the search's
    limit; the JSON marks each plan and the text says every batch up to it fits (≥)."""
    from rich.console import Console

    from ampscope.api.parallel_plans import BATCH_LIMIT, plans
    from ampscope.render.plans import render_plans

    report = plans("gpt2-tiny", 2, memory_size="1TiB", setting="bf16", seq=16)
    document = report.to_dict()
    assert document["batch_limit"] == BATCH_LIMIT == 4096
    assert document["probe_depths"] == [2]
    for p in document["plans"]:
        assert p["at_batch_limit"] and p["batch"] == 4096 and p["tokens"] == 2 * 4096 * 16
        # the limit fits by the rules: its derived peak is the plan's, within the budget
        peak = derived_peaks("gpt2-tiny", 2, checkpoint=p["checkpoint"], depth=2, batch=4096,
                             setting="bf16", seq=16)
        assert max(peak.values()) == p["peak_bytes"] <= 2**40
    console = Console(width=200, record=True)
    console.print(render_plans(report))
    text = console.export_text()
    assert "Best plan: FSDP 2 + checkpointing, every micro-batch up to 4,096 fits" in text
    assert text.count("≥ 4,096") == 2 and text.count("≥ 131,072") == 2
    assert ("FSDP 2 + checkpointing, FSDP 2: every micro-batch up to 4,096 fits in 1,024 GiB "
            "per rank") in text


def test_a_plan_below_the_limit_is_not_marked(capsys):
    """gpt2-tiny in 8 MiB: the largest batches are small, and no plan is at the limit (in 1
    MiB none fits: the allocator reserves a 2 MiB segment for the first small request)."""
    code = main(["fit", "gpt2-tiny", "--gpus", "2", "--memory", "8MiB", "-s", "bf16", "--seq",
                 "16", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert all(0 < p["batch"] < 4096 and not p["at_batch_limit"] for p in report["plans"])
    assert "every micro-batch up to" not in err


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
