"""Per-parameter fake ops answered without FakeTensorMode's dispatch (runs/shortcuts.py):
each answer equals FakeTensorMode's own for the same call — the ground truth, which the
shortcut does not consult — and a predicted step that takes the shortcuts (and the cache
answers, runs/fake_cache.py) records exactly what the step without them records, with far
fewer calls reaching FakeTensorMode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ampscope
from ampscope.runs import foreach
from ampscope.runs.shortcuts import answer
from tests.helpers import assert_same_trace

aten = torch.ops.aten


def _described(t: torch.Tensor) -> tuple:
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.fake_device,
            t.untyped_storage().nbytes(), t.constant is None, t.fake_mode)


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def test_item_of_a_fake_constant_reads_its_value(fake):
    step = torch.tensor(0.0)
    step.add_(3)  # fake mode follows the constant's value
    assert answer(aten._local_scalar_dense.default, (step,), {}) == 3.0 == step.item()


@pytest.mark.fast
def test_detach_aliases_its_input_as_fake_mode_does(fake):
    x = torch.empty(6, 8, requires_grad=True)[1:, 2:]
    mine = answer(aten.detach.default, (x,), {})
    truth = aten.detach.default(x)
    assert _described(mine) == _described(truth)
    assert mine.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert not mine.requires_grad


@pytest.mark.fast
@pytest.mark.parametrize(("shape", "size"), [((16, 8), [2, 8, 8]), ((16, 8), [128]),
                                             ((1, 16, 8), [16, 8])])
def test_an_unsafe_view_aliases_its_input_as_fake_mode_does(fake, shape, size):
    """`_unsafe_view` (a reshape autograd does not track as a view): the same shape, strides,
    offset and storage as FakeTensorMode's answer, and no view."""
    base = torch.empty(40, 8)
    x = base[3:].view(-1)[: torch.Size(shape).numel()].view(shape)  # an offset into a storage
    mine = answer(aten._unsafe_view.default, (x, size), {})
    truth = aten._unsafe_view.default(x, size)
    assert _described(mine) == _described(truth)
    assert mine.untyped_storage()._cdata == truth.untyped_storage()._cdata == \
        x.untyped_storage()._cdata
    assert mine._is_view() == truth._is_view()


def test_constants_and_real_tensors_go_to_fake_mode(fake):
    step = torch.tensor(1.0)
    assert answer(aten.detach.default, (step,), {}) is foreach.NOT_THINNED  # fake mode follows it
    assert answer(aten._unsafe_view.default, (step, [1]), {}) is foreach.NOT_THINNED
    plain = torch.empty(3)
    assert answer(aten._local_scalar_dense.default, (plain,), {}) is foreach.NOT_THINNED
    with torch.utils._python_dispatch._disable_current_modes():
        real = torch.zeros(3)
    assert answer(aten.detach.default, (real,), {}) is foreach.NOT_THINNED


def test_a_step_with_shortcuts_records_what_the_step_without_does(monkeypatch):
    """gpt2's AdamW step, predicted for CUDA: the step counters, their item() and autograd's
    detaches take the shortcut, the optimizer state's zeros_like the cache answers; the trace
    equals the one made with every call dispatched (every_block=True takes neither), and far
    fewer calls reach FakeTensorMode."""
    reached: Counter[str] = Counter()
    original = FakeTensorMode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if func is aten.zeros_like.default and "memory_format" not in kwargs:
            return original(self, func, types, args, kwargs)  # not the optimizer's (a loss's)
        reached[func.__name__] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", counted)
    # FakeTensorMode's cache as a fresh process has it (earlier tests filled the real one).
    monkeypatch.setattr(FakeTensorMode, "cache", {})
    options = {"setting": "cuda:bf16", "workload": "train", "seq": 16, "predict": True}
    quick = ampscope.trace("gpt2", **options)
    short = reached.copy()
    reached.clear()
    whole = ampscope.trace("gpt2", **options, every_block=True)
    assert_same_trace(quick, whole)
    n_params = len(whole.parameters)  # counted once per tensor: the optimizer's list
    # Without the shortcuts: two zeros_like per parameter, item() twice per step counter.
    assert reached["zeros_like.default"] == 2 * n_params
    assert reached["_local_scalar_dense.default"] == 2 * n_params
    kinds = len({(p.shape, p.dtype) for p in whole.parameters})
    assert kinds < n_params / 10
    assert short["zeros_like.default"] == kinds  # the first of each kind only
    assert short["_local_scalar_dense.default"] == 0
    assert reached["lift_fresh.default"] >= n_params and short["lift_fresh.default"] == 0
    assert short["detach.default"] < reached["detach.default"] - n_params // 2
    # The fake tensors' device reads (thousands, from the autograd engine and foreach ops'
    # checks) are answered by the op recorder (the prim-device trick): what reaches
    # FakeTensorMode are the few its own decompositions make. The exact path takes no trick.
    assert short["device.default"] < 20 < 1000 < reached["device.default"]
    # A second step in the process: the first zeros_like of each kind is answered from the
    # entry FakeTensorMode's cache kept, as its own cache hit would be, without reaching it.
    reached.clear()
    again = ampscope.trace("gpt2", **options)
    assert_same_trace(again, whole)
    assert reached["zeros_like.default"] == 0


@pytest.mark.fast
def test_shortcut_results_are_fake_tensors_of_the_run(fake):
    x = torch.empty(4, 4)
    made = answer(aten.detach.default, (x,), {})
    assert type(made) is FakeTensor and made.fake_mode is fake
    assert (made + x).shape == (4, 4)  # usable in the run's later ops


def test_a_lifted_scalar_is_the_fake_constant_fake_mode_makes(fake):
    """`torch.tensor(0.0)` under fake mode (Adam's step counters): a fake constant whose value
    fake mode follows through in-place ops and reads back."""
    with torch.utils._python_dispatch._disable_current_modes():
        real = torch.tensor(2.0)
    mine = answer(aten.lift_fresh.default, (real,), {})
    truth = aten.lift_fresh.default(real)
    assert _described(mine) == _described(truth)
    mine.add_(1)
    assert mine.item() == 3.0
    assert mine.constant is not real
    with torch.utils._python_dispatch._disable_current_modes():
        assert truth.constant.item() == 2.0
        assert real.item() == 2.0  # a copy: the real tensor is untouched
    with torch.utils._python_dispatch._disable_current_modes():
        big = torch.zeros(10_000)  # too large to follow: fake mode makes it a plain fake tensor
    assert answer(aten.lift_fresh.default, (big,), {}) is foreach.NOT_THINNED


def _lifted_lives(lifted: torch.Tensor) -> tuple:
    """What becomes of a lifted step counter through in-place updates, reads, ops and views:
    each answer depends on the fake mode's books (its memo of converted tensors and storages,
    and which fake tensors share a constant's storage)."""
    updated = lifted.add_(1)
    value = lifted.item()
    doubled = (lifted * 2).item()
    view = lifted.view(1)
    expanded = lifted.expand(3)

    def storage(t):
        return t.untyped_storage()._cdata

    return (updated is lifted, value, doubled, storage(view) == storage(lifted),
            storage(expanded) == storage(lifted), view.constant is None,
            lifted.constant is None, expanded.constant is None)


@pytest.mark.fast
def test_a_lifted_scalar_lives_on_as_fake_mode_s_own(fake):
    """An in-place update returns the lifted tensor itself, a view shares its storage, and a
    view that fake mode stops following stops it following the tensor: as for FakeTensorMode's
    own lift."""
    with torch.utils._python_dispatch._disable_current_modes():
        real = torch.tensor(2.0)
    mine = _lifted_lives(answer(aten.lift_fresh.default, (real,), {}))
    truth = _lifted_lives(aten.lift_fresh.default(real))
    assert mine == truth
    assert truth[:3] == (True, 3.0, 6.0)


@pytest.mark.fast
def test_lifted_tensors_of_every_kind_match_fake_mode(fake):
    """Scalars of other dtypes lift to what FakeTensorMode makes, value included; a tensor
    with more than one element (fake mode makes no constant of it) or with autograd,
    conjugate or negative bits is left to FakeTensorMode."""
    with torch.utils._python_dispatch._disable_current_modes():
        reals = [torch.tensor(7), torch.tensor(0.25, dtype=torch.float64), torch.tensor(True),
                 torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor([3], dtype=torch.int32)]
        left = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor(1.0, requires_grad=True),
                torch.tensor(1j).conj(), torch.tensor(1.0)._neg_view()]
    for real in reals:
        mine = answer(aten.lift_fresh.default, (real,), {})
        truth = aten.lift_fresh.default(real)
        assert _described(mine) == _described(truth)
        with torch.utils._python_dispatch._disable_current_modes():
            assert mine.constant.stride() == truth.constant.stride()
            assert torch.equal(mine.constant, truth.constant)
    for real in left:
        assert answer(aten.lift_fresh.default, (real,), {}) is foreach.NOT_THINNED
