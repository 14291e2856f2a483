"""`flex_attention` (torch.nn.attention.flex_attention), a higher-order operator, under a run:
the recorder's dispatch modes run its dense implementation, the one eager PyTorch runs, so
each of its aten ops is recorded; on the CPU (no gradient: PyTorch has no CPU backward for it)
and on the virtual CUDA device (a train step), real and predicted alike."""

from __future__ import annotations

import pytest

from ampscope.script import run_script

pytest.importorskip("torch.nn.attention.flex_attention")

_FLEX = """\
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

dev = "cuda" if torch.cuda.is_available() else "cpu"

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x, block_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, block_mask=block_mask).transpose(1, 2).reshape(B, T, 64)

def causal(b, h, q, kv):
    return q >= kv

model = Attn().to(dev)
mask = create_block_mask(causal, B=None, H=None, Q_LEN=128, KV_LEN=128, device=dev)
x = torch.randn(2, 128, 64, device=dev)
if dev == "cpu":
    with torch.no_grad():
        model(x, mask)
else:
    opt = torch.optim.AdamW(model.parameters())
    model(x, mask).square().mean().backward()
    opt.step()
"""

# By hand, batch 2, 4 heads, 128 tokens, head dim 16: the qkv Linear 2·256·64·192 FLOPs and
# the dense attention's two matmuls (scores, then scores × values) 2·(2·4·128·128·16) each.
_LINEAR = 2 * 256 * 64 * 192
_ATTENTION = 2 * (2 * 2 * 4 * 128 * 128 * 16)


def _forward(trace):
    return [o for o in trace.ops if o.phase == "forward" and o.module is not None]


@pytest.mark.parametrize("device", [None, "cuda"])
def test_flex_attention_runs_and_is_recorded(tmp_path, device):
    script = tmp_path / "flex.py"
    script.write_text(_FLEX)
    real = run_script(str(script), [], device=device, in_process=True)
    predicted = run_script(str(script), [], device=device, in_process=True, predict=True)
    for trace in (real, predicted):
        names = {o.op for o in _forward(trace)}
        assert "aten._safe_softmax.default" in names  # the dense implementation's softmax
        assert sum(o.flops for o in _forward(trace)) == _LINEAR + _ATTENTION
    assert [(o.op, o.outputs) for o in _forward(predicted)] == \
        [(o.op, o.outputs) for o in _forward(real)]
    if device == "cuda":  # a train step: its backward through flex_attention's own
        assert any(o.phase == "backward" for o in real.ops)
        assert {p.grad_dtype for p in real.parameters} == {"float32"}
