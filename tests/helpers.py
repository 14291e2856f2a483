"""What several test files share: hand-built records and the golden-file check.

Fixtures that build models live in conftest.py; this module holds plain helpers, imported as
`from tests.helpers import ...`.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

import torch

import ampscope
from ampscope import patches
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.analysis.numerics import (
    BlockDivergence,
    Divergence,
    ModuleDivergence,
    NumericsReport,
    SettingNumerics,
    TensorRange,
    tensor_range,
)
from ampscope.api import tokens_of
from ampscope.records import ModuleCall, SettingRecord, TensorMeta
from ampscope.render.html import report_html

GOLDEN = Path(__file__).parent / "golden"

F32, BF16, I64 = TensorMeta("float32", (2, 4)), TensorMeta("bfloat16", (2, 4)), TensorMeta("int64", (2,))


def call(i, name, type_, depth, ins, outs, phase="forward"):
    return ModuleCall(i, name, type_, phase, depth, ins, outs)


def blocks(n, odd=None, order=None):
    """Calls of a model with n blocks h.i (each: Block > fc); block `odd` runs fc in fp32."""
    calls = [call(0, "", "Net", 0, (I64,), (F32,))]
    for i in order or range(n):
        out = F32 if i == odd else BF16
        calls.append(call(len(calls), f"h.{i}", "Block", 1, (F32,), (out,)))
        calls.append(call(len(calls), f"h.{i}.fc", "Linear", 2, (F32,), (out,)))
    calls.append(call(len(calls), "head", "Linear", 1, (F32,), (BF16,)))
    return calls



def setting_record(name: str = "fp32", *, device: str = "cpu", emulated: bool = False,
                   param_dtype: str | None = "float32", autocast_dtype: str | None = None,
                   matmul_precision: str = "highest") -> SettingRecord:
    """A setting as a trace records it, for hand-built traces."""
    return SettingRecord(name, device, emulated, param_dtype, autocast_dtype, matmul_precision)


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("AMPSCOPE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


# --- the HTML report (tests/test_report.py, tests/test_report_browser.py) ---------------

SETTINGS = ["fp32", "fp32+amp-bf16"]


def divergence(x: float) -> Divergence:
    return Divergence(rel_l2=x, max_abs=x, cosine=1 - x, sqnr_db=-20 * math.log10(x))


def hand_numerics() -> NumericsReport:
    """A numerics report built by hand: two settings, two blocks (no model run)."""
    settings = [
        SettingNumerics(name, [ModuleDivergence("", "GPT", 1, divergence(3 * e))],
                        [BlockDivergence("transformer.h", i, divergence(e * (i + 1)))
                         for i in range(2)], divergence(e / 10), [])
        for name, e in (("fp32+amp-bf16", 2e-3), ("bf16", 4e-3))
    ]
    ranges: list[TensorRange] = [
        tensor_range("activation", "transformer.h.1", torch.tensor([1e5, 1.0])),
        tensor_range("gradient", "lm_head.weight", torch.tensor([1e-9, 1e-3])),
    ]
    return NumericsReport("gpt2-tiny", "train", "fp64", settings, ranges)


def gpt2_tiny_report() -> dict:
    """gpt2-tiny's train step under fp32 and fp32+amp-bf16 (8 tokens), its reports, and the
    page with every section (what `ampscope report gpt2-tiny` computes, plus numerics)."""
    matrix, traces = ampscope.matrix("gpt2-tiny", settings=SETTINGS, seq=8)
    flops = [flop_report(t, tokens=tokens_of(t)) for t in traces]
    memory = [memory_report(t) for t in traces]
    numerics = hand_numerics()
    html = report_html(traces, matrix, reports=[*memory, *flops, numerics])
    return {"matrix": matrix, "traces": traces, "flops": flops, "memory": memory,
            "numerics": numerics, "html": html}


# --- torch's global state, all of it (tests/test_state.py) ------------------------------

import sys  # noqa: E402  (the section's own imports, kept with it)

AUTOCAST_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu", "xla", "ipu", "mtia", "privateuseone")
# Every backend and op that has a new-API `fp32_precision`, parents before children.
FP32_PRECISION_PATHS = ("", "cuda", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn",
                        "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _attr(path: str):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj


def _read(getter):
    """A legacy TF32 getter raises once the new API was used ("mix of the legacy and new
    APIs"): that answer is part of the state, and reading changes nothing."""
    try:
        return getter()
    except RuntimeError as e:
        return f"raises: {str(e).split(',')[0]}"


def _optional(obj, name: str, *args):
    fn = getattr(obj, name, None)
    return fn(*args) if callable(fn) else "absent in this build"


def _hook_dicts(module) -> dict[str, object]:
    """Every `_global_*` of a module: hook dicts by key and hook identity, flags by value."""
    found = {}
    for name, value in vars(module).items():
        if name.startswith("_global_"):
            found[name] = ({k: id(v) for k, v in value.items()} if isinstance(value, dict)
                           else value)
    return found


def _foreach_types() -> tuple[list, list]:
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.tensor")  # registers DTensor, once
    from torch.optim import optimizer as optim_module
    from torch.utils import _foreach_utils

    return (list(optim_module._foreach_supported_types),
            list(_foreach_utils._foreach_supported_types))


def torch_state() -> dict[str, object]:
    """All of torch's process-global state a run could touch, as plain comparable values.

    Legacy matmul-precision getters are read through `_read` (they raise rather than answer
    once the new per-backend API was used); the new API is read per backend and op, which
    never raises and never marks either API as used."""
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    autocast = {}
    for device in AUTOCAST_DEVICES:
        try:
            autocast[device] = (torch.is_autocast_enabled(device),
                                torch.get_autocast_dtype(device))
        except RuntimeError:  # not a device type this build knows
            continue
    cuda = torch.backends.cuda
    state: dict[str, object] = {
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "forward_grad": torch._C._is_fwd_grad_enabled(),
        "autocast": autocast,
        "autocast_cache": torch.is_autocast_cache_enabled(),
        "fp32_precision": {path: _attr(path).fp32_precision for path in FP32_PRECISION_PATHS
                           if hasattr(_attr(path), "fp32_precision")},
        "legacy_matmul": {
            "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
            "cuda.matmul.allow_tf32": _read(lambda: cuda.matmul.allow_tf32),
            "cudnn.allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
            "allow_fp16_reduced": _read(
                lambda: cuda.matmul.allow_fp16_reduced_precision_reduction),
            "allow_bf16_reduced": _read(
                lambda: cuda.matmul.allow_bf16_reduced_precision_reduction),
        },
        "default_dtype": torch.get_default_dtype(),
        "default_device": str(torch.get_default_device()),
        "num_threads": torch.get_num_threads(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(),
                          torch.get_deterministic_debug_mode(),
                          torch.utils.deterministic.fill_uninitialized_memory),
        "warn_always": torch.is_warn_always_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "rng_cpu": bytes(torch.get_rng_state().numpy()),
        "rng_cuda": ([bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
                     if torch.cuda.is_available() and torch.cuda.is_initialized() else None),
        "module_hooks": _hook_dicts(nn_module),
        "optimizer_hooks": _hook_dicts(optim_module),
        # The tensor classes PyTorch's foreach defaults accept (a predicted run adds fake ones
        # for its duration; importing torch.distributed.tensor adds DTensor for good).
        "foreach_types": _foreach_types(),
        "parameter_new": torch.nn.Parameter.__dict__.get("__new__"),
        "backends": {
            "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                      torch.backends.cudnn.deterministic,
                      getattr(torch.backends.cudnn, "benchmark_limit", None)),
            "mkldnn": torch.backends.mkldnn.enabled,
            "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
            "sdp": (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                    cuda.math_sdp_enabled(), _optional(cuda, "cudnn_sdp_enabled"),
                    _optional(cuda, "fp16_bf16_reduction_math_sdp_allowed")),
            "linalg": str(cuda.preferred_linalg_library()),
            "blas": str(_optional(cuda, "preferred_blas_library")),
            "opt_einsum": (torch.backends.opt_einsum.enabled,
                           torch.backends.opt_einsum.strategy),
        },
        "mode_stacks": (torch._C._len_torch_function_stack(),
                        torch._C._len_torch_dispatch_stack()),
        "dispatch_tls": (str(torch._C._dispatch_tls_local_include_set()),
                         str(torch._C._dispatch_tls_local_exclude_set())),
        "saved_tensors_hooks": _optional(torch._C._autograd, "_top_saved_tensors_default_hooks",
                                         False),
        "autograd_multithreading": torch._C._is_multithreading_enabled(),
        "view_replay": torch._C._is_view_replay_enabled(),
        "argv": list(sys.argv),
        "path": list(sys.path),
        "cwd": os.getcwd(),
        # Every attribute ampscope replaces goes through ampscope.patches: none in force, and
        # every one it ever replaced is back as it was (torch.cuda.*, Module.__init__,
        # swap_tensors, inference_mode, a block's forward, torch.save, open, atexit, os._exit).
        "patches_active": [repr(p) for p in patches.active()],
        "patches_not_restored": patches.changed(),
        "tensor_device": torch.Tensor.__dict__.get("device"),
        "module_init": torch.nn.Module.__dict__.get("__init__"),
        "swap_tensors": torch.utils.swap_tensors,
        "inference_mode_class": (torch.autograd.grad_mode.inference_mode.__dict__.get("__enter__"),
                                 torch.autograd.grad_mode.inference_mode.__dict__.get("__exit__")),
        "torch_save": torch.save,
        "cuda_api": {name: getattr(torch.cuda, name, None)
                     for name in ("is_available", "device_count", "is_initialized", "init",
                                  "synchronize", "empty_cache", "get_device_name",
                                  "get_device_properties", "memory_allocated",
                                  "max_memory_allocated", "is_bf16_supported")},
    }
    return state


def state_differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """What changed between two `torch_state()`s, one line per entry (empty: nothing)."""
    return [f"{key}: {before[key]!r} -> {after.get(key)!r}"
            for key in before if before[key] != after.get(key)]


REPLAY_NOTE = "calls of identical blocks were not dispatched"


def assert_same_trace(quick, full) -> None:
    """A trace made with a shortcut (replayed blocks, thinned foreach ops) equals the trace made
    without it: every field of its JSON document but the replay note, and the memory peak."""
    from ampscope.analysis.memory import memory_report

    a, b = quick.to_dict(), full.to_dict()
    a["notes"] = [n for n in a["notes"] if REPLAY_NOTE not in n]
    for key in a:  # one key at a time: a failure names what differs
        assert a[key] == b[key], key
    assert memory_report(quick).peak == memory_report(full).peak


def modules_after(imports: str, *prefixes: str) -> list[str]:
    """The modules named `prefix` or under it that a fresh interpreter holds after running
    `imports` (what an import drags in, seen from outside this test process)."""
    import ast
    import subprocess
    import sys

    code = (f"import sys\n{imports}\nprefixes = {prefixes!r}\n"
            "print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') "
            "for p in prefixes)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    return ast.literal_eval(result.stdout.strip())


def generated_texts(count: int, *, words: int = 400, longest: int = 400) -> list[str]:
    """`count` texts of words made of random letters (seeded): local training data for a
    framework's own entry point, nothing downloaded."""
    import random

    rng = random.Random(0)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                          for _ in range(rng.randint(2, 8))) for _ in range(words)]
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(50, longest)))
            for _ in range(count)]


def save_bpe_tokenizer(folder: Path, texts: list[str], *, vocab_size: int,
                       special_tokens: list[str], config: dict) -> None:
    """A byte-level BPE trained on `texts`, saved as a Hugging Face tokenizer folder
    (tokenizer.json, and `config` as tokenizer_config.json)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


# A nanoGPT-style language model's source over blocks a test defines (width 64, a vocabulary
# of 256): `Model(blocks)`, for a `module:factory` model the test writes to a file.
LM_SOURCE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Config:
    vocab_size = 256
    block_size = 64


class Model(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.config = Config()
        self.wte = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(64, 256, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
'''
