"""Model specs: the zoo's parameter counts, hf:PATH, user factories, errors, RNG hygiene."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ampscope.errors import AmpscopeError
from ampscope.models import LoadedModel, ModelInfo, hf, list_models, registry, resolve

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    dtype="bfloat16",  # ampscope must build in float32 regardless
)


def tiny_llama_config(**overrides):
    kwargs = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"} | overrides
    return transformers.LlamaConfig(**kwargs)


def llama_parameters(V, d, L, heads, kv_heads, ff, tied, head_dim=None, qkv_bias=False):
    """Llama/Mistral/Qwen2 parameter count: embeddings (+ untied lm_head), per layer q, k, v, o,
    gate/up/down and two RMSNorm weights, and the final norm."""
    hd = head_dim or d // heads
    attn = d * heads * hd + 2 * d * kv_heads * hd + heads * hd * d
    if qkv_bias:
        attn += heads * hd + 2 * kv_heads * hd
    layer = attn + 3 * d * ff + 2 * d
    return V * d * (1 if tied else 2) + L * layer + d


# Published totals (tied weights once), from the model cards / safetensors metadata on the Hub;
# the Llama-style ones are re-derived with llama_parameters, OPT and GPT-2 by their formulas.
PUBLISHED = {
    "opt-125m": 125_239_296,
    "gpt2-hf": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "smollm2-135m": 134_515_008,
}


def test_published_counts_match_their_derivation():
    assert PUBLISHED["llama-3.2-1b"] == llama_parameters(128256, 2048, 16, 32, 8, 8192, True)
    assert PUBLISHED["llama-3-8b"] == llama_parameters(128256, 4096, 32, 32, 8, 14336, False)
    assert PUBLISHED["llama-3-70b"] == llama_parameters(128256, 8192, 80, 64, 8, 28672, False)
    assert PUBLISHED["mistral-7b"] == llama_parameters(32000, 4096, 32, 32, 8, 14336, False)
    assert PUBLISHED["qwen2.5-0.5b"] == llama_parameters(
        151936, 896, 24, 14, 2, 4864, True, qkv_bias=True
    )
    assert PUBLISHED["smollm2-135m"] == llama_parameters(49152, 576, 30, 9, 3, 1536, True)
    # OPT: tied token embeddings, 2050 learned positions (offset 2), per layer 4 d×d + biases,
    # two LayerNorms, fc1/fc2 with biases; one final LayerNorm.
    d, ff = 768, 3072
    opt_layer = 4 * (d * d + d) + 2 * 2 * d + (d * ff + ff) + (ff * d + d)
    assert PUBLISHED["opt-125m"] == 50272 * d + 2050 * d + 12 * opt_layer + 2 * d
    # GPT-2: tied wte, 1024 positions, per layer c_attn/c_proj/c_fc/c_proj with biases, two LNs.
    gpt2_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    assert PUBLISHED["gpt2-hf"] == 50257 * d + 1024 * d + 12 * gpt2_layer + 2 * d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_zoo_parameter_counts_on_meta(name):
    loaded = resolve(name, device="meta")
    assert loaded.num_parameters == PUBLISHED[name]
    assert loaded.family == "hf"
    assert next(loaded.module.parameters()).device.type == "meta"
    assert next(loaded.module.parameters()).dtype == torch.float32
    assert loaded.module.config._attn_implementation == "sdpa"


def test_zoo_is_fully_covered_by_published_counts():
    assert set(hf.ZOO) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(hf.ZOO))
def test_every_zoo_architecture_trains_and_samples_at_tiny_size(name):
    config = hf.ZOO[name]
    shrink = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    shrink |= dict(num_key_value_heads=2, intermediate_size=128, head_dim=16)  # Llama family
    shrink |= dict(ffn_dim=128, word_embed_proj_dim=64)  # OPT
    for key, value in shrink.items():
        if hasattr(config, key):  # GPT2Config maps hidden_size etc. to n_embd, ...
            setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loaded = hf.hf_loaded_model(hf.build_from_config(config, device="cpu"), name=name)
        generator = torch.Generator().manual_seed(0)
        loss = loaded.loss(loaded.make_batch(2, 16, "train", generator))
        loss.backward()
        prompt = loaded.make_batch(2, 4, "generate", generator)[loaded.input_name]
        assert loaded.generate(prompt, 3, generator).shape == (2, 7)
    assert 5.0 < loss.item() < 6.5  # ≈ ln(256) = 5.55 for a random model


def test_tied_weights_counted_once():
    tied = resolve("llama-3.2-1b", device="meta").module
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    untied_config = hf.ZOO["llama-3.2-1b"]
    untied_config.tie_word_embeddings = False
    untied = hf.hf_loaded_model(hf.build_from_config(untied_config, device="meta"), name="x")
    assert untied.num_parameters - PUBLISHED["llama-3.2-1b"] == 128256 * 2048


def test_list_models_covers_builtins_and_zoo():
    infos = {info.name: info for info in list_models()}
    assert {"gpt2", "gpt2-medium", "gpt2-tiny", "nanochat-d4", "nanochat-d20"} <= set(infos)
    assert set(hf.ZOO) <= set(infos)
    assert all(isinstance(info, ModelInfo) and info.description for info in infos.values())
    assert infos["gpt2"].parameters == 124_439_808  # nanoGPT's GPT-2, wte tied to lm_head
    assert infos["gpt2"].family == "gpt2"
    assert infos["nanochat-d20"].family == "nanochat"
    assert infos["llama-3-8b"].parameters == PUBLISHED["llama-3-8b"]
    assert len(infos) == len(list_models())  # each model listed once


@pytest.mark.fast
@pytest.mark.parametrize("name", ["gpt2-tiny", "nanochat-tiny"])
def test_builtins_resolve_on_cpu(name):
    loaded = resolve(name)
    assert loaded.name == name
    batch = loaded.make_batch(2, 8, "train", torch.Generator().manual_seed(0))
    assert loaded.loss(batch).isfinite()


def test_resolving_a_builtin_does_not_import_transformers():
    code = (
        "import sys; from ampscope.models import resolve; resolve('gpt2-tiny'); "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- errors ---------------------------------------------------------------------------------


def test_unknown_name_suggests_the_closest():
    with pytest.raises(AmpscopeError) as info:
        resolve("gtp2")
    message = str(info.value)
    assert "unknown model 'gtp2'; did you mean 'gpt2'?" in message
    assert "`ampscope models` lists them" in message
    assert "\n" not in message


def test_unknown_name_without_close_match():
    with pytest.raises(AmpscopeError, match="unknown model 'zzzzzz'; `ampscope models`"):
        resolve("zzzzzz")


@pytest.mark.fast
def test_zoo_name_typo():
    with pytest.raises(AmpscopeError, match="did you mean 'llama-3-8b'"):
        resolve("llama3-8b", device="meta")


# --- hf:PATH --------------------------------------------------------------------------------


def test_hf_config_json_builds_tiny_model_in_float32(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(TINY_LLAMA))
    for spec in (f"hf:{config_file}", f"hf:{tmp_path}"):
        loaded = resolve(spec)
        assert loaded.family == "hf"
        assert loaded.vocab_size == 128 and loaded.max_seq_len == 64
        assert {p.dtype for p in loaded.module.parameters()} == {torch.float32}
        assert loaded.module.config._attn_implementation == "sdpa"
        batch = loaded.make_batch(2, 8, "forward", torch.Generator().manual_seed(0))
        logits = loaded.logits(batch)
        assert logits.shape == (2, 8, 128) and logits.dtype == torch.float32


def test_hf_safetensors_folder_round_trips_weights(tmp_path):
    original = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    original.save_pretrained(tmp_path)  # config.json + model.safetensors
    assert list(tmp_path.glob("*.safetensors"))
    loaded = resolve(f"hf:{tmp_path}", seed=123)
    expected = {k: v.float() for k, v in original.state_dict().items()}
    got = loaded.module.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert {v.dtype for v in got.values()} == {torch.float32}  # checkpoint was bf16


def test_hf_torch_checkpoint_folder_loads_with_weights_only(tmp_path):
    original = transformers.AutoModelForCausalLM.from_config(
        tiny_llama_config(tie_word_embeddings=True, dtype="float32")
    )
    original.config.save_pretrained(tmp_path)
    state = original.state_dict()
    del state["lm_head.weight"]  # stored once, under the embedding's name
    torch.save({"model": state, "iter_num": 3}, tmp_path / "ckpt.pt")
    loaded = resolve(f"hf:{tmp_path}", seed=123)
    got = loaded.module.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in original.state_dict().items())


class NotAWeight:
    """Pickled into a checkpoint: torch.load(weights_only=True) must refuse it."""


def test_hf_checkpoint_problems_are_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    torch.save({"model.embed_tokens.weight": torch.zeros(3, 3)}, tmp_path / "model.bin")
    with pytest.raises(AmpscopeError, match="checkpoint does not match config.json"):
        resolve(f"hf:{tmp_path}")
    torch.save({"model": NotAWeight()}, tmp_path / "model.bin")
    with pytest.raises(AmpscopeError, match="cannot load .*model.bin with weights_only=True"):
        resolve(f"hf:{tmp_path}")


@pytest.mark.parametrize(
    ("model_type", "message"),
    [("vit", "cannot build a causal LM from ViTConfig"), ("no-such-arch", "no-such-arch")],
)
def test_hf_config_that_is_no_causal_lm(tmp_path, model_type, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(AmpscopeError, match=message):
        resolve(f"hf:{tmp_path / 'config.json'}")


def test_hf_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(AmpscopeError, match=f"hf:{missing}: no such file or folder"):
        resolve(f"hf:{missing}")
    with pytest.raises(AmpscopeError, match="no config.json"):
        resolve(f"hf:{tmp_path}")


def test_hf_tiny_loss_generate_and_logits(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(TINY_LLAMA))
    loaded = resolve(f"hf:{config_file}")
    generator = torch.Generator().manual_seed(0)

    batch = loaded.make_batch(2, 16, "train", generator)
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["input_ids"], batch["labels"])  # HF shifts labels itself
    loss = loaded.loss(batch)
    assert loss.ndim == 0 and loss.isfinite()
    loss.backward()
    assert loaded.module.model.embed_tokens.weight.grad is not None

    prompt = loaded.make_batch(2, 4, "generate", generator)["input_ids"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = loaded.generate(prompt, 5, generator)
    assert out.shape == (2, 9)  # always max_new_tokens new tokens: eos does not stop it
    assert torch.equal(out[:, :4], prompt)
    assert int(out.max()) < 128


# --- package.module:factory -----------------------------------------------------------------

FACTORY_MODULE = """
from dataclasses import dataclass
import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 32
    block_size: int = 16


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Config()
        self.emb = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, 32), targets.view(-1))


def build():
    return Tiny()


def build_float64():
    torch.set_default_dtype(torch.float64)
    return Tiny()


def build_tied_on_cpu():
    model = Tiny()
    with torch.device("cpu"):  # explicit: the factory ignores the requested device
        model.emb = nn.Embedding(32, 8)
        model.head = nn.Linear(8, 32)
    model.head.weight = model.emb.weight
    return model


def build_broken():
    raise ValueError("no such size\\nsecond line")


def build_without_config():
    return nn.Linear(2, 2)
"""


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    """A module in the working directory, named per test so sys.modules never serves a stale one."""

    def write(name: str, source: str = FACTORY_MODULE) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.chdir(tmp_path)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


def test_factory_module_from_working_directory(factory_dir):
    module_name = factory_dir("ampscope_test_factory_ok")
    path_before = list(sys.path)
    loaded = resolve(f"{module_name}:build")
    assert sys.path == path_before
    assert loaded.family == "custom"
    assert loaded.vocab_size == 32 and loaded.max_seq_len == 16
    batch = loaded.make_batch(2, 8, "train", torch.Generator().manual_seed(0))
    assert loaded.loss(batch).isfinite()


@pytest.mark.fast
def test_factory_builds_on_the_requested_device_keeping_ties(factory_dir):
    module_name = factory_dir("ampscope_test_factory_meta")
    plain = resolve(f"{module_name}:build", device="meta")
    assert {p.device.type for p in plain.module.parameters()} == {"meta"}
    tied = resolve(f"{module_name}:build_tied_on_cpu", device="meta").module
    assert {p.device.type for p in tied.parameters()} == {"meta"}
    assert tied.head.weight is tied.emb.weight
    assert resolve(f"{module_name}:build_tied_on_cpu").num_parameters == 32 * 8 + 32


def test_factory_hf_model_gets_hf_adapter(factory_dir):
    kwargs = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    source = f"""
    import transformers
    def build():
        config = transformers.LlamaConfig(**{kwargs!r})
        return transformers.AutoModelForCausalLM.from_config(config)
    """
    module_name = factory_dir("ampscope_test_factory_hf", source)
    loaded = resolve(f"{module_name}:build")
    assert loaded.family == "hf" and loaded.input_name == "input_ids"


@pytest.mark.fast
def test_factory_errors(factory_dir):
    module_name = factory_dir("ampscope_test_factory_errors")
    with pytest.raises(
        AmpscopeError, match=f"'{module_name}' has no factory 'buidl'; did you mean 'build'"
    ):
        resolve(f"{module_name}:buidl")
    # The line of the factory's `raise`, counted in the source the fixture wrote.
    line = textwrap.dedent(FACTORY_MODULE).splitlines().index('    raise ValueError("no such '
                                                              'size\\nsecond line")') + 1
    with pytest.raises(AmpscopeError, match=rf"build_broken raised ValueError at "
                       rf"{module_name}\.py:{line}: no such size$"):
        resolve(f"{module_name}:build_broken")
    with pytest.raises(AmpscopeError, match="without config.vocab_size and config.block_size"):
        resolve(f"{module_name}:build_without_config")
    with pytest.raises(AmpscopeError, match="cannot import module 'ampscope_no_such_module'"):
        resolve("ampscope_no_such_module:build")


def test_factory_default_dtype_change_is_undone(factory_dir):
    module_name = factory_dir("ampscope_test_factory_dtype")
    loaded = resolve(f"{module_name}:build_float64")
    assert torch.get_default_dtype() == torch.float32
    assert loaded.module.head.weight.dtype == torch.float64  # the model keeps what it built


# --- RNG hygiene ----------------------------------------------------------------------------


def test_resolve_leaves_caller_rng_untouched_and_is_reproducible():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = resolve("gpt2-tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = resolve("gpt2-tiny", seed=7)
    c = resolve("gpt2-tiny", seed=8)
    wa, wb, wc = (m.module.state_dict()["transformer.wte.weight"] for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(torch.get_rng_state(), state)


def test_hf_resolve_is_reproducible(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(TINY_LLAMA))
    a, b = (resolve(f"hf:{config_file}", seed=3).module.state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- memory guard ---------------------------------------------------------------------------


def test_memory_shortfall_message():
    message = registry.memory_shortfall(
        "llama-3-70b", PUBLISHED["llama-3-70b"], bytes_per_parameter=4, available_bytes=24 * 10**9
    )
    assert message == (
        "llama-3-70b has 70.6B parameters (282 GB in float32), more than this machine's 24 GB "
        "free; pick a smaller model or a lighter workload"
    )
    small = registry.memory_shortfall(
        "smollm2-135m", PUBLISHED["smollm2-135m"], bytes_per_parameter=16,
        available_bytes=24 * 10**9,
    )  # fmt: skip
    assert small is None
    unknown = registry.memory_shortfall(
        "llama-3-70b", PUBLISHED["llama-3-70b"], bytes_per_parameter=4, available_bytes=None
    )
    assert unknown is None  # cannot tell: do not refuse


def test_available_memory_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   24000000 kB\n")
    assert registry.available_memory_bytes(meminfo) == 24_000_000 * 1024
    fallback = registry.available_memory_bytes(tmp_path / "missing")
    assert fallback is None or fallback > 0


def test_resolve_refuses_a_model_that_cannot_fit(monkeypatch):
    monkeypatch.setattr(registry, "available_memory_bytes", lambda: 24 * 10**9)
    with pytest.raises(AmpscopeError, match=r"^llama-3-70b has 70.6B parameters \(282 GB"):
        resolve("llama-3-70b")
    with pytest.raises(AmpscopeError, match="more than this machine's 24 GB"):
        registry.check_fits_in_memory("gpt2", 124_439_808, bytes_per_parameter=1000)
    assert resolve("llama-3-70b", device="meta").num_parameters == PUBLISHED["llama-3-70b"]


def test_loaded_model_is_exported():
    assert LoadedModel.__module__ == "ampscope.models.base"


def test_every_catalog_entry_is_what_its_loader_builds():
    """`ampscope models` reads catalog.MODELS instead of building every model (no torch import):
    each entry's family and count must be what building the model on the meta device gives, in
    the same order, and a built-in GPT's description names the shape it is built with."""
    from ampscope.models import catalog

    computed = [registry._model_info(name) for name in registry.model_names()]
    assert [e.info for e in catalog.MODELS] == computed
    for e in catalog.MODELS:
        if e.family in ("gpt2", "nanochat"):
            config = resolve(e.name, device="meta").module.config
            assert e.description.endswith(f", {config.n_layer} layers × {config.n_embd}")
    # Every Hugging Face model is built by transformers; the zoo needs nothing else.
    assert all("transformers" in e.requires for e in catalog.MODELS if e.family == "hf")
    assert {e.name for e in catalog.MODELS if e.requires == ("transformers",)} == set(hf.ZOO)


def test_the_listing_drops_a_model_whose_packages_are_missing(monkeypatch):
    from ampscope.models import catalog

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    listed = {info.name for info in catalog.catalog().models}
    assert listed == {"gpt2", "gpt2-medium", "gpt2-tiny", "nanochat-d4", "nanochat-d20",
                      "nanochat-tiny"}
    assert listed == {info.name for info in list_models()}
