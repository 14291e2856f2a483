"""`fit --gpus N` on a GPU: each plan's step time and reserved peak, derived from its probes
(analysis/plans.py: `derived_time`, `Rule.reserved`), against the same plan traced whole at its
full depth and micro-batch — its ops timed by analysis/step_time and the caching allocator
replayed over its storages (analysis/allocator) — which the rules never see.

What must hold and how closely:

- **Depth, exactly.** At a micro-batch the probes ran (3), only the depth rule applies; each
  block adds the same ops, so the derived time equals the traced one to float rounding (1e-9),
  phase by phase and bound by bound, and the FLOPs exactly.
- **Micro-batch, approximately: 3%.** Between and past the probes' batches the time is taken
  affine, and two pieces of the model are not: a GEMM's wave quantization (whole waves of
  132 tiles on an H100) and an op's max(compute, memory, host) crossing from one to another.
  The cases are in the regime a plan runs in (seq 1024-2048 tokens, so a block's GEMMs fill
  their waves and most ops are compute- or memory-bound): there the error seen is 0.4% and 2.3%,
  and 3% holds it with little room to spare, so a change that makes the rule worse shows. Far
  outside that regime (a GEMM with fewer tiles than SMs, split over K) the rule is worse: gpt2
  at seq 1024 on 4 GPUs errs by 9% at micro-batch 4 (docs/fit.md says so).
- **Reserved peak: within 5%, an estimate.** The allocator is replayed exactly on the probes'
  storages at the plan's micro-batch (every storage's size is exact there); the gap between
  the reserved and the allocated peak is not affine in the depth (fragmentation comes and goes
  with the order of frees: llama-3.2-1b's gap is 702, 565, 582, 636 and 701 MB at 2, 3, 4, 8 and
  16 blocks), so the full depth takes the largest of the probes' gaps and their line. Seen:
  -0.5% and +0.01% here, -2.8% on gpt2 with checkpointing."""

from __future__ import annotations

import pytest

from ampscope import hardware
from ampscope.analysis.op_time import BOUNDS, collective_seconds, link_for, op_time
from ampscope.analysis.plans import probe_time
from ampscope.analysis.step_time import StepTime
from ampscope.api.parallel_plans import derived_plan, traced_plan
from ampscope.hardware.kernels import params
from ampscope.records import OpCall, Phase, TensorMeta

# (model, GPUs, tp, checkpointing, depth, micro-batch, seq): tensor parallelism within a machine
# (FSDP 4 x TP 2), and across machines (FSDP 2 x TP 8: FSDP's group of 2 spans 16 GPUs, so its
# collectives cross the network).
CASES = [
    ("llama-3.2-1b", 8, 2, True, 16, 5, 2048),
    ("llama-3.2-1b", 16, 8, False, 16, 4, 1024),
]


def _relative(derived: float, traced: float) -> float:
    return abs(derived - traced) / traced


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}gpus-tp{c[2]}-b{c[5]}" for c in CASES])
def test_derived_time_and_reserved_peak_near_the_traced_plan(case):
    model, gpus, tp, checkpoint, depth, batch, seq = case
    options = dict(tp=tp, checkpoint=checkpoint, depth=depth, batch=batch, seq=seq, gpu="h100")
    peaks, time, reserved = traced_plan(model, gpus, **options)
    d_peaks, d_time, d_reserved = derived_plan(model, gpus, **options)
    assert time is not None and d_time is not None and reserved and d_reserved
    assert d_peaks == peaks  # the memory rules, exact as tests/test_plans.py holds them
    assert _relative(d_time.seconds, time.seconds) < 0.03
    assert d_time.flops == pytest.approx(time.flops, rel=1e-12)  # FLOPs are affine in the batch
    assert reserved >= max(peaks.values()) and d_reserved >= max(d_peaks.values())
    assert _relative(d_reserved, reserved) < 0.05


def test_the_depth_rule_is_exact_at_a_probed_batch():
    """At micro-batch 3 (probed) the time's depth rule alone takes 2 and 3 blocks to 16: equal
    to the plan traced at 16 blocks, every phase and bound."""
    options = dict(tp=2, checkpoint=True, depth=16, batch=3, seq=2048, gpu="h100")
    _, time, _ = traced_plan("llama-3.2-1b", 8, **options)
    _, derived, _ = derived_plan("llama-3.2-1b", 8, **options)
    assert time is not None and derived is not None
    assert derived.seconds == pytest.approx(time.seconds, rel=1e-9)
    for phase in ("forward", "backward", "optimizer"):
        assert derived.by_phase[phase] == pytest.approx(time.by_phase[phase], rel=1e-9)
    for bound in BOUNDS:
        assert derived.by_bound[bound] == pytest.approx(time.by_bound[bound], rel=1e-9, abs=1e-12)
    assert time.by_bound["communication"] > 0  # the collectives are in it
    assert derived.flops == time.flops


def test_fsdp_across_machines_is_timed_on_the_network():
    """FSDP 2 x TP 8 on 16 GPUs: FSDP's all-gathers run over a group of 2 whose ranks are 8 apart
    (two machines), so they cross the network, not NVLink, though the group is small: the
    probe's time is the network's. FSDP 2 x TP 4 (8 GPUs, ranks 0 and 4): one machine."""
    acc = hardware.by_name("h100")
    figures = params(acc)
    payload = 2**30
    network = collective_seconds("all_gather", payload, 2, link_for(2, figures, (0, 8)))
    nvlink = collective_seconds("all_gather", payload, 2, link_for(2, figures, (0, 4)))
    assert link_for(2, figures, (0, 8)).name == "network" and network > 2 * nvlink

    def probe(span: tuple[int, int]) -> dict:
        gather = OpCall(0, "_c10d_functional.all_gather_into_tensor.default", None,
                        Phase.FORWARD, (TensorMeta("bfloat16", (2**28,)),),
                        (TensorMeta("bfloat16", (2**29,)),), False, None, None, (None,),
                        group=2, group_span=span)
        timed = op_time(gather, acc, figures, world_size=16)
        step = StepTime("m", "cuda:bf16", "h100", timed.seconds, {}, {}, {}, [timed], 1, 1.0,
                        None, 0.0, figures)
        return probe_time(step, {}).figures

    assert probe((0, 8))["ends", "forward"] == network
    assert probe((0, 4))["ends", "forward"] == nvlink
