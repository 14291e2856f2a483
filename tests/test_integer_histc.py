"""Integer `histc` as CUDA counts it (runtime/integer_histc.py): against counts worked by hand,
PyTorch's own CPU kernel on the same values in float64 (exact where the bins' edges are), its
own errors, and an emulated CUDA trace of a transformers mixture-of-experts model, which counts
its tokens per expert so on CUDA."""

from __future__ import annotations

import pytest
import torch

import ampscope
from ampscope.runtime.integer_histc import integer_histc
from ampscope.torchcompat.fake import FakeTensorMode


def test_counts_worked_by_hand():
    """Bins of width 7/4 over [0, 7]: x goes to bin x·4 // 7, 7 to the last bin; 9 and -1 lie
    outside and are not counted. The counts keep the input's dtype, as CUDA's do."""
    x = torch.tensor([0, 1, 1, 3, 2, 2, 2, 7, 9, -1], dtype=torch.int32)
    with integer_histc():
        counts = torch.histc(x, bins=4, min=0, max=7)
    assert counts.dtype == torch.int32
    assert counts.tolist() == [3, 4, 0, 1]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("bins, low, high", [(8, 0, 64), (16, 16, 48), (4, 0, 0), (5, 3, 3)])
def test_the_counts_of_pytorchs_own_kernel_on_the_values_in_float64(dtype, bins, low, high):
    """Edges on powers of two, so the float64 kernel's bins are exact too; equal bounds take
    the data's own range (0 to 64 here) in both. 250 values: no count past a uint8's."""
    values = torch.randint(0, 65, (250,), generator=torch.Generator().manual_seed(0))
    values[:2] = torch.tensor([0, 64])
    with integer_histc():
        counts = torch.histc(values.to(dtype), bins=bins, min=low, max=high)
    expected = torch.histc(values.double(), bins=bins, min=low, max=high)
    assert counts.dtype == dtype
    assert counts.tolist() == expected.long().tolist()


def test_floating_tensors_run_pytorchs_own_kernel():
    values = torch.randn(500, generator=torch.Generator().manual_seed(1))
    expected = torch.histc(values, bins=13, min=-2, max=2)
    with integer_histc():
        assert torch.equal(torch.histc(values, bins=13, min=-2, max=2), expected)


@pytest.mark.parametrize("bins, low, high", [(0, 0, 5), (4, 5, 0)])
def test_bad_arguments_fail_in_pytorchs_own_words(bins, low, high):
    with pytest.raises(RuntimeError) as theirs:
        torch.histc(torch.zeros(3), bins=bins, min=low, max=high)
    with integer_histc(), pytest.raises(RuntimeError) as ours:
        torch.histc(torch.zeros(3, dtype=torch.int32), bins=bins, min=low, max=high)
    assert str(ours.value) == str(theirs.value)


def test_a_fake_tensor_gets_the_counts_shape_and_dtype():
    with integer_histc() as fake_too, FakeTensorMode() as mode:
        if not fake_too:
            pytest.skip("this torch refuses to replace PyTorch's meta kernel of histc")
        fake = mode.from_tensor(torch.zeros(10, dtype=torch.int32))
        counts = torch.histc(fake, bins=6, min=0, max=5)
    assert (tuple(counts.shape), counts.dtype) == ((6,), torch.int32)


def test_pytorchs_own_kernels_are_back_afterwards_also_after_an_error():
    with pytest.raises(ValueError), integer_histc():
        raise ValueError
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        torch.histc(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("predict", [True, False])
def test_an_emulated_cuda_moe_layer_counts_its_experts_tokens_as_on_the_gpu(tmp_path, predict):
    """transformers' experts count the tokens routed to each with `histc` of the int32 expert
    ids on CUDA (of float ids on the CPU). The emulated run records that one op, as the script
    called it, and none of the kernel's own."""
    transformers = pytest.importorskip("transformers")
    with integer_histc() as fake_too:
        if predict and not fake_too:
            pytest.skip("this torch refuses to replace PyTorch's meta kernel of histc")
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=64, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    trace = ampscope.trace(f"hf:{tmp_path}", setting="cuda:bf16", seq=8, batch=2,
                           workload="forward", predict=predict)
    counted = [(o.inputs[0].dtype, o.outputs[0].dtype, o.outputs[0].shape)
               for o in trace.ops if o.op == "aten.histc.default"]
    assert counted == [("int32", "int32", (4,))] * 2
    assert not any("bincount" in o.op for o in trace.ops)
