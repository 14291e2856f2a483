"""`ampscope run --nproc N` on parallel plans beyond plain DDP/FSDP2: what each rank really
holds (its shards of FSDP2's and tensor parallelism's DTensor parameters, their gradients and
AdamW state) and the collectives of a 2-D (data × tensor parallel) mesh.

Every number is derived by hand from the model's shapes and the plan: FSDP2 shards dim 0 of
each parameter as `torch.chunk` does (rank k gets rows ceil(n/W)·k onward, the last rank fewer)
and pads every rank's shard to ceil(n/W) rows for its all-gather and reduce-scatter
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py); ColwiseParallel shards a Linear's weight
and bias on dim 0, RowwiseParallel its weight on dim 1 and replicates its bias, and all-reduces
its partial output (torch/distributed/tensor/parallel/style.py). AdamW keeps exp_avg and
exp_avg_sq like each parameter (its shard) and a float32 scalar `step` per parameter
(torch/optim/adamw.py, adam.py `_init_group`).
"""

from __future__ import annotations

import pytest

from tests.test_run_nproc import _ampscope, _script, _validated

HEADER = """
import os
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

device = sys.argv[1]
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""

# Linear(4, 3) has an odd dim 0: FSDP2's shards are uneven. The run ends after opt.step(),
# gradients kept, so each rank holds parameter, gradient and optimizer shards.
FSDP2_UNEVEN = HEADER + """
mesh = init_device_mesh(device, (2,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(device)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    model(torch.randn(3, 4, device=device)).float().sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_ranks_hold_their_own_uneven_shards(device, tmp_path, capsys):
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "2", "--device", device, "--json", str(out),
                                str(_script(tmp_path, FSDP2_UNEVEN)), device)
    assert code == 0, err
    document = _validated(out)
    # Hand-derived shards, (rows of rank 0, rank 1): 0.weight 3×4 -> 2×4, 1×4; 0.bias 3 -> 2, 1;
    # 2.weight 2×3 -> 1×3, 1×3; 2.bias 2 -> 1, 1. Rank 0: 8+2+3+1 = 14 elements, rank 1:
    # 4+1+3+1 = 9 (14 + 9 = 23, the model's 12+3+6+2), float32: 56 B and 36 B. AdamW: twice
    # that, plus four float32 steps (16 B): 128 B and 88 B.
    held = [r["held"] for r in document["ranks"]]
    assert held == [
        {"parameter": {"float32": 56}, "gradient": {"float32": 56},
         "optimizer_state": {"float32": 2 * 56 + 16}},
        {"parameter": {"float32": 36}, "gradient": {"float32": 36},
         "optimizer_state": {"float32": 2 * 36 + 16}}]
    # The collectives pad every rank's shard to ceil(3/2) = 2 rows: layer 0's all-gather
    # output is 2 ranks × (2×4 + 2) = 20 bf16 elements (40 B, not the unpadded 15 · 2 = 30),
    # its reduce-scatter input the same 20 in fp32 (80 B); layer 2 is even: 2 × (3 + 1) = 8.
    for rank in document["ranks"]:
        calls = sorted((c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                       for c in rank["collectives"])
        assert calls == sorted([
            ("all_gather", "forward", "bfloat16", 40), ("all_gather", "forward", "bfloat16", 16),
            ("all_gather", "backward", "bfloat16", 40), ("all_gather", "backward", "bfloat16", 16),
            ("reduce_scatter", "backward", "float32", 80),
            ("reduce_scatter", "backward", "float32", 32)])
    # The per-rank table gives each shard of its full shape.
    assert "2×4 of 3×4" in text and "1×4 of 3×4" in text


BLOCK = """
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(4, 8)
        self.w2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))
"""

FSDP2_TP = HEADER + BLOCK + """
mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = Block().to(device)
parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    torch.manual_seed(step)  # the ranks of a tp group must see the same batch
    model(torch.randn(3, 4, device=device)).float().sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_over_tensor_parallel_on_a_2d_mesh(device, tmp_path, capsys):
    """4 ranks, about 10 s a run on 2 cores. On "cuda", tensor parallelism's redistribution
    returns functional collectives' AsyncCollectiveTensor through an autograd Function: it must
    be made on the real (CPU) device (runtime/device_mode.py)."""
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "4", "--device", device, "--json", str(out),
                                str(_script(tmp_path, FSDP2_TP)), device)
    assert code == 0, err
    document = _validated(out)
    assert document["parallel"]["strategy"] == "fsdp"
    # Shards by hand: tp halves w1.weight 8×4 and w1.bias 8 on dim 0 (4×4, 4) and w2.weight
    # 4×8 on dim 1 (4×4), and replicates w2.bias 4; dp then halves dim 0 of each: 2×4, 2, 2×4,
    # 2 = 20 float32 elements on every rank (80 B); AdamW 2 · 80 + 4 steps · 4 B = 176 B.
    for rank in document["ranks"]:
        assert rank["held"] == {"parameter": {"float32": 80}, "gradient": {"float32": 80},
                                "optimizer_state": {"float32": 176}}
        calls = sorted((c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                       for c in rank["collectives"])
        # FSDP2 on the dp group (2 ranks): one all-gather of the root's 2 × 20 parameters in
        # bf16 (80 B), kept for backward (the root does not reshard after forward), and one
        # reduce-scatter of their 40 fp32 gradients (160 B). TP: RowwiseParallel all-reduces
        # w2's partial bf16 output, batch 3 × 4 features (24 B); the input needs no gradient,
        # so ColwiseParallel's backward all-reduce does not run.
        assert calls == [("all_gather", "forward", "bfloat16", 80),
                         ("all_reduce", "forward", "bfloat16", 24),
                         ("reduce_scatter", "backward", "float32", 160)]
    # Every reduction of the backward pass is FSDP2's float32 one: no check says otherwise
    # (tests/test_checks.py has the same plan with a bfloat16 all-reduce in backward).
    assert "AMP101" not in text
    # distribute_tensor broadcasts the replicated w2.bias (4 float32) in the setup.
    assert any("broadcast float32 16 B" in n for n in document["notes"])
