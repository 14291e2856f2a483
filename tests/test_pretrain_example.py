"""examples/gpt/pretrain.py, the example in the shape of a larger production script, under
`ampscope run` on the virtual CUDA device.

The script picks its device with `torch.accelerator`, loads a tokenizer table with
`torch.load(map_location=device)`, evaluates the loss under `torch.no_grad()` and samples a few
tokens from a seeded CUDA generator before its first step, accumulates gradients over
micro-steps with a GradScaler, and switches TF32 on. What a GPU run of it does is read off its
code: 8 training passes of B×T tokens for the first optimizer step, 2 evaluation passes and 4
sampling passes before it, float16 autocast, the GradScaler's unscale and update. The FLOPs
are derived by hand from the shapes (6·N·D for the convention, each matmul dtype's peak for
MFU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ampscope import hardware
from ampscope.analysis.flops import flop_report, utilization
from ampscope.analysis.summary import tokens_of
from ampscope.script import run_script

EXAMPLE = Path(__file__).parent.parent / "examples" / "gpt" / "pretrain.py"


@pytest.fixture
def data(tmp_path):
    np.random.default_rng(0).integers(0, 512, 5_000, dtype=np.uint16).tofile(
        tmp_path / "train.bin")
    return f"--data_dir={tmp_path}"


def test_the_example_on_the_virtual_gpu(data, tmp_path):
    t = run_script(str(EXAMPLE), [data, "--block_size=16", "--n_layer=1", "--batch_size=2",
                                  "--gradient_accumulation_steps=3"],
                   device="cuda", in_process=True)
    s = t.setting
    assert (s.device, s.emulated, s.autocast_dtype, s.matmul_precision) == (
        "cuda", True, "float16", "high")  # allow_tf32 = True in the script
    assert [p.kind for p in t.passes] == ["evaluation"] * 2 + ["sampling"] * 4 + ["train"] * 3
    assert tokens_of(t) == 3 * 2 * 16
    ops = [o.op for o in t.ops]
    # The GradScaler's whole step ran: unscale, the optimizer's step, and its update.
    assert ops.count("aten._amp_foreach_non_finite_check_and_unscale_.default") == 1
    assert ops.count("aten._amp_update_scale_.default") == 1
    # The tokenizer table came back as the script wrote it, on the target device.
    assert (tmp_path / "vocab512.pt").exists()
    assert any("saw cuda" in n for n in t.notes)


def test_gpt2_small_with_8_micro_steps_and_an_evaluation_first(data):
    """GPT-2 124M (12 layers, 12 heads, width 768, vocabulary 50,304, 1,024 positions),
    predicted: the step's tokens are 8 × B × T, its 6·N·D convention uses them, the
    attention shape is read from one training pass (12 layers, not the evaluation passes'
    too), and MFU for a given step time is the counted FLOPs over each dtype's peak."""
    b, seq, micro = 2, 1024, 8
    t = run_script(str(EXAMPLE), [data, "--n_layer=12", "--n_head=12", "--n_embd=768",
                                  "--vocab_size=50304", f"--block_size={seq}",
                                  f"--batch_size={b}", f"--gradient_accumulation_steps={micro}",
                                  "--sample_tokens=1"],
                   device="cuda", predict=True, in_process=True)
    n = t.model.parameters
    assert n == 124_475_904  # 50,304·768 + 1,024·768 + 12 blocks of 7,087,872, + ln_f
    report = flop_report(t, tokens=tokens_of(t))
    assert report.tokens == micro * b * seq
    six_nd = next(c for c in report.conventions if c.name == "6·N·D")
    assert six_nd.flops == 6 * n * micro * b * seq
    assert report.attention is not None and report.attention.layers == 12
    assert report.evaluation > 0 and report.evaluation < report.total
    # The step's matmuls ran in float16 (autocast), the evaluation's are not in by_dtype.
    assert set(report.by_dtype) == {"float16"}
    assert sum(report.by_dtype.values()) == report.total
    h100 = hardware.by_name("h100")
    used = utilization(report, 2.0, h100, t.setting.matmul_precision)
    peak = hardware.peak_flops(h100, "float16")
    assert peak is not None and used.mfu == pytest.approx(report.total / 2.0 / peak)
