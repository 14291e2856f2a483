"""torchtitan, unmodified: its llama3 debug model trained by `python -m torchtitan.train` under
`ampscope run --nproc` (real ranks on the virtual CUDA device, and predicted ranks). The
tokenizer and the `c4_test` dataset torchtitan reads from ./tests/assets are made here (a
byte-level BPE trained on generated words; no download).

On torch 2.13 torchtitan 0.3.0's default SPMD backend needs an FSDP2 newer than the build
(`fully_shard` refuses plain tensors with `dp_mesh_dims`), so the runs choose its
`partial_dtensor` backend, as a user of this torch must.

The debug model (dim 256, 6 layers, 16 heads with as many key/value heads, vocab 2048, FFN 768):
per layer wqkv 768·256 + wo 256·256 + w1, w3 768·256 + w2 256·768 + two norms 256 = 852,480;
6 layers, the embedding and the head (2048·256 each) and the final norm: 6,163,712 float32
parameters, 24,654,848 B, sharded evenly (every dimension 0 divides by 2 and 8)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import generated_texts, save_bpe_tokenizer
from tests.test_run_nproc import _ampscope, _validated

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make setup`")
pytest.importorskip("tokenizers")

PARAMETER_BYTES = 6_163_712 * 4
ARGS = ("-m", "torchtitan.train", "--", "--module", "llama3", "--config", "llama3_debugmodel",
        "--training.steps", "1", "--training.seq_len", "256",
        "--training.local_batch_size", "2", "--checkpoint.no-enable", "--validator.no-enable",
        "--parallelism.spmd_backend", "partial_dtensor")


@pytest.fixture
def assets(tmp_path, monkeypatch):
    """torchtitan's test assets, made in a folder that becomes the working directory."""
    texts = generated_texts(60)
    save_bpe_tokenizer(tmp_path / "tests" / "assets" / "tokenizer", texts, vocab_size=1000,
                       special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<unk>"],
                       config={"bos_token": "<|begin_of_text|>",
                               "eos_token": "<|end_of_text|>", "add_bos_token": True})
    data_dir = tmp_path / "tests" / "assets" / "c4_test"
    data_dir.mkdir(parents=True)
    (data_dir / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(assets, capsys, nproc: int, predict: bool) -> tuple[dict, str]:
    """The ranks' JSON document and the report's text of one run."""
    out = assets / f"ranks-{nproc}-{predict}.json"
    code, text, err = _ampscope(capsys, "--nproc", str(nproc), *(["--predict"] if predict else []),
                                "--device", "cuda", "--quiet", "--json", str(out), *ARGS)
    assert code == 0, err
    document = _validated(out)
    traced = [rank for rank in document["ranks"] if "held" in rank]
    assert len(traced) == 2  # real: both ranks; predicted: rank 0 and rank N-1 (one role)
    for rank in traced:
        # FSDP2 shards every parameter over the ranks; the gradients match.
        assert rank["held"]["parameter"] == {"float32": PARAMETER_BYTES // nproc}
        assert rank["held"]["gradient"] == {"float32": PARAMETER_BYTES // nproc}
        # torchtitan's mixed precision: bfloat16 compute, float32 gradient reduction.
        kinds = {(c["kind"], c["phase"], c["dtype"]) for c in rank["collectives"]}
        assert {("all_gather", "forward", "bfloat16"),
                ("reduce_scatter", "backward", "float32")} <= kinds
    said = " ".join(text.split())
    # Its MixedPrecisionPolicy, as fully_shard was given it.
    assert "(float32 weights, FSDP2 compute bfloat16, reduce float32, no autocast)" in said
    return document, said


def _collectives(document: dict) -> list:
    """Each rank's collectives: kind, phase, dtype, calls and payload."""
    return [rank["summary"] for rank in document["ranks"] if "held" in rank]


@pytest.mark.slow
def test_two_real_ranks_and_two_predicted_agree(assets, capsys):
    real, said = _run(assets, capsys, 2, predict=False)
    # FSDP2 divides the gradients by torchtitan's factor of 1 with PREMUL_SUM, which gloo lacks.
    assert "asked for ReduceOp.PREMUL_SUM, which gloo lacks" in said
    predicted, _ = _run(assets, capsys, 2, predict=True)
    assert _collectives(predicted) == _collectives(real)


@pytest.mark.slow
def test_eight_predicted_ranks(assets, capsys):
    _run(assets, capsys, 8, predict=True)


# The MoE debug model (deepseek_v3 "debugmodel"): dim 256, 6 layers (1 dense, 5 MoE), 16 heads,
# vocab 2048, multi-head latent attention with kv_lora_rank 512 and no q_lora:
#   wq 256·16(128+64) = 786,432; wkv_a 256·(512+64) = 147,456; kv_norm 512;
#   wkv_b 512·16(128+128) = 2,097,152; wo 16·128·256 = 524,288: attention 3,555,840;
#   two norms 512; dense FFN 3·256·1024 = 786,432;
#   MoE: router 256·8 = 2,048, 8 experts 3·256·256 each = 1,572,864, 2 shared experts (hidden
#   512) 3·256·512 = 393,216: 1,968,128.
DENSE_BLOCK = 3_555_840 + 512 + 786_432
MOE_BLOCK = 3_555_840 + 512 + 1_968_128
EMBEDDING = 2048 * 256
MOE_PARAMETERS = DENSE_BLOCK + 5 * MOE_BLOCK + 2 * EMBEDDING + 256  # + the final norm
MOE_ARGS = tuple(a if a not in ("llama3", "llama3_debugmodel") else
                 {"llama3": "deepseek_v3", "llama3_debugmodel": "deepseek_v3_debugmodel"}[a]
                 for a in ARGS)


@pytest.mark.slow
def test_moe_debug_model_predicted(assets, capsys):
    out = assets / "moe.json"
    code, _, err = _ampscope(capsys, "--nproc", "2", "--predict", "--device", "cuda", "--quiet",
                             "--json", str(out), *MOE_ARGS)
    assert code == 0, err
    document = _validated(out)
    ranks = [rank for rank in document["ranks"] if "held" in rank]
    assert len(ranks) == 2
    for rank in ranks:
        shard = MOE_PARAMETERS * 4 // 2
        assert rank["held"]["parameter"] == {"float32": shard}
        assert rank["held"]["gradient"] == {"float32": shard}
        # AdamW's two moments, and its float32 `step` of each of the 83 parameters.
        assert rank["held"]["optimizer_state"] == {"float32": 2 * shard + 83 * 4}
        # FSDP2 all-gathers each module's parameters in bfloat16, in forward order: the
        # embedding, the dense block, then the MoE blocks.
        gathered = [c["payload_bytes"] for c in rank["collectives"]
                    if (c["kind"], c["phase"]) == ("all_gather", "forward")]
        assert gathered[:3] == [EMBEDDING * 2, DENSE_BLOCK * 2, MOE_BLOCK * 2]
