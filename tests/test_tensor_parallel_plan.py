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
