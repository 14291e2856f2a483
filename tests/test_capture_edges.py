"""Capture details that are easy to get wrong: attribution at module and phase boundaries,
keyword inputs, sources, and leaving a Hugging Face model exactly as it was."""

from __future__ import annotations

import pytest
import torch

import ampscope
from ampscope.cli import one_line
from ampscope.records import Trace


def test_backward_ops_belong_to_the_innermost_module(gpt2_tiny):
    """mlp returns c_proj's output unchanged: c_proj's backward matmuls are c_proj's, not mlp's."""
    t = ampscope.trace(gpt2_tiny, setting="fp32", workload="train", seq=8)
    backward_mm = {(o.module, o.grad_fn) for o in t.ops
                   if o.phase == "backward" and o.op == "aten.mm.default"}
    assert ("transformer.h.0.mlp.c_proj", "AddmmBackward0") in backward_mm
    assert not any(m.endswith((".mlp", ".attn")) for m, _ in backward_mm)


def test_loss_backward_and_its_seed_are_backward(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="fp32", workload="train", seq=8)
    assert [c.phase for c in t.calls if c.func == "Tensor.backward"] == ["backward"]
    seed = next(o for o in t.ops if o.op == "aten.ones_like.default")
    assert seed.phase == "backward"


def test_ops_outside_modules_have_no_module_and_no_user_source(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="fp32", workload="train", seq=8)
    optimizer_ops = [o for o in t.ops if o.phase == "optimizer"]
    assert optimizer_ops and {o.module for o in optimizer_ops} == {None}
    # the workload's own optimizer.step() is ampscope's line, not the user's
    assert {o.source for o in optimizer_ops} == {None}
    assert next(o for o in t.ops if o.phase == "forward").module == ""  # the model itself


@pytest.mark.fast
def test_capture_names_the_users_lines_and_the_setting_it_saw():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with ampscope.capture(model) as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()
        opt.step()  # the line the optimizer ops must point at
    step_sources = {o.source for o in t.ops if o.phase == "optimizer"}
    assert len(step_sources) == 1 and step_sources.pop().startswith("test_capture_edges.py:")
    assert t.setting.to_dict() == {"name": "as-run", "device": "cpu", "emulated": False,
                         "param_dtype": "float32", "autocast_dtype": "bfloat16",
                         "matmul_precision": "highest",
                         "torch": torch.__version__, "fp8": None,
                         "fsdp_param_dtype": None, "fsdp_reduce_dtype": None,
                         "gpu": None}  # a real device: no GPU stood for


@pytest.fixture
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_hf_modules_called_with_keywords_show_their_inputs(tiny_llama):
    t = ampscope.trace(tiny_llama, setting="fp32+amp-bf16", workload="train", seq=8)
    layers = [m for m in t.modules if m.type == "LlamaDecoderLayer" and m.phase == "forward"]
    assert len(layers) == 2
    assert all("float32" in [i.dtype for i in m.inputs] for m in layers)


def test_a_users_hf_model_is_left_untouched(tiny_llama):
    config_before = tiny_llama.config.to_dict()
    loss_type = getattr(tiny_llama, "loss_type", "absent")
    for workload in ("train", "forward", "generate"):
        ampscope.trace(tiny_llama, setting="fp32", workload=workload, seq=8, new_tokens=2)
    assert tiny_llama.config.to_dict() == config_before
    assert getattr(tiny_llama, "loss_type", "absent") == loss_type


def test_a_core_only_document_reads_back():
    """A document with only the core fields of docs/json-schema.md reads back."""
    core = {
        "schema": "ampscope.trace/1",
        "model": {"name": "gpt2", "class": "GPT", "parameters": 124439808},
        "setting": {"name": "fp32+amp-bf16", "device": "cpu"},
        "workload": "train",
        "modules": [{"name": "transformer.h.0.attn.c_attn", "type": "Linear",
                     "phase": "forward", "in": ["float32"], "out": ["bfloat16"]}],
        "ops": [{"op": "aten.addmm.default", "module": "transformer.h.0.attn.c_attn",
                 "phase": "forward", "in": ["bfloat16", "bfloat16", "bfloat16"],
                 "out": ["bfloat16"], "autocast_cast": False, "source": "model.py:61"}],
        "tensors": {
            "parameters": [{"name": "transformer.wte.weight", "dtype": "float32",
                            "shape": [50257, 768], "grad_dtype": "float32"}],
            "buffers": [{"name": "cos", "dtype": "bfloat16", "shape": [1, 2048, 1, 32]}],
            "optimizer_state": [{"param": "transformer.wte.weight", "key": "exp_avg",
                                 "dtype": "float32"}],
            "inputs": [{"name": "idx", "dtype": "int64", "shape": [1, 256]}],
        },
        "findings": [{"text": "Logits are cast to float32 before cross_entropy.",
                      "cause": "explicit-cast", "source": "model.py:245"}],
    }
    t = Trace.from_dict(core)
    assert t.ops[0].source == "model.py:61" and t.parameters[0].grad_dtype == "float32"
    assert t.modules[0].outputs[0].dtype == "bfloat16"


def test_error_lines_are_one_readable_line():
    assert one_line("\x1b[1mWeights only load failed\x1b[0m\nmore") == "Weights only load failed"
    long = one_line("x" * 5000)
    assert len(long) == 1000 and long.endswith("…")


class Flaky(torch.nn.Module):
    """Raises on its first call only."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("first call fails")
        return self.fc(x)


def test_a_module_that_raises_inside_caught_user_code_keeps_tracking_right():
    import contextlib
    import warnings

    model = torch.nn.Sequential(Flaky(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught, ampscope.capture(model) as t:
        warnings.simplefilter("always")
        with contextlib.suppress(ValueError):  # user code that catches the model's error
            model(x)
        model(x)
    assert not [w for w in caught if "hook" in str(w.message).lower()]
    # the failed call is closed; the second call's modules nest under a fresh root call
    names = [(m.name, m.depth) for m in t.modules]
    assert names == [("", 0), ("0", 1), ("", 0), ("0", 1), ("0.fc", 2), ("1", 1)]
    addmm = [o.module for o in t.ops if o.op == "aten.addmm.default"]
    assert addmm == ["0.fc", "1"]


@pytest.mark.fast
def test_ops_are_aten_ops_only(gpt2_tiny):
    """The optimizer's profiler range is no computation and is not listed."""
    t = ampscope.trace(gpt2_tiny, setting="fp32", workload="train", seq=8)
    assert {o.op.split(".")[0] for o in t.ops} == {"aten"}


def test_state_held_outside_parameters_and_buffers_is_in_the_inventory():
    """A plain tensor attribute set in forward (running statistics kept by hand) and a cache
    object passed to the model: each tensor recorded once, with its dtype and final shape; the
    model's own parameters (also reachable through the cache) are not repeated."""
    import ampscope

    class Cache:
        def __init__(self):
            self.keys: list[torch.Tensor] = []
            self.weight_ref = None

    class Held(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, cache):
            y = self.proj(x)
            self.running = y.detach().mean(0).to(torch.float64)  # a plain attribute
            cache.keys.append(y.detach().to(torch.bfloat16))
            cache.weight_ref = self.proj.weight  # a parameter: not held state
            return y

    cache = Cache()

    def step(model, batch):
        for _ in range(2):
            model(batch["x"], cache)

    t = ampscope.trace(Held(), {"x": torch.randn(3, 8)}, workload=step)
    held = {h.name: (h.where, h.dtype, h.shape) for h in t.held}
    assert held == {"running": ("attribute", "float64", (8,)),
                    "cache.keys[0]": ("argument", "bfloat16", (3, 8)),
                    "cache.keys[1]": ("argument", "bfloat16", (3, 8))}
    text = next(f.text for f in t.findings if "outside its parameters" in f.text)
    assert "cache: 2 bfloat16 tensors" in text and "running: 1 float64 tensor" in text
    back = ampscope.Trace.from_dict(t.to_dict())
    assert back.held == t.held


def test_held_state_behind_a_shared_object_is_found_from_any_module():
    """An object several modules hold (a config, a shared cache) is looked into once for the
    whole model, yet a tensor it holds deeper than one module's path reaches is still found
    from another module whose path reaches it: the walk remembers the depth it had left."""
    from ampscope.runs.inventory import _DEPTH, held_state

    class Box:
        def __init__(self, inner):
            self.inner = inner

    deep = torch.zeros(2, dtype=torch.float16)
    shared = Box(Box(deep))  # the tensor is two levels inside
    nested = shared
    for _ in range(_DEPTH - 1):  # reached from here with one level left: the tensor is too deep
        nested = Box(nested)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first.far = nested  # reaches `shared` with too little depth left to see the tensor
    second.near = shared  # reaches it with enough
    model = torch.nn.Sequential(first, second)
    assert [(h.name, h.dtype) for h in held_state(model, {})] == [("1.near.inner.inner",
                                                                    "float16")]


def test_a_transformers_kv_cache_has_the_dtype_and_length_of_the_run():
    """Ground truth: the cache transformers itself returns from the same model's forward."""
    transformers = pytest.importorskip("transformers")
    import ampscope

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(1, 6, dtype=torch.long)
    with torch.no_grad():
        truth = model(ids, use_cache=True).past_key_values
    expected = {(f"layers[{i}].{kind}", str(getattr(layer, kind).dtype).removeprefix("torch."),
                 tuple(getattr(layer, kind).shape))
                for i, layer in enumerate(truth.layers) for kind in ("keys", "values")}

    def step(m, batch):
        return m(batch["input_ids"], use_cache=True, past_key_values=transformers.DynamicCache(
            config=config))

    t = ampscope.trace(model, {"input_ids": ids}, setting="native", workload=step)
    got = {(h.name.removeprefix("past_key_values."), h.dtype, h.shape) for h in t.held}
    assert got == expected and len(got) == 4
