"""`fit --gpu NAME` and `fit --gpus N --gpu NAME` trace their probes on the GPU named, as
`trace --gpu` and `run --gpu` do: each probe's emulated cuda device is that GPU, so its kernels
are the ones that GPU's capability picks (scaled_dot_product_attention: flash on an A100, sm80;
cuDNN's on the default H100, sm90) and its record names the GPU (setting.gpu)."""

from __future__ import annotations

import importlib

import ampscope.api.parallel_plans as parallel_plans
import ampscope.distributed.step as distributed_step

api_fit = importlib.import_module("ampscope.api.fit")  # ampscope.api.fit is also the function


def _attention(trace) -> set[str]:
    return {o.op for o in trace.ops if o.phase == "forward" and "scaled_dot_product" in o.op}


def _kept(monkeypatch, module, name: str) -> list:
    """What each call of `module.name` returns, from now on, in this process."""
    results: list = []
    original = getattr(module, name)

    def kept(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(module, name, kept)
    return results


def test_fit_traces_its_probes_on_the_gpu_named(monkeypatch):
    traces = _kept(monkeypatch, api_fit, "trace")
    api_fit.fit("gpt2-tiny", gpu="a100", setting="cuda:fp32+amp-bf16", seq=32, variants=False)
    assert traces
    assert {t.setting.gpu for t in traces} == {"a100"}
    assert {op for t in traces for op in _attention(t)} == {
        "aten._scaled_dot_product_flash_attention.default"}


def test_fit_gpus_traces_each_rank_on_the_gpu_named(monkeypatch):
    reports = _kept(monkeypatch, distributed_step, "rank_step")
    monkeypatch.setattr(parallel_plans, "MAX_WORKERS", 1)  # the probes here, where it is kept
    parallel_plans.plans("gpt2-tiny", 2, gpu="a100", setting="cuda:fp32+amp-bf16", seq=16)
    traces = [r.trace for r in reports if r is not None and r.trace is not None]
    assert traces
    assert {t.setting.gpu for t in traces} == {"a100"}
    assert {op for t in traces for op in _attention(t)} == {
        "aten._scaled_dot_product_flash_attention.default"}
