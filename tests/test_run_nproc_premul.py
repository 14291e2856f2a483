"""NCCL's `ReduceOp.PREMUL_SUM` on the gloo ranks of `ampscope run --nproc`: FSDP2 asks for it
when a script sets a gradient divide factor (torchtitan sets 1.0: its loss is already divided by
the global token count), and gloo has none. Each such collective runs as a SUM of its inputs
multiplied by the factor first; the gradients the ranks end with are checked against sums
derived by hand."""

from __future__ import annotations

import pytest
import torch

from tests.test_run_nproc import _ampscope, _script

FSDP_DIVIDE = """
import os, sys
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
model = nn.Linear(8, 4, bias=False, device="cuda")
fully_shard(model, mesh=mesh)
if sys.argv[2] != "none":
    model.set_gradient_divide_factor(float(sys.argv[2]))
x = torch.arange(16.0, device="cuda").reshape(2, 8) * (rank + 1)
model(x).sum().backward()
grad = model.weight.grad.full_tensor()
if rank == 0:
    torch.save(grad.cpu(), sys.argv[1])
torch.optim.SGD(model.parameters()).step()
"""

# d sum(x Wᵀ) / dW: every row of W gets x summed over the batch. Rank r's batch is
# arange(16).reshape(2, 8) · (r + 1), whose column sums are [8, 10, …, 22] · (r + 1).
COLUMN_SUMS = torch.arange(8, 23, 2, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize(("factor", "scale"), [
    ("1.0", 3.0),   # PREMUL_SUM(1): the ranks' gradients summed, (1 + 2) · column sums
    ("4.0", 0.75),  # PREMUL_SUM(1/4): that sum over 4
    ("none", 1.5),  # FSDP2's default AVG over the 2 ranks, which gloo has
])
def test_fsdp2_gradient_divide_factor_on_gloo_ranks(tmp_path, capsys, factor, scale):
    saved = tmp_path / "grad.pt"
    code, text, err = _ampscope(capsys, "--nproc", "2", "--device", "cuda",
                                str(_script(tmp_path, FSDP_DIVIDE)), str(saved), factor)
    assert code == 0, err
    grad = torch.load(saved)
    assert torch.equal(grad, (COLUMN_SUMS * scale).expand(4, 8))
    said = " ".join(text.split())
    if factor == "none":
        assert "PREMUL_SUM" not in said
    else:
        assert "asked for ReduceOp.PREMUL_SUM, which gloo lacks: each ran as a SUM" in said


@pytest.mark.slow
def test_a_predicted_rank_takes_premul_sum(tmp_path, capsys):
    """The fake process group of a predicted rank takes the op as it is."""
    code, text, err = _ampscope(capsys, "--nproc", "2", "--predict", "--device", "cuda",
                                str(_script(tmp_path, FSDP_DIVIDE.replace(
                                    "torch.save(grad.cpu(), sys.argv[1])", "pass"))),
                                str(tmp_path / "unused"), "1.0")
    assert code == 0, err
    assert "PREMUL_SUM" not in " ".join(text.split())
