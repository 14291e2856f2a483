"""The step-time model (analysis/op_time.py, analysis/step_time.py, hardware/kernels.py): its
pieces against hand computation, and a real tiny trace costed on an A100."""

from __future__ import annotations

import math

import pytest

import ampscope
from ampscope import hardware
from ampscope.analysis.flops import flop_report
from ampscope.analysis.op_time import (
    collective_seconds,
    link_for,
    matmul_seconds,
    memory_seconds,
    op_time,
)
from ampscope.analysis.step_time import exposed_seconds, step_time
from ampscope.errors import AmpscopeError
from ampscope.hardware import kernels
from ampscope.records import OpCall, Phase, TensorMeta

A100 = hardware.by_name("a100")
P = kernels.params(A100)


def _op(name, inputs, outputs, *, phase=Phase.FORWARD, index=0, flops=0, group=None,
        fp32_precision=None, group_span=None):
    return OpCall(index=index, op=name, module="m", phase=phase,
                  inputs=tuple(TensorMeta(d, s) for d, s in inputs),
                  outputs=tuple(TensorMeta(d, s) for d, s in outputs), autocast_cast=False,
                  caller=None, source=None, input_names=(None,) * len(inputs), flops=flops,
                  fp32_precision=fp32_precision, group=group, group_span=group_span)


def test_a100_figures_are_the_published_ones():
    assert A100.multiprocessors == 108
    assert P["gemm_bfloat16"] == 0.859  # MAMF table: 267.9 of 312 TFLOPS
    assert "MAMF" in P.sources["gemm_bfloat16"] or "Matmul" in P.sources["gemm_bfloat16"]
    # every figure has a source, and every source says where it comes from
    assert set(P.values) == set(P.sources) and all(len(s) > 20 for s in P.sources.values())


def test_matmul_time_with_wave_quantization_by_hand():
    # 4096³ bf16 on an A100: 256×128 tiles -> 16·32 = 512 tiles over 108 SMs = 4.74 waves,
    # rounded up to 5; each tile does 2·256·128·4096 FLOPs at 1/108 of 312 TFLOP/s · 0.859.
    per_sm = 312e12 * 0.859 / 108
    tile = 2 * 256 * 128 * 4096 / per_sm
    assert matmul_seconds(4096, 4096, 4096, "bfloat16", A100, P) == pytest.approx(5 * tile)
    ideal = 2 * 4096**3 / (312e12 * 0.859)
    assert matmul_seconds(4096, 4096, 4096, "bfloat16", A100, P) / ideal == pytest.approx(
        5 / (512 / 108))


def test_one_tile_more_than_a_wave_costs_a_second_wave():
    # 3072×1152: 12·9 = 108 tiles, one full wave; 1153 columns: 12·10 = 120 tiles, two waves.
    one = matmul_seconds(3072, 1152, 4096, "bfloat16", A100, P)
    assert one == pytest.approx(2 * 256 * 128 * 4096 / (312e12 * 0.859 / 108))
    assert matmul_seconds(3072, 1153, 4096, "bfloat16", A100, P) == pytest.approx(2 * one)


def test_split_k_fills_the_sms_for_a_weight_gradient():
    # 768×768 with K = 16384: 3·6 = 18 tiles; 108 // 18 = 6 K-slices of ceil(16384/6) = 2731.
    t = matmul_seconds(768, 768, 16384, "bfloat16", A100, P)
    assert t == pytest.approx(2 * 256 * 128 * 2731 / (312e12 * 0.859 / 108))


def test_tf32_and_fp32_rates_and_tiles():
    # float32 runs on CUDA cores (19.5 TFLOP/s, 128×128 tiles); TF32 on Tensor Cores (156).
    fp32 = matmul_seconds(4096, 4096, 4096, "float32", A100, P)
    assert fp32 == pytest.approx(math.ceil(32 * 32 / 108) * 2 * 128 * 128 * 4096
                                 / (19.5e12 * P["gemm_float32"] / 108))
    tf32 = matmul_seconds(4096, 4096, 4096, "tf32", A100, P)
    assert fp32 / tf32 > 5


def test_elementwise_op_bytes_and_time():
    # a + b on two 4096×4096 float32 tensors: reads 2·64 MiB, writes 64 MiB.
    add = _op("aten.add.Tensor", [("float32", (4096, 4096))] * 2, [("float32", (4096, 4096))])
    t = op_time(add, A100, P)
    assert t.bytes == 3 * 4096 * 4096 * 4 == 201_326_592
    memory = 201_326_592 / (2.039e12 * 0.88)
    assert memory_seconds(t.bytes, A100, P) == pytest.approx(memory)
    assert t.bound == "memory" and t.seconds == pytest.approx(memory + 1e-6)
    # a tiny one is bound by the eager dispatch: 8 us of host time and the 1 us launch gap
    tiny = op_time(_op("aten.add.Tensor", [("float32", (8,))] * 2, [("float32", (8,))]), A100, P)
    assert tiny.bound == "launch" and tiny.seconds == pytest.approx(8e-6 + 1e-6)


def test_a_view_costs_nothing():
    view = _op("aten.view.default", [("float32", (4096, 4096))], [("float32", (16, 1024, 1024))])
    t = op_time(view, A100, P)
    assert (t.seconds, t.bytes, t.bound) == (0.0, 0, "none")
    assert op_time(_op("aten.t.default", [("float32", (64, 32))], [("float32", (32, 64))]),
                   A100, P).seconds == 0.0


def test_ring_all_reduce_by_hand():
    # 1 GB over 8 GPUs of one node: 2·7/8 of it through NVLink at 300 GB/s · 0.8, NCCL's base
    # latency once and 2·7 = 14 steps of 3.4 us.
    link = link_for(8, P)
    assert link.name == "nvlink"
    expected = 2 * 7 / 8 * 1e9 / 240e9 + 8.4e-6 + 14 * 3.4e-6
    assert collective_seconds("all_reduce", 10**9, 8, link) == pytest.approx(expected)
    # all-gather: (n-1)/n and n-1 steps; 16 ranks leave the node: the network, 25 GB/s · 0.8
    net = link_for(16, P)
    assert net.name == "network"
    assert collective_seconds("all_gather", 10**9, 16, net) == pytest.approx(
        15 / 16 * 1e9 / 20e9 + 8.4e-6 + 15 * 6.6e-6)
    assert collective_seconds("all_reduce", 10**9, 1, link) == 0.0


def test_the_link_is_chosen_by_the_nodes_the_group_spans_not_its_size():
    # 64 GPUs as FSDP 8 x TP 8, TP innermost: a TP group is ranks 0-7 (one node of 8), an FSDP
    # group ranks 0, 8, ..., 56 (one rank on each of 8 nodes). Both hold 8 ranks.
    # An all-gather of a 64 MiB bfloat16 output: (8-1)/8 of it through each GPU's link in 7
    # ring steps, plus NCCL's base latency once.
    payload = 2 * 4096 * 8192
    shard, whole = [("bfloat16", (512, 8192))], [("bfloat16", (4096, 8192))]
    tp = op_time(_op("_c10d_functional.all_gather_into_tensor.default", shard, whole, group=8,
                     group_span=(0, 7)), A100, P)
    fsdp = op_time(_op("_c10d_functional.all_gather_into_tensor.default", shard, whole,
                       group=8, group_span=(0, 56)), A100, P)
    assert P["gpus_per_node"] == 8
    # NVLink: 300 GB/s at 0.8, 3.4 us a step; the network: 25 GB/s at 0.8, 6.6 us a step.
    assert tp.seconds == pytest.approx(7 / 8 * payload / 240e9 + 8.4e-6 + 7 * 3.4e-6)
    assert fsdp.seconds == pytest.approx(7 / 8 * payload / 20e9 + 8.4e-6 + 7 * 6.6e-6)
    assert (tp.bytes, tp.ranks, fsdp.bytes, fsdp.ranks) == (payload, 8, payload, 8)
    # A group of 2 on the second node (ranks 8 and 15) stays on its NVLink; one of 2 that
    # straddles a node's edge (ranks 7 and 8) does not.
    assert link_for(2, P, (8, 15)).name == "nvlink"
    assert link_for(2, P, (7, 8)).name == "network"
    # Without its ranks (an older trace, a build that hides them) a group is placed by its
    # size, as before: 8 ranks fit a node.
    unknown = op_time(_op("_c10d_functional.all_gather_into_tensor.default", shard, whole,
                          group=8), A100, P)
    assert unknown.seconds == tp.seconds


def test_fsdp_overlap_rule():
    # forward: gather, matmul, gather, matmul. The first gather is exposed; the second hides
    # behind the matmuls.
    big = [("bfloat16", (8192, 8192))]
    gather = [("bfloat16", (2048, 8192))], [("bfloat16", (8192, 8192))]

    def mm(i):
        return _op("aten.mm.default", big * 2, big, index=i, flops=2 * 8192**3)

    ops = [_op("c10d.allgather_.default", *gather, index=0, group=4), mm(1),
           _op("c10d.allgather_.default", *gather, index=2, group=4), mm(3)]
    times = [op_time(o, A100, P) for o in ops]
    compute = times[1].seconds + times[3].seconds
    assert times[0].seconds < compute
    assert exposed_seconds([times[0], times[2]], compute, last_exposed=False) == times[0].seconds
    # backward: the last one is exposed too
    assert exposed_seconds([times[0], times[2]], compute, last_exposed=True) == pytest.approx(
        times[0].seconds + times[2].seconds)


def test_hardware_toml_overrides_a_figure(tmp_path, monkeypatch):
    table = tmp_path / "hardware.toml"
    table.write_text("[a100]\nkernels = { gemm_bfloat16 = 0.5 }\n")
    monkeypatch.setenv("AMPSCOPE_HARDWARE", str(table))
    acc = hardware.by_name("a100")
    figures = kernels.params(acc)
    assert figures["gemm_bfloat16"] == 0.5 and figures.sources["gemm_bfloat16"] == str(table)
    assert matmul_seconds(4096, 4096, 4096, "bfloat16", acc, figures) == pytest.approx(
        matmul_seconds(4096, 4096, 4096, "bfloat16", A100, P) * 0.859 / 0.5)
    table.write_text("[a100]\nkernels = { gemm_bf16 = 0.5 }\n")
    with pytest.raises(AmpscopeError, match="unknown kernels figure 'gemm_bf16'"):
        hardware.by_name("a100")


@pytest.fixture(scope="module")
def tiny_traces():
    return {s: ampscope.trace("gpt2-tiny", setting=f"cuda:{s}", seq=8, predict=True)
            for s in ("fp32", "fp32+tf32")}


def test_tf32_speeds_the_matmuls_and_leaves_memory_bound_ops(tiny_traces):
    fp32 = step_time(tiny_traces["fp32"], A100)
    tf32 = step_time(tiny_traces["fp32+tf32"], A100)
    pairs = list(zip(fp32.ops, tf32.ops, strict=True))
    matmuls = [(a, b) for a, b in pairs if a.op.endswith(("mm.default",)) and a.flops]
    assert matmuls
    for a, b in matmuls:
        assert (a.mode, b.mode) == ("float32", "tf32")
        assert b.compute_s < a.compute_s  # Tensor Cores, 8x the CUDA-core rate
    others = [(a, b) for a, b in pairs if not a.flops]
    assert others
    for a, b in others:
        assert a.op == b.op and a.seconds == b.seconds and a.bound == b.bound
    assert tf32.seconds < fp32.seconds
    # the step is the ops flop_report counts: the same FLOPs
    report = flop_report(tiny_traces["fp32"], tokens=fp32.tokens)
    assert sum(o.flops for o in fp32.ops) == report.total
    assert fp32.tokens == 8  # batch 1 × seq 8
    assert sum(fp32.by_phase.values()) == pytest.approx(fp32.seconds)
    assert sum(fp32.by_bound.values()) == pytest.approx(fp32.seconds)
    assert fp32.to_dict()["params"]["figures"]["bandwidth"]["value"] == 0.88


def test_an_accelerator_with_only_a_bf16_peak_still_times_a_float32_matmul():
    custom = hardware.with_figures(None, peak_flops={"bfloat16": 100e12}, memory_bytes=2**30)
    figures = kernels.params(custom)
    # no SM count: no quantization; float32 falls back to the one peak it has
    assert matmul_seconds(1024, 1024, 1024, "float32", custom, figures) == pytest.approx(
        2 * 1024**3 / (100e12 * 0.85))
    assert memory_seconds(10**9, custom, figures) == 0.0  # no bandwidth known
