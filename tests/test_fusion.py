"""`torch.compile` on the GPU one does not have: which ops ran in compiled code
(runtime/compiled.py, runs/ops.py), and how analysis/fusion.py costs them as Inductor's fused
kernels, against hand computation."""

from __future__ import annotations

import textwrap

import pytest
import torch

import ampscope
from ampscope import hardware
from ampscope.analysis.fusion import fuse, fused_runs, kernel_bytes, made_by
from ampscope.analysis.op_time import op_time
from ampscope.analysis.step_time import step_time
from ampscope.hardware import kernels
from ampscope.records import OpCall, Phase, StorageCategory, StorageRecord, TensorMeta
from ampscope.script import run_script

A100 = hardware.by_name("a100")
P = kernels.params(A100)
X = ("bfloat16", (8, 1024, 768))  # 12 MiB
F32 = ("float32", (8, 1024, 768))  # 24 MiB
W = ("bfloat16", (768,))


def _op(index, name, inputs, outputs, *, compiled=True, flops=0, phase=Phase.FORWARD):
    return OpCall(index=index, op=name, module="h.0", phase=phase,
                  inputs=tuple(TensorMeta(d, s) for d, s in inputs),
                  outputs=tuple(TensorMeta(d, s) for d, s in outputs), autocast_cast=False,
                  caller=None, source=None, input_names=(None,) * len(inputs), flops=flops,
                  compiled=compiled)


def _storage(k, dtype, shape, created, freed):
    nbytes = {"bfloat16": 2, "float32": 4}[dtype]
    for n in shape:
        nbytes *= n
    return StorageRecord(k, nbytes, dtype, shape, created, freed, StorageCategory.ACTIVATION)


# y = layer_norm(x + r).float() * 2, then a matmul: x and r come from outside; the sum and the
# norm's output live only inside the run; the float32 result is read by the matmul after it.
CHAIN = [
    _op(0, "aten.add.Tensor", [X, X], [X]),
    _op(1, "aten.native_layer_norm.default", [X, W, W], [X]),
    _op(2, "aten.view.default", [X], [X]),
    _op(3, "aten._to_copy.default", [X], [F32]),
    _op(4, "aten.mul.Tensor", [F32], [F32]),
    _op(5, "aten.mm.default", [F32, ("float32", (768, 768))], [F32], flops=2 * 8192 * 768 * 768),
]
STORAGES = [
    _storage(0, *X, 0, 1),      # x + r: read by the norm, freed after it
    _storage(1, *X, 1, 3),      # the norm's output: freed after the cast
    _storage(2, *F32, 3, 4),    # the cast: freed after the mul
    _storage(3, *F32, 4, 5),    # the mul's result: read by the matmul
    _storage(4, *F32, 5, None),
]


def test_a_run_of_compiled_ops_between_matmuls_is_one_kernel():
    assert fused_runs(CHAIN) == [[0, 1, 2, 3, 4]]
    # Not compiled: nothing fuses. A phase change or an op with FLOPs ends a run.
    eager = [_op(o.index, o.op, [(m.dtype, m.shape) for m in o.inputs],
                 [(m.dtype, m.shape) for m in o.outputs], compiled=False) for o in CHAIN]
    assert fused_runs(eager) == []
    split = [*CHAIN[:2], _op(2, "aten.mul.Tensor", [X], [X], phase=Phase.BACKWARD)]
    assert fused_runs(split) == [[0, 1], [2]]
    # A run of views alone launches nothing: no kernel.
    assert fused_runs([_op(0, "aten.view.default", [X], [X])]) == []


def test_a_fused_kernel_reads_its_inputs_once_and_writes_what_outlives_it():
    x = 8 * 1024 * 768 * 2
    # Reads: x and r (the add's), the norm's weight and bias (its activation input is the
    # add's output, made inside). Writes: the mul's float32 result alone (read by the matmul).
    expected = 2 * x + 2 * 768 * 2 + 2 * x
    assert kernel_bytes(CHAIN[:5], made_by(STORAGES)) == expected
    # Without the step's storages, every output counts: the add's, the norm's and the cast's
    # too (x + x + 2x more).
    assert kernel_bytes(CHAIN[:5], {}) == expected + x + x + 2 * x
    # Eager, the same ops move: add 3x, the norm 2x and its weights, the view nothing, the
    # cast 3x (reads 2 bytes an element, writes 4), the mul 4x: three times as much.
    eager = sum(op_time(o, A100, P).bytes for o in CHAIN[:5])
    assert eager == 12 * x + 2 * 768 * 2
    assert eager - expected == 8 * x


def test_fused_time_by_hand_and_spread_over_its_ops():
    timed = [op_time(o, A100, P) for o in CHAIN]
    eager = [t.seconds for t in timed]
    assert fuse(timed, CHAIN, STORAGES, A100, P) == 1
    nbytes = 4 * 8 * 1024 * 768 * 2 + 2 * 768 * 2
    kernel = nbytes / (A100.bandwidth_bytes_per_s * P["bandwidth"]) + P["launch_s"]
    assert sum(t.seconds for t in timed[:5]) == pytest.approx(kernel)
    assert timed[5].seconds == eager[5]  # the matmul is its own kernel, unchanged
    assert timed[2].seconds == 0 and timed[2].bound == "none"  # the view
    # Each op keeps its eager share: the cast and mul moved more than the add.
    shares = [t.seconds / kernel for t in timed[:5]]
    assert shares == pytest.approx([e / sum(eager[:5]) for e in eager[:5]])
    assert {t.bound for t in timed[:5] if t.seconds} == {"memory"}


def test_a_tiny_kernel_is_bound_by_its_launch():
    tiny = [_op(0, "aten.add.Tensor", [W, W], [W]), _op(1, "aten.mul.Tensor", [W], [W])]
    timed = [op_time(o, A100, P) for o in tiny]
    fuse(timed, tiny, [_storage(0, *W, 0, 1), _storage(1, *W, 1, None)], A100, P)
    assert sum(t.seconds for t in timed) == pytest.approx(P["compiled_host_s"] + P["launch_s"])
    assert {t.bound for t in timed} == {"launch"}


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    how = sys.argv[1]
    if how != "eager":
        model = torch.compile(model, **({"backend": how} if how != "inductor" else {}))
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    opt.step()
""")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    script = tmp_path_factory.mktemp("compiled") / "train.py"
    script.write_text(SCRIPT)
    return {how: run_script(str(script), [how], device="cuda")
            for how in ("inductor", "eager", "aot_eager")}


def test_the_compiled_model_s_forward_and_backward_ops_are_marked(traces):
    trace = traces["inductor"]
    marked = {(str(o.phase), o.module) for o in trace.ops if o.compiled}
    # Every op of the model's four modules, forward and backward; not the loss outside it,
    # nor the optimizer.
    assert marked == {(p, m) for p in ("forward", "backward") for m in ("0", "1", "2", "3")}
    for o in trace.ops:
        assert o.compiled == (o.module in ("0", "1", "2", "3")), (o.op, o.phase, o.module)


def test_another_backend_fuses_nothing_and_eager_is_unmarked(traces):
    assert not any(o.compiled for o in traces["aot_eager"].ops)
    assert not any(o.compiled for o in traces["eager"].ops)


def test_the_predicted_step_counts_the_compiled_kernels(traces):
    compiled, eager = (step_time(traces[h], A100) for h in ("inductor", "eager"))
    # Forward: GELU and LayerNorm between the two addmms make one kernel; the note counts
    # every run fused_runs finds in the step.
    runs = fused_runs([o for o in traces["inductor"].ops if str(o.phase) in
                       ("forward", "backward", "optimizer")])
    assert any(f"costed as {len(runs)} fused Inductor kernels" in n for n in compiled.notes)
    assert not any("Inductor" in n for n in eager.notes)
    assert compiled.seconds < eager.seconds


def test_the_compile_setting_part_round_trips_and_marks_a_built_in_model():
    from ampscope.precision.setting import parse_setting

    s = parse_setting("cuda:fp32+compile+amp-bf16")
    assert (s.name, s.compiled) == ("cuda:fp32+amp-bf16+compile", True)
    assert parse_setting("fp32").compiled is False
    trace = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16+compile", workload="train",
                           batch=2, seq=16, predict=True)
    step = [o for o in trace.ops if str(o.phase) in ("forward", "backward", "optimizer")]
    # The model's forward and backward are compiled code; the optimizer's step is not.
    assert all(o.compiled for o in step if str(o.phase) == "forward")
    assert any(o.compiled for o in step if str(o.phase) == "backward")
    assert not any(o.compiled for o in step if str(o.phase) == "optimizer")
    eager = ampscope.trace("gpt2-tiny", setting="cuda:fp32+amp-bf16", workload="train",
                           batch=2, seq=16, predict=True)
    assert not any(o.compiled for o in eager.ops)
    # The same ops in the same dtypes: compiling changes how they run, not what runs.
    assert [(o.op, o.outputs) for o in eager.ops] == [(o.op, o.outputs) for o in trace.ops]
    assert step_time(trace, A100).seconds < step_time(eager, A100).seconds


def test_the_compile_setting_leaves_the_user_s_module_as_it_was():
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    forward = model.forward
    trace = ampscope.trace(model, setting="fp32+compile", workload="forward",
                           inputs=torch.randn(4, 8))
    assert all(o.compiled for o in trace.ops if str(o.phase) == "forward")
    assert "forward" not in vars(model) and model.forward == forward


def test_a_compiled_setting_s_trace_says_what_compile_means_here():
    trace = ampscope.trace("gpt2-tiny", setting="fp32+compile", workload="forward", seq=8)
    assert any(n.startswith("+compile: the model ran eagerly") for n in trace.notes)
    plain = ampscope.trace("gpt2-tiny", setting="fp32", workload="forward", seq=8)
    assert not any("+compile" in n for n in plain.notes)
