"""Fake ops answered from FakeTensorMode's own cache by a cheaper key (runs/fake_cache.py):
each answer equals FakeTensorMode's own for the same call — the ground truth, made by calling
the op under the mode — down to which storage it is on; the calls it answers never reach the
mode; a mode that may change an op's results keeps every call; and a predicted step with the
answers records exactly what the step without them records."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import ampscope
from ampscope.runs import fake_cache
from ampscope.runs.fake_cache import CachedAnswers
from ampscope.runs.foreach import NOT_THINNED
from ampscope.runtime.norm_stats import TargetNormStats
from tests.helpers import REPLAY_NOTE, assert_same_trace

aten = torch.ops.aten


@pytest.fixture
def reached(monkeypatch) -> Counter:
    """The calls that reach FakeTensorMode, by op."""
    counts: Counter = Counter()
    original = FakeTensorMode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        counts[func.__name__] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", counted)
    return counts


def _described(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (t,)
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.fake_device,
            t.untyped_storage().nbytes(), t.requires_grad, t.constant is None)


def _storage(t) -> int:
    return t.untyped_storage()._cdata


def _calls():
    """(op, args maker, kwargs): new results, views, in-place updates and several results."""
    def a():
        return torch.empty(8, 6)

    def b():
        return torch.empty(6, 4, dtype=torch.bfloat16)

    return [
        (aten.mm.default, lambda: (a(), torch.empty(6, 5)), {}),
        (aten.add.Tensor, lambda: (a(), a()), {"alpha": 2}),
        (aten.mul.Tensor, lambda: (b(), b()), {}),
        (aten._to_copy.default, lambda: (a(),), {"dtype": torch.bfloat16}),
        (aten.sum.dim_IntList, lambda: (a(), [1]), {}),
        (aten.cat.default, lambda: ([a(), a()], 0), {}),
        (aten.view.default, lambda: (a(), [2, 24]), {}),
        (aten.t.default, lambda: (a(),), {}),
        (aten.slice.Tensor, lambda: (a(), 0, 2, 6), {}),
        (aten.expand.default, lambda: (torch.empty(1, 6), [3, 6]), {}),
        (aten.add_.Tensor, lambda: (a(), a()), {}),
        (aten.max.dim, lambda: (a(), 1), {}),
        (aten.native_layer_norm.default, lambda: (a(), [6], torch.empty(6), torch.empty(6), 1e-5),
         {}),
    ]


class Answering(TorchDispatchMode):
    """What the op recorder does with `CachedAnswers`: each op it gets from the dispatcher, as
    the dispatcher passes it, is answered or handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = CachedAnswers()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self.answers.call(func, args, kwargs or {})
        return func(*args, **(kwargs or {})) if out is NOT_THINNED else out


@pytest.mark.fast
@pytest.mark.parametrize(("op", "make", "kwargs"), _calls(), ids=lambda v: str(v)[:30])
def test_answers_are_fake_mode_s_own(reached, op, make, kwargs):
    with FakeTensorMode():
        with Answering():
            op(*make(), **kwargs)  # learned: dispatched to FakeTensorMode
            args = make()
            reached.clear()
            mine = op(*args, **kwargs)
            # Answered from the cache entry; only a view's device is read (by the view
            # machinery above, which the op recorder answers itself in a run).
            assert set(reached) <= {"device.default"}
        truth_args = make()
        truth = op(*truth_args, **kwargs)
    mine_all = mine if isinstance(mine, tuple) else (mine,)
    truth_all = truth if isinstance(truth, tuple) else (truth,)
    assert [_described(t) for t in mine_all] == [_described(t) for t in truth_all]
    for m, t in zip(mine_all, truth_all, strict=True):
        # The same relation to the arguments: the argument itself (in place), a view on its
        # storage, or a storage of its own.
        relation_mine = [m is x for x in args] + [_storage(m) == _storage(x) for x in args
                                                   if isinstance(x, torch.Tensor)]
        relation_truth = [t is x for x in truth_args] + [
            _storage(t) == _storage(x) for x in truth_args if isinstance(x, torch.Tensor)]
        assert relation_mine == relation_truth


def _like_inputs() -> list[torch.Tensor]:
    """Dense, transposed, offset and expanded inputs, in two dtypes."""
    base = torch.empty(6, 8)
    return [torch.empty(8, 4), torch.empty(4, 8).t(), base[1:], torch.empty(1, 4).expand(3, 4),
            torch.empty(5, dtype=torch.bfloat16)]


@pytest.mark.fast
@pytest.mark.parametrize(("op", "extra", "kwargs"), [
    (aten.zeros_like.default, (), {}),
    (aten.zeros_like.default, (), {"memory_format": torch.preserve_format}),
    (aten.empty_like.default, (), {"dtype": torch.float16}),
    (aten.ones_like.default, (), {"memory_format": torch.contiguous_format}),
    (aten.full_like.default, (0.5,), {}),
])
def test_new_tensors_like_another_are_as_fake_mode_makes_them(reached, op, extra, kwargs):
    """The optimizer state's `zeros_like` and its kin, for dense, transposed, offset and
    expanded inputs: answered from the cache (as a new tensor of its own) as FakeTensorMode
    makes them."""
    with FakeTensorMode():
        for x in _like_inputs():
            with Answering():
                first = op(x, *extra, **kwargs)  # learned from FakeTensorMode
                reached.clear()
                again = op(x, *extra, **kwargs)  # made from its cache entry
                assert set(reached) <= {"device.default"}
            truth = op(x, *extra, **kwargs)
            assert _described(first) == _described(again) == _described(truth)
            # A new tensor each time, with a storage of its own, as a kernel's result.
            assert again.untyped_storage()._cdata not in (first.untyped_storage()._cdata,
                                                          x.untyped_storage()._cdata)


def test_a_first_call_is_answered_from_the_entry_fake_mode_already_holds(reached, monkeypatch):
    """FakeTensorMode's cache is its class's and outlives a run: the first call of a key in a
    new run is answered from the entry an earlier call left, as FakeTensorMode's own cache hit
    makes it, without reaching the mode; with the cache empty it reaches the mode once."""
    monkeypatch.setattr(FakeTensorMode, "cache", {})
    with FakeTensorMode():
        x, w = torch.empty(8, 6), torch.empty(6, 5)
        first_run = CachedAnswers()
        assert first_run.call(aten.mm.default, (x, w), {}) is not NOT_THINNED
        assert reached["mm.default"] == 1  # an empty cache: dispatched, and entered in it
        reached.clear()
        mine = CachedAnswers().call(aten.mm.default, (x, w), {})  # another run's first call
        assert not reached
        truth = aten.mm.default(x, w)
    assert _described(mine) == _described(truth)
    assert _storage(mine) not in (_storage(truth), _storage(x), _storage(w))


class _KeepsNothing(dict):
    """A FakeTensorMode cache that keeps no entry (as for an op the mode bypasses: which ops
    those are changes between releases; `_unsafe_view` is cached from 2.15 on)."""

    def __setitem__(self, key, value) -> None:
        pass


@pytest.mark.fast
def test_calls_the_cache_cannot_hold_go_to_fake_mode(reached, monkeypatch):
    """A real tensor, a fake constant and an op FakeTensorMode keeps no entry for are never
    answered."""
    monkeypatch.setattr(FakeTensorMode, "cache", _KeepsNothing())
    with FakeTensorMode():
        answers = CachedAnswers()
        with torch.utils._python_dispatch._disable_current_modes():
            real = torch.ones(3)
        assert answers.call(aten.add.Tensor, (torch.empty(3), real), {}) is NOT_THINNED
        constant = torch.tensor(2.0)
        assert constant.constant is not None
        assert answers.call(aten.mul.Tensor, (constant, constant), {}) is NOT_THINNED
        x = torch.empty(4, 4)
        answers.call(aten._unsafe_view.default, (x, [16]), {})  # FakeTensorMode keeps nothing
        reached.clear()
        assert answers.call(aten._unsafe_view.default, (x, [16]), {}) is NOT_THINNED


def test_a_mode_that_may_change_results_keeps_every_call(reached):
    """A mode between the recorder and FakeTensorMode that does not say it passes an op
    through unchanged keeps every call of it; the norm-statistics mode keeps its norms."""
    class Unknown(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        x = torch.empty(8, 6)
        norm_args = (x, [6], torch.empty(6), torch.empty(6), 1e-5)
        for mode, op, args, answered in [
            (Unknown(), aten.mm.default, (x, torch.empty(6, 5)), False),
            (TargetNormStats("cuda"), aten.mm.default, (x, torch.empty(6, 5)), True),
            (TargetNormStats("cuda"), aten.native_layer_norm.default, norm_args, False),
        ]:
            answers = CachedAnswers()
            with mode:
                answers.call(op, args, {})
                reached.clear()
                out = answers.call(op, args, {})
            assert (out is not NOT_THINNED) == answered
            assert not reached  # answered without FakeTensorMode, or not at all


def test_a_predicted_step_with_cached_answers_records_what_the_step_without_does(
        reached, monkeypatch):
    """A Llama-style HF model's step, predicted for CUDA (the norm-statistics mode active):
    the trace equals the one made with every call dispatched to FakeTensorMode, and fewer than
    half the calls reach it."""
    options = {"setting": "cuda:bf16", "workload": "train", "seq": 16, "predict": True}
    quick = ampscope.trace("llama-3.2-1b", **options)
    with_answers = sum(reached.values())
    reached.clear()
    monkeypatch.setattr(fake_cache.CachedAnswers, "call", lambda self, f, a, k: NOT_THINNED)
    whole = ampscope.trace("llama-3.2-1b", **options)
    whole.notes = [n for n in whole.notes if REPLAY_NOTE not in n]
    assert_same_trace(quick, whole)
    assert with_answers < sum(reached.values()) / 2
