"""`fit --gpus`'s depth rule on mixture-of-experts blocks (a Mixtral of 6 blocks, 4 experts):
under activation checkpointing a middle block's backward holds more than the first's and the
last's, which a rule bounding the middle by those two missed by 9% (analysis/plans.py: the
middle blocks are a place of their own). The truth is the plan traced whole at all 6 blocks."""

from __future__ import annotations

import pytest

from ampscope.api.parallel_plans import derived_peaks, traced_peaks

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               max_position_embeddings=256, num_local_experts=4,
                               num_experts_per_tok=2).save_pretrained(folder)
    return f"hf:{folder}"


@pytest.mark.parametrize("checkpoint, batch", [(True, 3), (True, 5), (False, 5)])
def test_derived_peaks_of_moe_blocks_equal_the_plan_traced_whole(mixtral, checkpoint, batch):
    options = dict(checkpoint=checkpoint, depth=6, batch=batch, setting="bf16", seq=32)
    assert derived_peaks(mixtral, 4, **options) == traced_peaks(mixtral, 4, **options)
