"""Settings: the grammar, canonical names, availability, and exact restore of global state."""

from __future__ import annotations

import pytest
import torch

from ampscope.errors import AmpscopeError
from ampscope.precision import GRAMMAR, GlobalState, applied, parse_setting, resolve_device
from ampscope.precision.matmul import matmul_precision

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("text", "name", "params", "amp", "matmul"),
    [
        ("fp32", "fp32", torch.float32, None, "highest"),
        ("bf16", "bf16", torch.bfloat16, None, "highest"),
        ("fp16", "fp16", torch.float16, None, "highest"),
        ("fp32+amp-bf16", "fp32+amp-bf16", torch.float32, torch.bfloat16, "highest"),
        ("bf16+amp-bf16", "bf16+amp-bf16", torch.bfloat16, torch.bfloat16, "highest"),
        ("fp32+amp-fp16", "fp32+amp-fp16", torch.float32, torch.float16, "highest"),
        ("fp32+tf32", "fp32+tf32", torch.float32, None, "high"),
        ("cpu:fp32+amp-bf16", "fp32+amp-bf16", torch.float32, torch.bfloat16, "highest"),
        (" FP32+TF32+AMP-BF16 ", "fp32+amp-bf16+tf32", torch.float32, torch.bfloat16, "high"),
    ],
)
def test_parse(text, name, params, amp, matmul):
    s = parse_setting(text)
    assert (s.name, s.device, s.param_dtype, s.autocast_dtype, s.matmul_precision) == (
        name, "cpu", params, amp, matmul)


def test_device_prefix_is_kept_in_the_name():
    s = parse_setting("cuda:fp32+amp-fp16")
    assert (s.device, s.name) == ("cuda", "cuda:fp32+amp-fp16")


@pytest.mark.parametrize("bad", ["", "fp8", "fp32+amp-fp32", "fp32+amp-int8", "tpu:fp32",
                                 "fp32+tf32+tf32", "fp32++amp-bf16", "fp32+amp-bf16+amp-fp16"])
def test_malformed_settings_show_the_grammar(bad):
    with pytest.raises(AmpscopeError) as e:
        parse_setting(bad)
    assert GRAMMAR in str(e.value)
    assert "\n" not in str(e.value)


def test_to_dict_matches_the_json_contract():
    assert parse_setting("fp32+amp-bf16").to_dict() == {
        "name": "fp32+amp-bf16", "device": "cpu", "emulated": False,
        "param_dtype": "float32", "autocast_dtype": "bfloat16", "matmul_precision": "highest",
        "torch": torch.__version__,  # the build whose autocast policy a run follows
        "fp8": None,
        "fsdp_param_dtype": None, "fsdp_reduce_dtype": None,  # an FSDP2 policy's, as run
        "gpu": None,  # the GPU a run that emulates one stood for
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_setting_without_cuda_is_emulated():
    setting = resolve_device(parse_setting("cuda:fp32+amp-bf16"))
    assert setting.emulated and setting.device == "cuda" and setting.run_device == "cpu"
    assert setting.to_dict()["emulated"] is True
    assert not resolve_device(parse_setting("fp32")).emulated


def test_plain_amp_takes_the_devices_default_autocast_dtype():
    # CUDA's default autocast dtype is float16, the CPU's bfloat16 (read from the build).
    assert parse_setting("cuda:fp32+amp").autocast_dtype == torch.float16
    assert parse_setting("cuda:fp32+amp").name == "cuda:fp32+amp-fp16"
    assert parse_setting("fp32+amp").autocast_dtype == torch.bfloat16


def test_unknown_device_and_device_without_policy_are_refused():
    with pytest.raises(AmpscopeError, match="unknown device 'tpu'"):
        parse_setting("tpu:fp32")
    # "xla" is a device type torch knows, but not one ampscope runs or emulates.
    with pytest.raises(AmpscopeError, match="'xla' .* not one ampscope can run or emulate"):
        parse_setting("xla:fp32")


def test_applied_restores_global_state_after_an_error():
    torch.set_float32_matmul_precision("medium")
    torch.manual_seed(123)
    before = GlobalState.save()
    try:
        with pytest.raises(RuntimeError, match="boom"), applied(parse_setting("fp32+tf32")):
            assert matmul_precision() == "high"
            torch.set_default_dtype(torch.float64)
            torch.set_autocast_enabled("cpu", True)
            torch.set_autocast_dtype("cpu", torch.float16)
            torch.set_grad_enabled(False)
            torch.rand(10)  # advances the RNG
            raise RuntimeError("boom")
        after = GlobalState.save()
        assert after.fp32_precision == before.fp32_precision
        assert torch.get_float32_matmul_precision() == "medium"
        assert after.default_dtype == torch.float32
        assert after.autocast == before.autocast
        assert after.grad_enabled is True
        assert torch.equal(after.cpu_rng, before.cpu_rng)
    finally:
        torch.set_float32_matmul_precision("highest")


def test_bf16_setting_converts_a_copy_and_restores_the_users_tensors():
    model = torch.nn.Linear(4, 4)
    storage = model.weight.data_ptr()
    values = model.weight.detach().clone()
    with applied(parse_setting("bf16"), model):
        assert model.weight.dtype == torch.bfloat16
        model.weight.data.add_(1)  # an optimizer step on the run's copy
    assert model.weight.data_ptr() == storage  # the user's own memory, not a copy
    assert model.weight.dtype == torch.float32
    assert torch.equal(model.weight.data, values)


# --- run options: one object, checked once, the same error for the API and the CLI -----------


def test_run_options_refuse_bad_values_before_anything_is_built():
    import ampscope
    from ampscope.errors import AmpscopeError
    from ampscope.workloads import RunOptions

    for kwargs, message in (({"seq": 0}, "got seq=0"), ({"batch": True}, "got batch=True"),
                            ({"workload": "pretrain"}, "unknown workload 'pretrain'"),
                            ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
                            ({"seed": 1.5}, "seed must be an integer")):
        with pytest.raises(AmpscopeError, match=message):
            RunOptions(**kwargs)
        # The API checks through the same object: a name that resolves to no model is never
        # reached, so the options' error comes first.
        with pytest.raises(AmpscopeError, match=message):
            ampscope.trace("no-such-model", **kwargs)


def test_run_options_round_trip_as_keyword_arguments():
    from ampscope.workloads import RunOptions

    options = RunOptions("forward", batch=2, seq=8, new_tokens=3, seed=7, predict=True)
    assert RunOptions(**options.as_kwargs()) == options
    assert options.workload_name == "forward"
    assert RunOptions(lambda module, batch: None).workload_name == "<lambda>"


def test_native_keeps_the_parameter_dtypes_the_model_chose():
    """A model that makes its embedding and first Linear bf16 and asserts it: `native` keeps
    every parameter as made (its assertion holds), where `fp32` converts the bf16 majority."""
    import ampscope

    class Chooses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8).to(torch.bfloat16)
            self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
            self.head = torch.nn.Linear(8, 16)

        def forward(self, idx):
            assert self.emb.weight.dtype == torch.bfloat16, "the model's own bf16 embedding"
            return self.head(self.proj(self.emb(idx)).float())

    model = Chooses()
    made = {n: p.dtype for n, p in model.named_parameters()}
    ids = torch.zeros(2, 4, dtype=torch.long)
    for name in ("native", "native+amp-bf16", "cuda:native+amp-bf16"):
        t = ampscope.trace(model, ids, setting=name, workload="forward")
        assert t.setting.name == name and t.setting.param_dtype is None
        assert {p.name: p.dtype for p in t.parameters} == {n: str(d).removeprefix("torch.")
                                                            for n, d in made.items()}
    with pytest.raises(AssertionError, match="own bf16 embedding"):
        ampscope.trace(model, ids, setting="fp32", workload="forward")
    assert {n: p.dtype for n, p in model.named_parameters()} == made
