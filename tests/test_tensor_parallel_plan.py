"""Which blocks `fit --gpus` splits with tensor parallelism (distributed/tensor_parallel.py):
a norm over one head's features splits with its heads (Qwen 3), one over every head's at once
does not (OLMo 2's q_norm and k_norm, whose split ranks would see a quarter of the features
against a whole weight), and the search then answers with its FSDP plans and says why."""

from __future__ import annotations

import json

import pytest
import torch

from ampscope.cli import main
from ampscope.distributed.tensor_parallel import tensor_parallel_plan
from tests.helpers import LM_SOURCE

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)


def _model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **SMALL)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_blocks_whose_norms_see_one_head_split(model_type):
    plan, why = tensor_parallel_plan(_model(model_type), 2)
    assert plan is not None, why


def test_a_norm_over_every_head_is_not_split():
    """OLMo 2 normalises q over all 4 heads × 16 features: 64 weights, q_proj's whole output."""
    plan, why = tensor_parallel_plan(_model("olmo2"), 2)
    assert plan is None
    assert why.startswith("self_attn.q_norm.weight holds 64 values, one per output feature")


@pytest.mark.parametrize("model_type, tensor_parallel", [("olmo2", False), ("qwen3", True)])
def test_the_search_answers_with_the_plans_it_can_trace(tmp_path, capsys, model_type,
                                                        tensor_parallel):
    transformers.AutoConfig.for_model(model_type, **SMALL).save_pretrained(tmp_path)
    code = main(["fit", f"hf:{tmp_path}", "--gpus", "2", "--memory", "1GiB", "-s", "bf16",
                 "--seq", "32", "--json", "-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert {p["tp"] for p in report["plans"]} == ({1, 2} if tensor_parallel else {1})
    said = [n for n in report["notes"] if n.startswith("Tensor parallelism of 2")]
    assert bool(said) != tensor_parallel
    assert not said or "self_attn.q_norm.weight" in said[0]


# A Llama-named block whose attention scales its query projection's output in place, as Llama
# 4's text model does: under tensor parallelism that output is a view of a DTensor's local
# shard, which autograd refuses to change in place.
TP_MODEL = LM_SOURCE + '''

class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.head_dim = width // heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x)
        q.mul_(self.head_dim ** -0.5)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (q, self.k_proj(x), self.v_proj(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.self_attn = nn.LayerNorm(width), Attention(width, 4)
        self.gate_proj, self.up_proj = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down_proj = nn.Linear(2 * width, width)

    def forward(self, x):
        x = x + self.self_attn(self.norm(x))
        return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build():
    return Model([Block(64) for _ in range(2)])
'''


@pytest.mark.parametrize("in_place", [True, False])
def test_a_degree_whose_rank_fails_under_tensor_parallelism_is_left_out(tmp_path, monkeypatch,
                                                                        in_place):
    """The model's own error under tensor parallelism drops that degree, with the error and
    its line in a note; the FSDP plans answer. Scaled out of place, the same model splits."""
    from ampscope.api.parallel_plans import plans

    source = TP_MODEL if in_place else TP_MODEL.replace("q.mul_(", "q = q.mul(")
    name = f"tp_model_{'in_place' if in_place else 'out_of_place'}"  # (one module each)
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = plans(f"{name}:build", 4, memory_size="1GiB", setting="bf16", seq=32)
    assert {p.tp for p in report.plans} == ({1} if in_place else {1, 2, 4})
    failed = [n for n in report.notes if "its rank failed under it" in n]
    if in_place:
        line = 1 + source.splitlines().index("        q.mul_(self.head_dim ** -0.5)")
        assert [n.split(":")[0] for n in failed] == ["Tensor parallelism of 2 is not offered",
                                                     "Tensor parallelism of 4 is not offered"]
        assert all(f"RuntimeError at {name}.py:{line}: Output 0 of" in n for n in failed)
    else:
        assert not failed
