"""A sampler as real code writes it: under torch.inference_mode(), through a KV cache, calling
model.forward(...) directly. The trace must show what a device runs: the decomposed ops
(addmm, not linear), autocast's casts, their FLOPs, and the model as its root module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampscope

pytestmark = pytest.mark.fast


class CachedLM(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, cache):
        x = self.emb(idx)
        cache.append(self.proj(x))  # the KV cache grows by one entry per token
        h = torch.stack(cache).sum(0)
        return self.head(torch.relu(h).square())


def sample(model, batch):
    idx, cache = batch["idx"], []
    with torch.inference_mode():
        for _ in range(3):
            logits = model.forward(idx[:, -1:], cache)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def trace(setting, model=None):
    torch.manual_seed(0)
    return ampscope.trace(model or CachedLM(), {"idx": torch.zeros(1, 1, dtype=torch.long)},
                          setting=setting, workload=sample)


def test_inference_mode_shows_the_decomposed_ops_and_autocast_casts():
    t = trace("fp32+amp-bf16")
    ops = [o.op for o in t.ops]
    assert "aten.linear.default" not in ops and "aten.addmm.default" in ops
    casts = [o for o in t.ops if o.autocast_cast]
    assert casts and all(o.outputs[0].dtype == "bfloat16" for o in casts)
    # Two Linear layers, three tokens: 2·(1·8·8) + 2·(1·8·16) FLOPs per token.
    assert sum(o.flops for o in t.ops) == 3 * (2 * 8 * 8 + 2 * 8 * 16)
    assert any("inference_mode() ran as torch.no_grad()" in n for n in t.notes)
    assert any(f.cause == "autocast-policy" for f in t.findings)


def test_direct_forward_calls_are_model_calls():
    t = trace("fp32+amp-bf16")
    roots = [m for m in t.modules if m.name == ""]
    assert len(roots) == 3 and all(m.type == "CachedLM" for m in roots)
    assert not [o for o in t.ops if o.module is None and o.phase == "forward"
                and o.op == "aten.addmm.default"]  # every matmul inside a module
    assert max(c.step for c in t.calls) == 3  # one step per sampled token


def test_emulated_cuda_applies_its_policy_to_the_parts_of_composite_ops():
    # square is composite: on CUDA it runs as pow, which CUDA's autocast computes in float32.
    t = trace("cuda:fp32+amp-bf16")
    pow_ops = [o for o in t.ops if o.op == "aten.pow.Tensor_Scalar"]
    assert pow_ops and all(o.outputs[0].dtype == "float32" for o in pow_ops)
    cpu = trace("fp32+amp-bf16")
    assert all(o.outputs[0].dtype == "bfloat16" for o in cpu.ops if o.op == "aten.pow.Tensor_Scalar")


def test_inference_mode_and_forward_come_back():
    model = CachedLM()
    trace("fp32", model)
    with torch.inference_mode():
        assert torch.is_inference_mode_enabled()
    assert "forward" not in model.__dict__
