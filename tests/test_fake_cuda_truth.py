"""Emulated CUDA and MPS forward passes against the build's own AutocastCUDA/AutocastMPS kernels.

The ground truth is a run nobody on the team wrote: the model is built on `meta`, moved with
`to_empty(device="cuda")` inside a `FakeTensorMode`, and run with `torch.set_autocast_enabled`
and `torch.set_autocast_dtype` for that device, so every forward op passes PyTorch's own
Autocast<Device> kernels and its own device branches (C++ code that asks `is_cuda()`), while
tensors hold no memory. A TorchDispatchMode below autocast records each aten op with the dtypes
of its tensor arguments and results. The same model and batch then go through
`ampscope.trace(..., setting="cuda:...", predict=True)`, whose emulation runs on CPU tensors,
and the two op lists must be equal, op for op, except for the differences in `EXPLAINED`.

A CPU-only build has no device guard for CUDA or MPS, and without one indexing,
`.contiguous()`, `.expand()` and autocast's weight-cast cache fail on fake device tensors.
PyTorch ships a fake guard implementation (c10/core/impl/FakeGuardImpl.h) for tests; a few
lines of C++ compiled here with `torch.utils.cpp_extension.load_inline` register it for both
device types (the test skips when no compiler is found). What the ground truth cannot say:

- which SDPA kernel a GPU picks: that choice is made in CUDA code a CPU build lacks. On CUDA
  both runs use ampscope's H100 choice (`precision.attention_kernels.cuda_attention`, checked
  on its own in tests/test_attention.py), so the comparison covers the ops around it and its
  dtypes. On MPS, ampscope does not model the kernel choice (the trace says so): each SDPA call
  is compared as one entry, its output dtype, and the ground truth runs PyTorch's math path.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ampscope
from ampscope.models import registry
from ampscope.models.base import LoadedModel
from ampscope.precision import GlobalState, parse_setting
from ampscope.precision.apply import main_dtype
from ampscope.runtime.attention_kernels import cuda_attention

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(),
    reason="the fake device guard would replace the real device's guard",
)

_GUARD_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
C10_REGISTER_GUARD_IMPL(MPS, c10::impl::FakeGuardImpl<c10::DeviceType::MPS>);
"""


@pytest.fixture(scope="session")
def fake_device_guard(request, tmp_path_factory) -> None:
    """PyTorch's fake device guard registered for cuda and mps, built once into pytest's cache
    folder (rebuilt only when the source or the torch build changes; in a temporary folder when
    the cache is off)."""
    from torch.utils.cpp_extension import load_inline

    name = f"fake_device_guard-{torch.__version__}"
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    try:
        load_inline("ampscope_fake_device_guard", cpp_sources=[_GUARD_SOURCE], functions=[],
                    build_directory=str(folder))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: no ground truth here
        pytest.skip(f"cannot compile the fake device guard: {str(e).splitlines()[0]}")


# --- the models: every zoo model (smallest preset, or its config shrunk) and others ---------

SEQ = 8

# A zoo model's architecture with tiny sizes: heads and kv heads keep their ratio.
_SHRINK = dict(num_hidden_layers=2, vocab_size=128, bos_token_id=None, eos_token_id=None)


def _hf(config, device: str) -> LoadedModel:
    from ampscope.models.hf import build_from_config, hf_loaded_model

    torch.manual_seed(0)
    return hf_loaded_model(build_from_config(config, device=device), name=type(config).__name__)


def _zoo(name: str) -> Callable[[str, str], LoadedModel]:
    def build(device: str, target: str) -> LoadedModel:
        from ampscope.models.catalog import entry
        from ampscope.models.hf import dtype_kwargs, transformers_module

        fields = dict(entry(name).config)  # the zoo entry's config.json fields
        model_type = fields.pop("model_type")
        kwargs = {**fields, **_SHRINK}
        heads = kwargs.get("num_attention_heads", 12)
        sizes = dict(hidden_size=heads * 8, num_attention_heads=heads)
        if model_type == "gpt2":
            sizes = dict(n_embd=heads * 8, n_head=heads, n_layer=2)
        for key, value in (("head_dim", 8), ("intermediate_size", 32), ("ffn_dim", 32),
                           ("word_embed_proj_dim", heads * 8)):
            if key in kwargs:
                sizes[key] = value
        config = transformers_module().AutoConfig.for_model(
            model_type, **{**kwargs, **sizes}, attn_implementation="sdpa",
            **dtype_kwargs(torch.float32))
        return _hf(config, device)

    return build


def _other(config_class: str, **kwargs) -> Callable[[str, str], LoadedModel]:
    def build(device: str, target: str) -> LoadedModel:
        from ampscope.models.hf import dtype_kwargs, transformers_module

        cls = getattr(transformers_module(), config_class)
        return _hf(cls(**kwargs, attn_implementation="sdpa", **dtype_kwargs(torch.float32)),
                   device)

    return build


def _named(name: str) -> Callable[[str, str], LoadedModel]:
    return lambda device, target: registry.resolve(name, device=device, target_device=target)


_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             vocab_size=128, max_position_embeddings=64)
MODELS: dict[str, Callable] = {
    # built-in families: the tiny preset has every op of the bigger ones
    "gpt2-tiny": _named("gpt2-tiny"),
    "nanochat-tiny": _named("nanochat-tiny"),
    # every HF zoo entry, its own config with tiny sizes (smollm2-135m-real is smollm2-135m's
    # architecture with trained weights: weights change no dtype)
    **{name: _zoo(name) for name in ("opt-125m", "gpt2-hf", "llama-3.2-1b", "llama-3-8b",
                                     "llama-3-70b", "mistral-7b", "qwen2.5-0.5b",
                                     "smollm2-135m")},
    # architectures outside the zoo
    "falcon-mqa": _other("FalconConfig", hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                         vocab_size=128),
    "gpt-neox": _other("GPTNeoXConfig", **_TINY),
    "gemma": _other("GemmaConfig", **_TINY, num_key_value_heads=1, head_dim=8),
    "phi3": _other("Phi3Config", **_TINY, num_key_value_heads=2, pad_token_id=0),
    "gpt-bigcode-mqa": _other("GPTBigCodeConfig", n_embd=32, n_layer=2, n_head=4,
                              multi_query=True, vocab_size=128, n_positions=64),
}

SETTINGS = ("cuda:fp32+amp-bf16", "cuda:fp32+amp-fp16", "cuda:bf16", "cuda:bf16+amp-bf16",
            "mps:fp32+amp-bf16")


def _load(model: str, device: str, target: str) -> LoadedModel:
    """`model` built on `device` (meta, or cpu) for a run on `target` (cuda or mps)."""
    return MODELS[model](device, target)


# --- recording ---------------------------------------------------------------------------

OpFact = tuple[str, tuple[str, ...], tuple[str, ...]]  # op, in dtypes, out dtypes
SDPA = "scaled_dot_product_attention"
_TO_COPY = torch.ops.aten._to_copy.default


def _dtypes(values) -> tuple[str, ...]:
    return tuple(str(t.dtype).removeprefix("torch.") for t in tree_leaves(values)
                 if isinstance(t, torch.Tensor))


class _Ops(TorchDispatchMode):
    """Every aten op below autocast, with its dtypes; inside an SDPA call only the casts
    (`_SdpaAsOne` adds the call as one entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpFact] = []
        self.in_sdpa = False
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim" and not self.in_kernel and \
                (not self.in_sdpa or func is _TO_COPY):
            self.ops.append((str(func), _dtypes((args, kwargs)), _dtypes(out)))
        return out


class _SdpaAsOne(TorchFunctionMode):
    def __init__(self, ops: _Ops) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != SDPA:
            return func(*args, **(kwargs or {}))
        self.ops.in_sdpa = True
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.ops.in_sdpa = False
        self.ops.ops.append((SDPA, (), _dtypes(out)))
        return out


@contextlib.contextmanager
def _mps_math_attention(ops: _Ops):
    """What SDPA runs on fake mps tensors here: the math path, below AutocastMPS (a CPU build
    has no MPS kernel choice: the composite asks for one and fails). Its ops are not recorded:
    only the casts AutocastMPS made before it."""

    def math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        ops.in_kernel = True
        try:
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale,
                enable_gqa=enable_gqa)[0]
        finally:
            ops.in_kernel = False

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("scaled_dot_product_attention", math, "AutogradMPS")
        yield
    finally:
        lib._destroy()


def ground_truth(model: str, setting: str) -> list[OpFact]:
    """The forward ops of the build's own autocast kernels on fake device tensors."""
    parsed = parse_setting(setting)
    device = parsed.device
    lm = _load(model, "meta", device)
    batch = lm.make_batch(1, SEQ, "forward", torch.Generator().manual_seed(0))
    if main_dtype(lm.module) != parsed.param_dtype:  # as a setting converts: model.to(dtype)
        lm.module.to(parsed.param_dtype)
    state = GlobalState.save()
    ops = _Ops()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), \
                (cuda_attention() if device == "cuda" else _mps_math_attention(ops)):
            lm.module.to_empty(device=device).eval()
            data = {k: v.to(device) for k, v in batch.items()}
            if parsed.autocast_dtype is not None:
                torch.set_autocast_enabled(device, True)
                torch.set_autocast_dtype(device, parsed.autocast_dtype)
            with torch.no_grad(), (_SdpaAsOne(ops) if device == "mps"
                                   else contextlib.nullcontext()), ops:
                lm.logits(data)
    finally:
        state.restore()
    return ops.ops


def emulated(model: str, setting: str) -> list[OpFact]:
    """The forward ops of ampscope's emulated trace of the same model and batch."""
    device = parse_setting(setting).device
    t = ampscope.trace(_load(model, "cpu", device), setting=setting, workload="forward", seq=SEQ,
                       predict=True)
    facts: list[OpFact] = []
    sdpa_call = None
    for o in t.ops:
        if o.phase != "forward":
            continue
        call = t.calls[o.caller] if o.caller is not None else None
        if device == "mps" and call is not None and call.func.endswith(SDPA) \
                and not o.autocast_cast:
            if sdpa_call != o.caller:  # the call's kernels as one entry, after its casts
                facts.append((SDPA, (), tuple(m.dtype for m in call.outputs)))
                sdpa_call = o.caller
            continue
        facts.append((o.op, tuple(m.dtype for m in o.inputs), tuple(m.dtype for m in o.outputs)))
    return facts


# --- what may differ, and why ---------------------------------------------------------------

# Differences the emulation on CPU tensors cannot follow, each a copy that changes no dtype:
# name -> (devices, ops the device runs, ops the emulation runs, why).
EXPLAINED: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]] = {
    "index-tensor-copy": (
        ("cuda", "mps"), ("aten._to_copy.default",), (),
        "indexing with a Python int or list (Falcon's `fused_qkv[..., [0]]`) makes the index "
        "tensor on the CPU; the device copies it over, the CPU has nothing to copy"),
    "mps-attention-layout": (
        ("mps",), ("aten.clone.default",), (),
        "ampscope does not model MPS's attention kernel: the CPU kernel it runs returns its "
        "output laid out so that the model's `.transpose(1, 2).contiguous()` copies nothing, "
        "where the math path the ground truth runs returns one it must copy"),
}


def _explained(device: str, truth: list[OpFact], ours: list[OpFact]) -> str | None:
    """The EXPLAINED entry a differing stretch is, if any: a same-dtype copy only one side ran."""
    for name, (devices, on_device, emulated, _) in EXPLAINED.items():
        if device in devices and tuple(o[0] for o in truth) == on_device \
                and tuple(o[0] for o in ours) == emulated \
                and all(o[1] == o[2] for o in (*truth, *ours)):
            return name
    return None


def _differences(truth: list[OpFact], ours: list[OpFact]) -> list[tuple[list, list]]:
    matcher = difflib.SequenceMatcher(a=truth, b=ours, autojunk=False)
    return [(truth[i1:i2], ours[j1:j2])
            for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def agreement(model: str, setting: str) -> tuple[int, int, dict[str, int], list, list[OpFact]]:
    """(ops agreeing, ops in the ground truth, explained differences by name, the rest, the
    ground truth)."""
    truth, ours = ground_truth(model, setting), emulated(model, setting)
    device = setting.split(":")[0]
    explained: dict[str, int] = {}
    unexplained = []
    differing = 0
    for a, b in _differences(truth, ours):
        differing += max(len(a), len(b))
        name = _explained(device, a, b)
        if name is None:
            unexplained.append((a, b))
        else:
            explained[name] = explained.get(name, 0) + 1
    return len(truth) - differing, len(truth), explained, unexplained, truth


@pytest.mark.parametrize(("model", "setting"), [(m, s) for m in MODELS for s in SETTINGS])
def test_emulated_forward_agrees_with_the_builds_own_device_kernels(fake_device_guard, model,
                                                                   setting):
    agreeing, total, explained, unexplained, truth = agreement(model, setting)
    print(f"{model} {setting}: {agreeing}/{total} ops agree; explained: {explained or 'none'}")
    assert total > 20  # the model really ran
    autocast = parse_setting(setting).autocast_dtype
    if autocast is not None:  # ... through the device's autocast kernels: matmuls in its dtype
        low = str(autocast).removeprefix("torch.")
        assert any(op in _MATMULS and outs[0] == low for op, _, outs in truth)
    assert not unexplained, "\n".join(f"truth {a}\n  emulated {b}" for a, b in unexplained[:3])
