"""The op-level trace agrees with PyTorch's own `DebugMode`, op for op.

Each case runs one workload twice on the same model and batch: once under
`torch.utils._debug_mode.DebugMode` (default options, inside `applied(setting, module)` and
`workloads.run`, as `ampscope.trace` runs it) and once through `ampscope.trace`. Both see the
aten ops below autocast and autograd, so both must list the same ops in the same order with the
same dtypes (and shapes) of tensor arguments and results.

DebugMode deliberately leaves out two kinds of op that do reach it, and so does ampscope; the
test checks that what DebugMode skipped is exactly these (see `_DebugModeSeeingSkips`). ampscope
also leaves out the `aten.detach.default` calls DebugMode does record (AccumulateGrad's, and
`loss.detach()`): a detach changes no dtype, and in predict mode (fake tensors) every detach
reaches the mode like case 1, so recording any would make real and predicted traces differ.

1. `aten.detach.default` dispatched with `types == (torch.Tensor,)`. Whenever *any*
   TorchDispatchMode is active, `TensorImpl::shallow_copy_and_detach_core`
   (c10/core/TensorImpl.cpp), which autograd's `SavedVariable` uses to save an op's own output
   for backward (`tensor_data()`) and to unpack it again, calls the mode's Python interpreter's
   `detach` instead of copying in C++; that dispatches `aten.detach` to the mode with a plain
   `torch.Tensor` among the overloaded types. Without a mode these detaches do not run at all.
   DebugMode records a real-tensor op only when `types` is empty (`elif len(types) == 0:` in
   `torch/utils/_debug_mode/_mode.py`), so it drops them, and so does ampscope (they would not
   run in the user's unobserved step). They occur after SDPA and log_softmax (outputs saved for
   backward) and in backward where those are unpacked.
2. The `torch.autograd.profiler.record_function` range that `Optimizer.step` opens. DebugMode
   turns `profiler._record_function_enter_new` into a "[record function] NAME" annotation and
   drops the matching `profiler._record_function_exit`; ampscope records neither (a profiler
   range is no computation).

DebugMode's API is private and changes between releases; this file pins what torch 2.13 does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import ampscope
from ampscope import workloads
from ampscope.models import gpt2, nanochat
from ampscope.precision import applied, parse_setting

# DebugMode is private and moves between releases (torch 2.11 on the GPU machine): skip there
# rather than fail at import.
DebugMode = pytest.importorskip("torch.utils._debug_mode").DebugMode
_calls = pytest.importorskip("torch.utils._debug_mode._calls")
_AnnotateCall, _OpCall = _calls._AnnotateCall, _calls._OpCall

MODELS = {"gpt2-tiny": gpt2, "nanochat-tiny": nanochat}
BATCH, SEQ = 2, 16
RECORD_FUNCTION_EXIT = str(torch.ops.profiler._record_function_exit._RecordFunction)
DETACH = str(torch.ops.aten.detach.default)

# One entry per op: (op name, in dtypes, in shapes, out dtypes, out shapes).
OpFact = tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...], tuple[str, ...],
               tuple[tuple[int, ...], ...]]


def _tensors(values) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _fact(op: str, args, kwargs, result) -> OpFact:
    ins, outs = _tensors((args, kwargs)), _tensors(result)
    return (op, tuple(_dtype(t) for t in ins), tuple(tuple(t.shape) for t in ins),
            tuple(_dtype(t) for t in outs), tuple(tuple(t.shape) for t in outs))


def _dtypes_hook(func, types, args, kwargs, result) -> dict:
    """A DebugMode record hook: with default options DebugMode keeps only the rendered strings
    of the arguments, so the dtypes and shapes are taken here, as each op returns."""
    return {"fact": _fact(str(func), args, kwargs, result)}


class _DebugModeSeeingSkips(DebugMode):
    """DebugMode with its default options that also notes every op it receives but does not
    record, and where in `operators` it would have gone. It changes nothing DebugMode does."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[tuple[int, OpFact, tuple[type, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        position = len(self.operators)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.operators) == position:
            self.skipped.append((position, _fact(str(func), args, kwargs or {}, out), types))
        return out


def _debugmode_view(mode: _DebugModeSeeingSkips) -> list[OpFact]:
    """The ops DebugMode recorded, in order (its record-function annotation is no op), less the
    detaches ampscope leaves out (module docstring)."""
    facts: list[OpFact] = []
    for call in mode.operators:
        if isinstance(call, _OpCall):
            if call.record["fact"][0] != DETACH:
                facts.append(call.record["fact"])
        else:
            # Case 2 of the module docstring: the annotation stands where the enter op ran.
            assert isinstance(call, _AnnotateCall) and call.header == "record function", call
    return facts


def _ampscope_view(trace) -> list[OpFact]:
    return [
        (o.op, tuple(m.dtype for m in o.inputs), tuple(m.shape for m in o.inputs),
         tuple(m.dtype for m in o.outputs), tuple(m.shape for m in o.outputs))
        for o in trace.ops
    ]


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(name: str):
        if name not in cache:
            with torch.random.fork_rng():  # seeded weights, the session's RNG untouched
                torch.manual_seed(0)
                cache[name] = MODELS[name].load(name)
        return cache[name]

    return get


CASES = [
    (model, setting, "train")
    for model in MODELS
    for setting in ("fp32", "bf16", "fp32+amp-bf16")
] + [
    # fp16 autocast (with a GradScaler) on one model only: fp16 matmuls are slow on CPUs.
    ("gpt2-tiny", "fp32+amp-fp16", "train"),
] + [
    (model, setting, workload)
    for model in MODELS
    for setting in ("fp32", "fp32+amp-bf16")
    for workload in ("forward", "generate")
]


@pytest.mark.parametrize(("model", "setting", "workload"), CASES)
def test_ops_agree_with_debugmode(loaded, model, setting, workload):
    lm = loaded(model)
    parsed = parse_setting(setting)
    batch = lm.make_batch(BATCH, SEQ, workload, generator=torch.Generator().manual_seed(0))

    with applied(parsed, lm.module), DebugMode.dispatch_hooks(record_hook=_dtypes_hook), \
            _DebugModeSeeingSkips() as mode:
        workloads.run(lm, batch, parsed, workloads.RunOptions(workload))
    trace = ampscope.trace(lm, batch, setting=setting, workload=workload, predict=False)

    # What DebugMode skipped is exactly the two kinds the module docstring explains.
    for _, (op, *_), types in mode.skipped:
        if op == DETACH:
            assert types == (torch.Tensor,), types
        else:
            assert op == RECORD_FUNCTION_EXIT, f"DebugMode skipped an unexpected op {op}"
    if workload == "train":
        assert any(op == DETACH for _, (op, *_), _ in mode.skipped)
        assert sum(isinstance(c, _AnnotateCall) for c in mode.operators) == 1  # Optimizer.step
    else:
        assert not mode.skipped  # no grad: nothing saved for backward, no optimizer

    expected, got = _debugmode_view(mode), _ampscope_view(trace)
    assert got == expected, _first_difference(got, expected)


def _first_difference(got: list[OpFact], expected: list[OpFact]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
             min(len(got), len(expected)))
    return (f"ampscope has {len(got)} ops, DebugMode {len(expected)}; first difference at op {i}:"
            f"\n  ampscope:  {got[i:i + 2]}\n  DebugMode: {expected[i:i + 2]}")
