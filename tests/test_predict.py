"""Predict mode: the same run on fake tensors gives the same trace, op for op, and any size fits.

Known differences, each checked here so that a change in them shows up (docs/emulation.md):
- a GradScaler step reads `found_inf` (`.item()`, aten._local_scalar_dense) to decide whether
  to step; a fake tensor has no value, so predict mode assumes finite gradients and steps
  without that read (a real fp16 step may instead skip the optimizer, as the first steps of a
  fresh GradScaler often do);
- at sequence length 1 (KV-cache decoding), PyTorch's meta kernels may give size-1 dimensions
  other strides than the CPU kernels, and `matmul` then takes its batched path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampscope
from ampscope.errors import AmpscopeError, DtypeMismatchError


def _ops(t):
    return [(o.op, o.phase, o.module, o.inputs, o.outputs, o.autocast_cast, o.source)
            for o in t.ops]


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split(".")[:2]) < (major, minor)


def _modules(t):
    return [(m.name, m.type, m.phase, m.inputs, m.outputs) for m in t.modules]


def _inventory(t):
    return (t.parameters, t.buffers, t.optimizer_state, t.inputs, t.outputs)


CASES = [
    (model, setting, workload)
    for model in ("gpt2-tiny", "nanochat-tiny")
    for setting in ("fp32+amp-bf16", "bf16", "cuda:fp32+amp-bf16", "cuda:bf16")
    for workload in ("train", "forward")
] + [
    ("gpt2-tiny", "cuda:fp32+amp-bf16", "generate"),
    ("nanochat-tiny", "fp32+amp-bf16", "generate"),
    ("gpt2-tiny", "mps:fp32+amp-fp16", "forward"),
    ("gpt2-tiny", "cuda:fp32", "train"),
]


@pytest.mark.parametrize(("model", "setting", "workload"), CASES)
def test_predicted_trace_equals_the_real_one(model, setting, workload):
    if (model, workload) == ("nanochat-tiny", "generate") and _torch_before(2, 11):
        pytest.skip("before torch 2.11, a linear on one sampled token decomposes differently "
                    "on fake tensors (expand + bmm) than on the CPU (view + mm): torch's own "
                    "paths differ, ampscope's exact path included")
    real = ampscope.trace(model, setting=setting, workload=workload, batch=2, seq=8,
                          predict=False)
    predicted = ampscope.trace(model, setting=setting, workload=workload, batch=2, seq=8,
                               predict=True)
    assert (real.mode, predicted.mode) == ("run", "predict")
    assert _ops(predicted) == _ops(real)
    assert _modules(predicted) == _modules(real)
    assert _inventory(predicted) == _inventory(real)
    assert [f.text for f in predicted.findings] == [f.text for f in real.findings]


def test_a_gradscaler_step_is_predicted_as_a_step_with_finite_gradients():
    kwargs = dict(setting="cuda:fp32+amp-fp16", workload="train", seq=4)
    real = _ops(ampscope.trace("gpt2-tiny", predict=False, **kwargs))
    predicted = _ops(ampscope.trace("gpt2-tiny", predict=True, **kwargs))
    unscale = "aten._amp_foreach_non_finite_check_and_unscale_.default"
    i = next(i for i, o in enumerate(real) if o[0] == unscale)
    assert predicted[: i + 1] == real[: i + 1]  # forward, scaled backward, unscale: the same
    assert real[i + 1][0] == "aten._local_scalar_dense.default"  # found_inf.item()
    assert predicted[i + 1][0] != "aten._local_scalar_dense.default"
    assert any(o[0].startswith("aten._foreach_add") for o in predicted[i + 1:])  # AdamW stepped
    assert predicted[-1][0] == real[-1][0] == "aten._amp_update_scale_.default"


def test_nanochat_without_autocast_on_cuda_fails_as_it_would_there():
    """nanochat keeps its embedding in bf16 on CUDA and relies on autocast: without it the
    first projection gets bf16 activations and fp32 weights, in a real run and a predicted one."""
    for predict in (False, True):
        with pytest.raises(DtypeMismatchError, match=r"transformer\.h\.0\.attn\.c_q.*bfloat16 and float32"):
            ampscope.trace("nanochat-tiny", setting="cuda:fp32", workload="forward", seq=4,
                           predict=predict)


@pytest.mark.fast
def test_predict_keeps_the_users_model_exactly(gpt2_tiny):
    module = gpt2_tiny.module
    before = {n: (p, p.data, p.data_ptr(), p.dtype) for n, p in module.named_parameters()}
    t = ampscope.trace(gpt2_tiny, setting="cuda:bf16", workload="train", seq=8, predict=True)
    assert t.mode == "predict" and all(p.dtype == "bfloat16" for p in t.parameters)
    after = {n: (p, p.data, p.data_ptr(), p.dtype) for n, p in module.named_parameters()}
    assert all(before[n][0] is after[n][0] and before[n][2:] == after[n][2:] for n in before)
    assert all(p.grad is None and type(p.data) is torch.Tensor for p in module.parameters())
    assert module.transformer.wte.weight is module.lm_head.weight  # still tied


def test_a_model_that_would_not_fit_is_predicted_and_says_so(monkeypatch):
    from ampscope.models import registry
    monkeypatch.setattr(registry, "available_memory_bytes", lambda *a, **k: 10**6)
    t = ampscope.trace("gpt2-tiny", setting="bf16", workload="train", seq=4)
    assert t.mode == "predict"
    assert t.notes[0].startswith("Predicted on fake tensors (the default")
    with pytest.raises(AmpscopeError, match="or predict it on fake tensors"):
        ampscope.trace("gpt2-tiny", setting="bf16", workload="train", seq=4, predict=False)


def test_llama_3_8b_trains_in_predict_mode_with_its_real_shapes():
    pytest.importorskip("transformers")
    t = ampscope.trace("llama-3-8b", setting="cuda:bf16", workload="train", seq=16, predict=True)
    assert t.model.parameters == 8_030_261_248
    embed = next(p for p in t.parameters if p.name == "model.embed_tokens.weight")
    assert (embed.dtype, embed.shape, embed.grad_dtype) == ("bfloat16", (128256, 4096), "bfloat16")
    moments = [s for s in t.optimizer_state if s.key in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(t.parameters) and {s.dtype for s in moments} == {"bfloat16"}
    assert sum(m.type == "LlamaDecoderLayer" and m.phase == "forward" for m in t.modules) == 32


@pytest.mark.fast
def test_code_that_reads_values_gets_one_line_in_predict_mode():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum() > 0 else y  # needs the value

    with pytest.raises(AmpscopeError, match="predict mode cannot run .* reads a tensor's value"):
        ampscope.trace(Branchy(), torch.randn(2, 4), workload=lambda m, b: m(next(iter(b.values()))),
                       predict=True)


class _ReadsAValue(torch.nn.Module):
    """A model whose forward branches on a value: a fake tensor cannot answer it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return y * 2 if y.sum().item() > 0 else y


def test_the_default_predicts_and_runs_for_real_when_the_model_reads_a_value():
    import ampscope

    plain = ampscope.trace(torch.nn.Linear(8, 8), torch.randn(2, 8), workload="forward")
    assert plain.mode == "predict"
    model = _ReadsAValue()
    t = ampscope.trace(model, torch.randn(2, 8), workload="forward")
    assert t.mode == "run"
    assert t.notes[0].startswith("Run for real: the model reads a tensor's value")
    # Asked for explicitly, predicting such a model is refused in one line.
    with pytest.raises(ampscope.AmpscopeError, match="reads a tensor's value"):
        ampscope.trace(model, torch.randn(2, 8), workload="forward", predict=True)


def test_a_predicted_transformers_model_says_its_attention_got_a_mask(tmp_path):
    """transformers builds its causal mask explicitly when it sees fake tensors; a real run
    without padding passes no mask. The predicted trace says so, and the real one has no mask."""
    transformers = pytest.importorskip("transformers")
    import ampscope

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    config.save_pretrained(tmp_path)

    def masked(t):
        return [len(o.inputs) >= 4 for o in t.ops
                if "scaled_dot_product" in o.op and o.phase == "forward"]

    fake = ampscope.trace(f"hf:{tmp_path}", seq=8, workload="forward")
    real = ampscope.trace(f"hf:{tmp_path}", seq=8, workload="forward", predict=False)
    assert masked(fake) == [True] and masked(real) == [False]
    assert any(n.startswith("transformers treats fake tensors as tracing") for n in fake.notes)
    assert not any("transformers treats" in n for n in real.notes)


def test_foreach_defaults_count_a_fake_tensor_as_the_tensor_it_stands_for():
    """PyTorch's own choice (torch.optim's `_default_to_fused_or_foreach`, and
    `_has_foreach_support` behind `clip_grad_norm_`) is foreach for a CUDA parameter; for a fake
    one it is the for-loop, unless the predicted run says otherwise; the lists come back."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.optim import optimizer as optimizers
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils import _foreach_utils

    from ampscope.runtime.predict import foreach_defaults_as_real

    with FakeTensorMode():
        p = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
        cpu = torch.nn.Parameter(torch.empty(4, 4))
    before = (list(optimizers._foreach_supported_types),
              list(_foreach_utils._foreach_supported_types))
    assert _default_to_fused_or_foreach([p], False) == (False, False)
    with foreach_defaults_as_real():
        assert _default_to_fused_or_foreach([p], False) == (False, True)
        assert _foreach_utils._has_foreach_support([p], p.device)
        assert _default_to_fused_or_foreach([cpu], False) == (False, False)  # as on the CPU
    assert (list(optimizers._foreach_supported_types),
            list(_foreach_utils._foreach_supported_types)) == before


def test_new_fake_tensors_are_those_fake_mode_makes():
    """`new_fake` learns how FakeTensor wraps a meta tensor from the first one of a mode and
    device, and wraps later ones the same way itself: each is what `torch.empty_strided` makes
    under the mode (the ground truth), down to its attributes and dispatch keys, and works in
    the mode's ops."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from ampscope.runtime.predict import new_fake

    mode = FakeTensorMode()
    for shape, stride, dtype in [((4, 4), (4, 1), torch.float32),
                                 ((3, 5), (1, 3), torch.bfloat16), ((), (), torch.int64)]:
        first = new_fake(mode, shape, stride, dtype, "cpu")
        later = new_fake(mode, shape, stride, dtype, torch.device("cpu"))
        with mode:
            truth = torch.empty_strided(shape, stride, dtype=dtype)
        for t in (first, later):
            assert type(t) is FakeTensor and t.fake_mode is mode and not t.requires_grad
            assert (t.shape, t.stride(), t.dtype, t.fake_device) == (truth.shape, truth.stride(),
                                                                      truth.dtype, truth.fake_device)
            assert vars(t) == vars(truth)  # its mode, device and empty memos
            assert torch._C._dispatch_keys(t) == torch._C._dispatch_keys(truth)
        assert later.untyped_storage()._cdata != first.untyped_storage()._cdata
        with mode:
            assert (later * 2).shape == truth.shape
