"""Fake foreach ops run over one list entry of each kind (runs/foreach.py): the results
equal those of the fake kernel run over every entry — the ground truth, which the thinned call
never consults — and a predicted step that thins its optimizer's ops records exactly what the
step that runs them whole records."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ampscope
from ampscope.runs import foreach
from tests.helpers import assert_same_trace


def _described(t: torch.Tensor) -> tuple:
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device,
            t.untyped_storage().nbytes())


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _params(n_layers: int = 6) -> list[torch.Tensor]:
    """An optimizer's list: per layer a weight, a transposed-stride weight and a bias, then a
    head of its own."""
    out = []
    for _ in range(n_layers):
        out += [torch.empty(8, 4), torch.empty(4, 8).t(), torch.empty(8)]
    return [*out, torch.empty(3, 5, dtype=torch.bfloat16)]


@pytest.mark.fast
def test_out_of_place_results_equal_the_full_kernels(fake):
    xs = _params()
    thinned = foreach.thinned_call(torch.ops.aten._foreach_sqrt.default, (xs,), {})
    full = torch.ops.aten._foreach_sqrt.default(xs)
    assert thinned is not foreach.NOT_THINNED
    assert [_described(t) for t in thinned] == [_described(t) for t in full]
    # Every result is a tensor of its own, as the kernel's are: none shares a storage.
    storages = {id(t.untyped_storage()) for t in thinned}
    assert len(storages) == len(xs)


@pytest.mark.fast
def test_per_entry_numbers_and_aliased_entries_are_part_of_the_kind(fake):
    xs, gs = _params(), _params()
    steps = [0.1] * 9 + [0.2] * 10  # the same tensors, other numbers: other kinds
    out = foreach.thinned_call(torch.ops.aten._foreach_addcdiv.ScalarList, (xs, gs, gs, steps), {})
    full = torch.ops.aten._foreach_addcdiv.ScalarList(xs, gs, gs, steps)
    assert out is not foreach.NOT_THINNED
    assert [_described(t) for t in out] == [_described(t) for t in full]
    kept, twin = foreach._kinds([xs, gs, gs, steps], len(xs), in_place=False)
    assert len(kept) == 3 * 2 + 1  # three tensor kinds in each number's half, and the head
    assert all(steps[i] == steps[twin[i]] for i in twin)


def test_in_place_ops_run_on_one_entry_of_each_kind(fake):
    xs = _params()
    ran = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(len(args[0]))
            return func(*args, **(kwargs or {}))

    with Seen():
        assert foreach.thinned_call(torch.ops.aten._foreach_mul_.Scalar, (xs, 0.9), {}) is None
    assert ran == [4]  # not 19


@pytest.mark.fast
def test_what_cannot_be_thinned_runs_as_usual(fake):
    xs = _params()
    # Per-entry values packed in one tensor: entries cannot be dropped from it.
    scalars = torch.empty(len(xs))
    assert foreach.thinned_call(torch.ops.aten._foreach_addcdiv_.Tensor, (xs, xs, xs, scalars),
                                {}) is foreach.NOT_THINNED
    # Too few entries, or all of one kind each.
    assert foreach.thinned_call(torch.ops.aten._foreach_sqrt.default, (xs[:4],), {}) \
        is foreach.NOT_THINNED
    distinct = [torch.empty(i + 1) for i in range(10)]
    assert foreach.thinned_call(torch.ops.aten._foreach_sqrt.default, (distinct,), {}) \
        is foreach.NOT_THINNED


def test_fake_constants_are_always_run(fake):
    """Adam's `step` counters: CPU scalars whose values fake mode follows, read back by
    `.item()` for the bias correction. Each must be incremented, not only one of each kind."""
    steps = [torch.tensor(0.0) for _ in range(12)]
    assert all(s.constant is not None for s in steps)
    assert foreach.thinned_call(torch.ops.aten._foreach_add_.Scalar, (steps, 1), {}) \
        is foreach.NOT_THINNED
    kept, _ = foreach._kinds([steps], len(steps), in_place=True)
    assert kept == list(range(12))


def test_real_tensors_are_never_thinned():
    xs = _params()
    assert foreach.thinned_call(torch.ops.aten._foreach_sqrt.default, (xs,), {}) \
        is foreach.NOT_THINNED


@pytest.mark.parametrize(("model", "setting", "optimizer"), [
    ("gpt2", "cuda:bf16", "adamw"),  # foreach AdamW, as on CUDA
    ("llama-3.2-1b", "cuda:fp32+amp-bf16", "sgd"),  # momentum buffers made by a foreach clone
])
def test_a_thinned_step_records_what_the_whole_step_does(model, setting, optimizer, monkeypatch):
    thinned = []
    original = foreach.thinned_call

    def spy(func, args, kwargs):
        out = original(func, args, kwargs)
        thinned.append((func.__name__, out is not foreach.NOT_THINNED))
        return out

    monkeypatch.setattr(foreach, "thinned_call", spy)
    options = {"setting": setting, "workload": "train", "seq": 16, "predict": True,
               "optimizer": optimizer}
    quick = ampscope.trace(model, **options)
    assert any(done for _, done in thinned), thinned
    thinned.clear()
    whole = ampscope.trace(model, **options, every_block=True)
    assert thinned == []  # --every-block runs every entry too
    assert_same_trace(quick, whole)
