"""Capture on tiny CPU models: the dtype facts PyTorch really produces, asserted from the trace."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

import ampscope
from ampscope.models import gpt2


def linear_weights(trace) -> set[str]:
    return {p.name for p in trace.parameters if p.name.endswith(".weight") and len(p.shape) == 2
            and "wte" not in p.name and "wpe" not in p.name} | {"lm_head.weight"}


def test_gpt2_amp_bf16_train_step_is_what_pytorch_does():
    """The issue's reference case, on the real 124M gpt2 (batch 1, seq 32)."""
    t = ampscope.trace("gpt2", setting="fp32+amp-bf16", workload="train", seq=32)
    assert t.model.parameters == 124_439_808
    # parameters fp32
    assert {p.dtype for p in t.parameters} == {"float32"}
    # every Linear's output is bf16 in the forward pass
    linears = [m for m in t.modules if m.type == "Linear" and m.phase == "forward"]
    assert len(linears) == 12 * 4 + 1
    assert {m.outputs[0].dtype for m in linears} == {"bfloat16"}
    # LayerNorm runs on the fp32 residual stream (CPU autocast: layer_norm follows its input)
    assert {m.outputs[0].dtype for m in t.modules if m.type == "LayerNorm"
            and m.phase == "forward"} == {"float32"}
    # loss fp32
    assert [(o.name, o.dtype) for o in t.outputs] == [("loss", "float32")]
    # gradients fp32, one per parameter
    assert {p.grad_dtype for p in t.parameters} == {"float32"}
    # AdamW state fp32
    keys = {(s.key, s.dtype) for s in t.optimizer_state}
    assert keys == {("step", "float32"), ("exp_avg", "float32"), ("exp_avg_sq", "float32")}
    # autocast inserted a bf16 cast of every Linear weight (wte's, via the tied lm_head)
    cast_weights = {o.input_names[0] for o in t.ops
                    if o.autocast_cast and o.outputs[0].dtype == "bfloat16" and o.input_names[0]}
    assert {"transformer.wte.weight"} | {n for n in linear_weights(t) if n != "lm_head.weight"} \
        <= cast_weights
    # ... and those casts are aten._to_copy ops in the forward phase
    assert {o.op for o in t.ops if o.autocast_cast} == {"aten._to_copy.default"}
    assert {o.phase for o in t.ops if o.autocast_cast} == {"forward"}


def test_phases_are_labelled(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="fp32", workload="train", seq=8)
    phases = [o.phase for o in t.ops]
    # forward first, then backward, then optimizer, never interleaved
    first_back, first_opt = phases.index("backward"), phases.index("optimizer")
    assert set(phases[:first_back]) == {"forward"}
    assert set(phases[first_back:first_opt]) == {"backward"}
    assert set(phases[first_opt:]) == {"optimizer"}
    assert all(o.grad_fn for o in t.ops if o.phase == "backward" and o.op != "aten.ones_like.default")
    backward_modules = [m for m in t.modules if m.phase == "backward"]
    assert backward_modules[0].name == ""  # the model's backward starts first
    assert {m.name for m in backward_modules} >= {"lm_head", "transformer.h.0.attn.c_attn"}


def test_pure_bf16_train_step(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="bf16", workload="train", seq=8)
    assert {p.dtype for p in t.parameters} == {"bfloat16"}
    assert {p.grad_dtype for p in t.parameters} == {"bfloat16"}
    assert {s.dtype for s in t.optimizer_state if s.key != "step"} == {"bfloat16"}
    assert not any(o.autocast_cast for o in t.ops)


def test_nanochat_dtype_choices(nanochat_tiny):
    t = ampscope.trace(nanochat_tiny, setting="fp32+amp-bf16", workload="train", seq=16)
    assert {(b.name, b.dtype) for b in t.buffers} == {("cos", "bfloat16"), ("sin", "bfloat16")}
    assert [(i.name, i.dtype) for i in t.inputs] == [("idx", "int32"), ("targets", "int64")]
    # logits go back to fp32 before cross-entropy: an explicit .float() in the model's code
    ce = [c for c in t.calls if c.func.endswith("cross_entropy")]
    assert ce and ce[0].inputs[0].dtype == "float32"
    casts = [f for f in t.findings if f.cause == "explicit-cast"]
    assert any("bfloat16 → float32" in f.text and f.source.startswith("nanochat.py:")
               for f in casts)
    # the source line really is a `.float()`
    line = int(casts[0].source.split(":")[1])
    from pathlib import Path

    import ampscope.models.nanochat as nc
    assert ".float()" in Path(nc.__file__).read_text().splitlines()[line - 1]


def test_nanochat_samples_with_int64_ids_through_its_kv_cache(nanochat_tiny):
    t = ampscope.trace(nanochat_tiny, setting="fp32+amp-bf16", workload="generate", seq=8,
                       new_tokens=3)
    assert [(i.name, i.dtype) for i in t.inputs] == [("idx", "int64")]
    assert {o.phase for o in t.ops} == {"forward"}
    root_calls = [m for m in t.modules if m.depth == 0]
    assert len(root_calls) == 3  # prefill, then one call per further token through the cache
    assert [tuple(m.inputs[0].shape) for m in root_calls] == [(1, 8), (1, 1), (1, 1)]


@pytest.mark.fast
def test_forward_workload_has_no_backward_and_no_gradients(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="forward", seq=8)
    assert {o.phase for o in t.ops} == {"forward"}
    assert all(p.grad_dtype is None for p in t.parameters)
    assert not t.optimizer_state
    assert [(o.name, o.dtype) for o in t.outputs] == [("logits", "bfloat16")]


def test_fp16_autocast_uses_a_grad_scaler():
    model = gpt2.load("gpt2-tiny")
    t = ampscope.trace(model, setting="fp32+amp-fp16", workload="train", seq=4)
    assert any("non_finite_check_and_unscale" in o.op for o in t.ops if o.phase == "optimizer")
    assert {m.outputs[0].dtype for m in t.modules if m.type == "Linear"
            and m.phase == "forward"} == {"float16"}


@pytest.mark.fast
def test_records_hold_no_tensors_and_round_trip_through_json(gpt2_tiny):
    t = ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="train", seq=8)

    def walk(value):
        assert not isinstance(value, (torch.Tensor, nn.Module, torch.optim.Optimizer))
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(t)
    again = ampscope.Trace.from_dict(t.to_dict())
    assert again.to_dict() == t.to_dict()


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_a_predicted_trace_keeps_no_tensor_alive(gpt2_tiny):
    """Predicted (the default): no batch, weight copy or gradient is kept, real or fake."""
    ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="train", seq=8)  # warm-up
    before = live_tensors()
    traces = [ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="train", seq=8)
              for _ in range(2)]
    assert all(t.mode == "predict" and t.ops for t in traces)
    assert live_tensors() <= before


def test_a_predicted_trace_leaves_no_fake_mode_behind(gpt2_tiny):
    """The FakeTensorMode of a predicted run, and what its converter holds (a fake constant per
    Adam step counter), goes with the run: a process that predicts step after step (`fit`, a
    sweep in a notebook) does not grow."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def modes() -> int:
        gc.collect()
        return sum(type(o) is FakeTensorMode for o in gc.get_objects())

    ampscope.trace(gpt2_tiny, setting="cuda:bf16", workload="train", seq=8)  # warm-up
    before = modes()
    traces = [ampscope.trace(gpt2_tiny, setting="cuda:bf16", workload="train", seq=8)
              for _ in range(2)]
    assert all(t.mode == "predict" for t in traces)
    assert modes() == before


def test_trace_keeps_no_activation_alive(gpt2_tiny):
    ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="train", seq=8,
                   predict=False)  # warm-up
    before = live_tensors()
    traces = [ampscope.trace(gpt2_tiny, setting="fp32+amp-bf16", workload="train", seq=8,
                             predict=False) for _ in range(2)]
    # A leak would keep the batch, activations or gradients of each step: dozens of tensors.
    assert all(t.ops for t in traces) and live_tensors() <= before


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, y=None):
        h = self.norm(self.fc1(x))
        out = self.fc2(h)
        return out if y is None else nn.functional.mse_loss(out.float(), y)


@pytest.mark.fast
def test_capture_records_the_users_own_training_step():
    torch.manual_seed(0)
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    with ampscope.capture(model) as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert [(i.name, i.role, i.dtype) for i in t.inputs] == [
        ("x", "input", "float32"), ("y", "target", "float32")]
    assert [(m.name, m.outputs[0].dtype) for m in t.modules if m.phase == "forward"] == [
        ("", "float32"), ("fc1", "bfloat16"), ("norm", "bfloat16"), ("fc2", "bfloat16")]
    assert {(s.key, s.dtype) for s in t.optimizer_state} == {("momentum_buffer", "float32")}
    # gradient clipping and the SGD step both count as the optimizer phase
    clip = [c for c in t.calls if "norm" in c.func and c.phase == "optimizer"]
    assert clip
    assert any(f.cause == "explicit-cast" for f in t.findings)
    # the user's model was trained for real: capture only watches
    assert model.fc1.weight.grad is not None


def test_trace_a_plain_module_with_a_custom_step():
    torch.manual_seed(0)
    model = TwoLayer()
    batch = {"x": torch.randn(3, 8), "y": torch.randn(3, 4)}

    def step(module, b):
        module(b["x"], b["y"]).backward()

    t = ampscope.trace(model, batch, setting="bf16+amp-bf16", workload=step)
    assert t.workload == "step"
    assert {p.dtype for p in t.parameters} == {"bfloat16"}
    assert {p.grad_dtype for p in t.parameters} == {"bfloat16"}
    # the explicit .float() before the loss shows up with its line in this file
    assert any(f.cause == "explicit-cast" and f.source.startswith("test_capture.py:")
               for f in t.findings)
    assert model.fc1.weight.dtype == torch.float32 and model.fc1.weight.grad is None


def test_explicit_casts_repeated_in_every_block_make_one_finding():
    """Llama's RMSNorm casts to fp32 and back in every layer at the same two lines: one finding
    per line with its blocks collapsed, not one per layer (predicted: only dtypes matter)."""
    pytest.importorskip("transformers")
    t = ampscope.trace("smollm2-135m", setting="bf16", workload="forward", seq=8, predict=True)
    casts = [f for f in t.findings if f.cause == "explicit-cast"]
    sources = [f.source for f in casts]
    assert len(sources) == len(set(sources))  # one finding per source line
    norm = [f for f in casts if "model.layers.0–29.input_layernorm" in f.text]
    assert len(norm) == 2  # to float32, and back to bfloat16
    assert all("(61×)" in f.text for f in norm)  # 30 layers × 2 norms + the final norm


def test_records_built_from_rows_are_the_records_their_init_builds():
    """`records.from_rows` (the recorders' fast path) makes the same frozen record as the
    dataclass's own constructor: of its class, equal, hashing alike, every field set, still
    frozen."""
    import dataclasses

    from ampscope.records import FunctionCall, OpCall, StorageRecord, TensorMeta, from_rows

    meta = (TensorMeta("float32", (2, 3)),)
    rows = {
        OpCall: (4, "aten.mm.default", "h.0.mlp", "forward", meta * 2, meta, False, 3,
                 "model.py:9", ("h.0.mlp.weight", None), None, 48, 48, (), "tf32", None,
                 (0.5,), True, (0, 7)),
        FunctionCall: (3, "torch.nn.functional.linear", "h.0.mlp", "forward", meta, meta,
                       "model.py:9", "bfloat16", 1),
        StorageRecord: (0, 24, "float32", (2, 3), 4, 7, "activation", ("x",), "h.0", "forward",
                        "aten.mm.default", True),
    }
    for cls, row in rows.items():
        [fast], slow = from_rows(cls, [row]), cls(*row)
        assert type(fast) is cls
        assert fast == slow and hash(fast) == hash(slow)
        names = [f.name for f in dataclasses.fields(cls)]
        assert tuple(getattr(fast, name) for name in names) == row
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(fast, names[0], 9)
        with pytest.raises(ValueError):  # a row missing a field is refused, never half-filled
            from_rows(cls, [row[:-1]])


def test_torch_level_calls_are_named_as_user_code_spells_them():
    from ampscope.runs.functions import func_name

    assert func_name(torch._foreach_norm) == "torch._foreach_norm"  # not _VariableFunctionsClass
    assert func_name(torch.mm) == "torch.mm"  # not torch.spmm
    assert func_name(torch.nn.functional.linear) == "torch.nn.functional.linear"
    assert func_name(torch.Tensor.float) == "Tensor.float"


def test_phases_and_categories_are_named_and_read_as_their_strings():
    """Records carry `Phase` and `StorageCategory` members; each is its string for every reader
    (==, dict keys, f-strings, JSON, CSV), and a document read back carries members again."""
    import json

    from ampscope.records import Phase, StorageCategory, Trace

    t = ampscope.trace("gpt2-tiny", seq=8, setting="fp32", predict=True)
    phases = {o.phase for o in t.ops}
    assert phases == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    assert all(type(o.phase) is Phase for o in t.ops)
    assert all(type(s.category) is StorageCategory for s in t.storages)
    assert {"forward": 1}[Phase.FORWARD] == 1 and f"{Phase.BACKWARD}" == "backward"
    document = json.loads(t.to_json())
    assert {o["phase"] for o in document["ops"]} == {"forward", "backward", "optimizer"}
    back = Trace.from_dict(document)
    assert [o.phase for o in back.ops] == [o.phase for o in t.ops]
    assert all(type(o.phase) is Phase for o in back.ops)
    assert "forward" in t.table("ops").to_csv().splitlines()[1].split(",")


def test_a_row_replacer_gives_what_replace_gives():
    """records.RowLayout.replacer (the replay's hot loop) and replace (the plain way) agree,
    field for field, on an OpCall row; an unknown field is refused."""
    from ampscope.records import OP_ROW, OpCall, TensorMeta

    meta = (TensorMeta("float32", (2, 3)),)
    row = (5, "aten.mm.default", "h.0.attn", "forward", meta, meta, False, 3, "m.py:1",
           ("h.0.attn.weight",), None, 12, 12, (), "ieee", None, (), False, None)
    assert len(row) == len(OP_ROW.fields)
    fast = OP_ROW.replacer("index", "module", "caller", "input_names")
    changed = fast(row, 9, "h.1.attn", None, ("h.1.attn.weight",))
    assert changed == OP_ROW.replace(row, index=9, module="h.1.attn", caller=None,
                                     input_names=("h.1.attn.weight",))
    assert OpCall(*changed).module == "h.1.attn" and OpCall(*changed).op == row[1]
    with pytest.raises(KeyError):
        OP_ROW.replacer("nosuch")
