"""`ampscope run --nproc 2 [--predict]` on a torchrun script that trains with torchao's float8
recipe under FSDP2: every rank's collectives and held bytes, real (gloo) and predicted (fake
process group), equal to the byte and equal to what torchao and FSDP2 send by hand.

The script converts Linear(16, 32) and Linear(32, 16) (dims multiples of 16, as fp8 matmuls
need) with `convert_to_float8_training`, shards each layer and the root with
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` and runs AdamW. The truth,
read from the sources in the venv:

- torchao/float8/float8_linear.py `Float8Linear.from_float`: with
  `enable_fsdp_float8_all_gather=True` each weight becomes a `WeightWithDynamicFloat8CastTensor`;
  its `fsdp_pre_all_gather` (torchao/float8/fsdp_utils.py) casts the rank's float32 shard to
  float8_e4m3fn with a scale from the amax, which `tensor_to_amax` (float8_utils.py) first
  all-reduces (MAX, one float32 scalar: 4 B) over the mesh's group; the scale travels as
  metadata, not in the all-gather. It runs before every all-gather, forward and backward.
- torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_all_gather`: a group's
  inputs are all-gathered in their dtype when they share one, else as bytes (uint8,
  `_get_all_gather_input_metadatas`): a float8 weight with its bfloat16 bias goes as uint8.
  Reduce-scatters take the unsharded gradients in `reduce_dtype`.
- Shards (2 ranks, dim 0, padded to ceil(rows/2)): Linear(16, 32) weight 16×16 per rank, bias
  16; Linear(32, 16) weight 8×32, bias 8. Parameters 512 + 32 + 512 + 16 = 1072 float32 values.
"""

from __future__ import annotations

import pytest

from tests.test_run_nproc import _ampscope, _script, _validated

pytest.importorskip("torchao.float8")

SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

device, gather, first_bias = sys.argv[1], sys.argv[2], sys.argv[3] == "bias"
dist.init_process_group("nccl")
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32, bias=first_bias), nn.ReLU(), nn.Linear(32, 16))
model = model.to(device)
config = Float8LinearConfig(enable_fsdp_float8_all_gather=gather == "fp8")
convert_to_float8_training(model, config=config)
assert type(model[0]).__name__ == type(model[2]).__name__ == "Float8Linear"
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in (model[0], model[2]):
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(16, 16, device=device)).float().sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""

# By hand (module docstring): each rank holds half of the 1072 float32 values, 536 · 4 B; its
# gradients alike; AdamW two moments of the shard plus a float32 step per parameter.
HELD = {"parameter": {"float32": 2144}, "gradient": {"float32": 2144},
        "optimizer_state": {"float32": 2 * 2144 + 4 * 4}}
# The amax of a weight shard, all-reduced before its all-gather: one float32.
AMAX = 4
# Reduce-scatters, float32, the unsharded gradients of each layer: backward runs layer 2 first,
# (512 + 16) · 4 B, then layer 0, (512 + 32) · 4 B.
REDUCE = [("reduce_scatter", "backward", "float32", 528 * 4),
          ("reduce_scatter", "backward", "float32", 544 * 4)]


def _calls(rank: dict) -> list[tuple]:
    return [(c["kind"], c["phase"], c["dtype"], c["payload_bytes"]) for c in rank["collectives"]]


def _facts(document: dict) -> list[tuple]:
    return [(r["rank"], _calls(r), r["held"]) for r in document["ranks"]]


def _runs(tmp_path, capsys, device: str, *script_args: str,
          modes: tuple[tuple[str, ...], ...] = ((), ("--predict",))) -> list[dict]:
    """The report of each run (real, predicted), with rank 0's printed report as "text"."""
    script = _script(tmp_path, SCRIPT)
    documents = []
    for extra in modes:
        out = tmp_path / f"ranks{len(extra)}.json"
        code, text, err = _ampscope(capsys, "--nproc", "2", *extra, "--device", device,
                                    "--json", str(out), str(script), device, *script_args)
        assert code == 0, err
        documents.append({**_validated(out), "text": " ".join(text.split())})
    return documents


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float8_all_gather_real_equals_predicted(device, tmp_path, capsys):
    real, predicted = _runs(tmp_path, capsys, device, "fp8", "bias")
    assert real["mode"] == "run" and predicted["mode"] == "predict"
    # Each layer's group holds a float8 weight and a bfloat16 bias: all-gathered as uint8.
    # Layer 0: 2 ranks × (16·16 fp8 B + 16 bf16 · 2 B) = 576; layer 2: 2 × (8·32 + 8·2) = 544.
    # FSDP2 re-gathers both in backward (resharded after forward), layer 2 first.
    expected = [("all_reduce", "forward", "float32", AMAX),
                ("all_gather", "forward", "uint8", 576),
                ("all_reduce", "forward", "float32", AMAX),
                ("all_gather", "forward", "uint8", 544),
                ("all_reduce", "backward", "float32", AMAX),
                ("all_gather", "backward", "uint8", 544),
                ("all_reduce", "backward", "float32", AMAX),
                ("all_gather", "backward", "uint8", 576), *REDUCE]
    assert _facts(real) == [(0, expected, HELD), (1, expected, HELD)]
    assert _facts(predicted) == _facts(real)
    assert [r["ran"] for r in predicted["ranks"]] == [True, True]
    assert real["unshard_dtypes"] == predicted["unshard_dtypes"] == ["uint8"]
    assert "AMP102" not in real["text"]  # float8 weights all-gathered: nothing to say
    assert real["reduce_dtypes"] == predicted["reduce_dtypes"] == ["float32"]


def test_default_config_gathers_bf16_and_runs_fp8_matmuls(tmp_path, capsys):
    """torchao's default config leaves the weights plain: FSDP2 all-gathers them in its
    param_dtype, bfloat16, and no amax is all-reduced; the matmuls still run in fp8. Predicted
    only (the file's time): a plain bfloat16 all-gather's real run equals its prediction in
    tests/test_run_nproc_predict.py, and the fp8 matmuls send nothing."""
    (predicted,) = _runs(tmp_path, capsys, "cuda", "default", "bias", modes=(("--predict",),))
    # (512 + 32) · 2 = 1088 and (512 + 16) · 2 = 1056 bfloat16 bytes per all-gather.
    expected = [("all_gather", "forward", "bfloat16", 1088),
                ("all_gather", "forward", "bfloat16", 1056),
                ("all_gather", "backward", "bfloat16", 1056),
                ("all_gather", "backward", "bfloat16", 1088), *REDUCE]
    assert _facts(predicted) == [(0, expected, HELD), (1, expected, HELD)]
    # The matmuls ran in fp8 all the same (the trace's fp8 finding, on rank 0), and the check
    # says that their weights crossed in bfloat16: the forward all-gathers' outputs, 1088 +
    # 1056 = 2144 B.
    assert "2 of 2 Linear layers run their matmuls in fp8" in predicted["text"]
    text = " ".join(predicted["text"].split())
    assert "note AMP102 fp8-weights-gathered-in-16-bit" in text
    assert "2 all-gathers in the forward pass carried bfloat16 (2,144 B gathered)" in text


def test_float8_alone_all_gathers_float8_predicted(tmp_path, capsys):
    """Without a bias, layer 0's group holds only its float8 weight: all-gathered as
    float8_e4m3fn, 2 × 16·16 = 512 B. The real run cannot do it on gloo, whose collectives
    have no float8 dtypes (ProcessGroupGloo refuses the all-gather: "Invalid scalar type");
    NCCL, which the script names, has them. The prediction runs on the fake group."""
    script = _script(tmp_path, SCRIPT)
    code, _, err = _ampscope(capsys, "--nproc", "2", "--device", "cpu", str(script), "cpu",
                             "fp8", "nobias")
    assert code == 2 and "Invalid scalar type" in err
    (predicted,) = _runs(tmp_path, capsys, "cpu", "fp8", "nobias", modes=(("--predict",),))
    expected = [("all_reduce", "forward", "float32", AMAX),
                ("all_gather", "forward", "float8_e4m3fn", 512),
                ("all_reduce", "forward", "float32", AMAX),
                ("all_gather", "forward", "uint8", 544),
                ("all_reduce", "backward", "float32", AMAX),
                ("all_gather", "backward", "uint8", 544),
                ("all_reduce", "backward", "float32", AMAX),
                ("all_gather", "backward", "float8_e4m3fn", 512),
                REDUCE[0], ("reduce_scatter", "backward", "float32", 512 * 4)]
    # 1040 float32 values, 520 per rank: 2080 B; AdamW's three steps 12 B.
    held = {"parameter": {"float32": 2080}, "gradient": {"float32": 2080},
            "optimizer_state": {"float32": 2 * 2080 + 3 * 4}}
    assert _facts(predicted) == [(0, expected, held), (1, expected, held)]
    assert predicted["unshard_dtypes"] == ["float8_e4m3fn", "uint8"]


def test_float8_weights_on_the_virtual_device(tmp_path, capsys):
    """What the ranks above need of the virtual device, in one process. The truth is CUDA's
    behaviour on a GPU: a tensor subclass made on cuda:0 reports cuda:0 and takes `copy_`
    (FSDP2 copies each shard into its padded buffer that way), and the deprecated
    `torch.get_autocast_gpu_dtype()`, which `Float8Linear.forward` reads, is the dtype
    `autocast("cuda")` set (torch's CUDA build; a CPU build answers float16 whatever was
    set)."""
    script = _script(tmp_path, """
        import torch
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        model = torch.nn.Sequential(torch.nn.Linear(16, 32)).cuda()
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        weight = model[0].weight
        assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor", type(weight)
        assert weight.device == torch.device("cuda", 0), weight.device
        with torch.no_grad():
            weight.copy_(torch.ones(32, 16, device="cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.get_autocast_gpu_dtype() == torch.bfloat16
            out = model(torch.randn(16, 16, device="cuda"))
        assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
        out.float().sum().backward()
        """)
    code, _, err = _ampscope(capsys, "--device", "cuda", str(script))
    assert code == 0, err
