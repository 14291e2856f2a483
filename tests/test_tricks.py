"""The speed tricks' one switch and their fallbacks (ampscope.tricks, ampscope.torchcompat).

A private detail a trick needs that is missing or behaves differently turns that trick off
before the run, and the trace is then the exact path's; a trick that fails during a run is
turned off there and its op runs the exact way; a real run never touches them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

import ampscope
from ampscope import tricks
from ampscope.torchcompat import fake
from ampscope.torchcompat.fake import FakeTensorMode
from tests.helpers import assert_same_trace

OPTIONS = {"setting": "fp32+amp-bf16", "seq": 8, "predict": True}


@pytest.fixture
def detect_again():
    """Forget what was detected (on both sides of the test): the test changes torch."""
    caches = (fake._cache_api_found, fake._cloner_found, fake.converter_memos,
              fake.kernel_invocation_flag, fake._storage_length_found, tricks._missing)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.fixture(scope="module")
def exact_trace():
    return ampscope.trace("gpt2-tiny", **OPTIONS, exact=True)


@pytest.mark.fast
def test_the_exact_path_takes_no_trick(monkeypatch):
    with tricks.exact_path():
        assert not any(tricks.enabled(t) for t in tricks.Trick)
    assert tricks.enabled(tricks.Trick.REPLAY)


def test_a_changed_signature_turns_the_cache_trick_off_and_the_trace_is_exact(
        monkeypatch, detect_again, exact_trace):
    # A new parameter (torch's own calls still work): a signature the trick does not know.
    original = FakeTensorMode._output_from_cache_entry

    def other_signature(self, state, entry, key, func, args, extra=None):
        return original(self, state, entry, key, func, args)

    monkeypatch.setattr(FakeTensorMode, "_output_from_cache_entry", other_signature)
    missing = tricks.unavailable()
    assert set(missing) == {tricks.Trick.FAKE_CACHE}
    assert "_output_from_cache_entry" in missing[tricks.Trick.FAKE_CACHE]
    assert_same_trace(ampscope.trace("gpt2-tiny", **OPTIONS), exact_trace)


@pytest.mark.fast
def test_a_missing_detail_turns_its_tricks_off_and_the_trace_is_exact(
        monkeypatch, detect_again, exact_trace):
    # The cache's entry class, hidden from the layer as a release without it would (torch's own
    # code still reaches its module's name).
    from torch._subclasses import fake_tensor

    names = {k: v for k, v in vars(fake_tensor).items() if k != "_DispatchCacheValidEntry"}
    monkeypatch.setattr(fake, "_fake_tensor", types.SimpleNamespace(**names))
    missing = tricks.unavailable()
    assert set(missing) == {tricks.Trick.FAKE_CACHE}
    assert "_DispatchCacheValidEntry" in missing[tricks.Trick.FAKE_CACHE]
    assert_same_trace(ampscope.trace("gpt2-tiny", **OPTIONS), exact_trace)


def test_a_missing_storage_length_turns_the_foreach_trick_off_and_the_trace_is_exact(
        monkeypatch, detect_again):
    # The foreach trick's one private detail, hidden as a release without it would: the trick
    # is off before the run (its status says why), and no foreach op of AdamW's step (foreach
    # on CUDA) is answered by it.
    import torch._prims_common as prims_common

    from ampscope.runs import foreach

    options = {"setting": "cuda:bf16", "workload": "train", "seq": 8, "predict": True,
               "optimizer": "adamw"}
    exact = ampscope.trace("gpt2-tiny", **options, exact=True)
    assert any("_foreach_" in o.op for o in exact.ops)  # the trick has ops to answer
    monkeypatch.delattr(prims_common, "compute_required_storage_length")
    asked = []
    monkeypatch.setattr(foreach, "thinned_call",
                        lambda *call: asked.append(call) or foreach.NOT_THINNED)
    missing = tricks.unavailable()
    assert set(missing) == {tricks.Trick.FOREACH}
    assert "compute_required_storage_length" in missing[tricks.Trick.FOREACH]
    assert_same_trace(ampscope.trace("gpt2-tiny", **options), exact)
    assert asked == []


@pytest.mark.fast
def test_a_trick_that_behaves_differently_is_found_out_by_its_probe(monkeypatch, detect_again):
    # The key builder works but its keys are never found again (torch's own cache then
    # misses every time: slower, still right); the trick's probe notices.
    original = FakeTensorMode._cache_key

    def unfindable(self, state, func, args, kwargs):
        original(self, state, func, args, kwargs)
        return object()

    monkeypatch.setattr(FakeTensorMode, "_cache_key", unfindable)
    assert fake.cache_api() is None
    assert "behaves differently" in tricks.unavailable()[tricks.Trick.FAKE_CACHE]


def test_a_trick_failing_mid_run_reruns_the_step_on_the_exact_path(monkeypatch, exact_trace):
    from ampscope.runs import fake_cache

    calls = []

    def broken(self, func, args, kwargs):
        calls.append(func)
        raise RuntimeError("made to fail")

    monkeypatch.setattr(fake_cache.CachedAnswers, "call", broken)
    quick = ampscope.trace("gpt2-tiny", **OPTIONS)
    assert len(calls) == 1, "the trick failed once, then was off"
    assert_same_trace(quick, exact_trace)


def test_under_run_a_failing_trick_falls_back_op_by_op(monkeypatch, tmp_path):
    """A script has side effects and cannot run again: the op the trick failed on runs the
    exact way, the trick is off for the rest of the run, and the trace says so."""
    from ampscope.runs import shortcuts

    def broken(func, args, kwargs):
        raise RuntimeError("made to fail")

    monkeypatch.setattr(shortcuts, "answer", broken)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    """))
    quick = ampscope.run_script(str(script), predict=True, in_process=True)
    with tricks.exact_path():
        exact = ampscope.run_script(str(script), predict=True, in_process=True)
    notes = [n for n in quick.notes if "speed trick" in n]
    assert len(notes) == 1 and "shortcuts" in notes[0] and "made to fail" in notes[0]
    a, b = quick.to_dict(), exact.to_dict()
    a["notes"] = [n for n in a["notes"] if "speed trick" not in n]
    assert a == b


def test_version_verbose_lists_the_build_and_the_tricks():
    result = subprocess.run([sys.executable, "-m", "ampscope", "--version", "-v"],
                            capture_output=True, text=True, check=True)
    import torch

    assert f"torch {torch.__version__}" in result.stdout
    for trick in tricks.Trick:
        assert f"  {trick.value}" in result.stdout


def test_a_real_run_never_touches_the_fast_path_internals():
    """With every internal the tricks use made to raise, importing ampscope and running a real
    trace works, and none of the tricks' detections ran."""
    code = textwrap.dedent("""
        import json
        from torch._subclasses import fake_tensor

        touched = []
        def trap(name):
            def called(*args, **kwargs):
                touched.append(name)
                raise AssertionError(name)
            return called
        for name in ("_cache_key", "_output_from_cache_entry"):
            setattr(fake_tensor.FakeTensorMode, name, trap(name))
        del fake_tensor._DispatchCacheValidEntry

        import ampscope
        from ampscope.torchcompat import fake
        trace = ampscope.trace("gpt2-tiny", seq=8, predict=False)
        detected = [f.cache_info().currsize for f in
                    (fake._cache_api_found, fake._cloner_found, fake.converter_memos,
                     fake._storage_length_found)]
        print(json.dumps({"ops": len(trace.ops), "touched": touched, "detected": detected}))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["ops"] > 100
    assert found["touched"] == [] and found["detected"] == [0, 0, 0, 0]


def test_a_trick_whose_wrong_answer_makes_the_model_fail_is_caught_by_the_exact_path(
        monkeypatch, exact_trace):
    """A trick that answers wrongly does not raise itself: the model fails later, on what it
    was given. The step then runs on the exact path, and its trace is the answer."""
    import torch

    from ampscope.runs import fake_cache, foreach

    def wrong(self, func, args, kwargs):
        if func is torch.ops.aten.addmm.default:
            return args[1].new_empty((3,))  # not the product's shape
        return foreach.NOT_THINNED

    monkeypatch.setattr(fake_cache.CachedAnswers, "call", wrong)
    assert_same_trace(ampscope.trace("gpt2-tiny", **OPTIONS), exact_trace)


def test_the_models_own_error_is_still_reported_after_the_exact_path():
    import torch

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 5)
            self.b = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.b(self.a(x)).sum()

    with pytest.raises(RuntimeError, match=r"same reduction dim, but got \[2, 5\] X \[4, 3\]"):
        ampscope.trace(Broken(), {"x": torch.randn(2, 4)}, predict=True)
