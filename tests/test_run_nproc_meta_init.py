"""The way torchtitan builds its model: FSDP2 on the meta device, `to_empty`, then `nn.init`
on the sharded DTensor parameters, whose random ops DTensor runs at each shard's offset of
CUDA's Philox generator. On the virtual CUDA device the generator is the CPU's: DTensor's
random ops draw from it (a note says so), real ranks and predicted ones alike."""

from __future__ import annotations

import pytest

from tests.test_run_nproc import _ampscope, _script, _validated

META_INIT = """
import os
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
torch.manual_seed(0)
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cuda")
for p in model.parameters():
    nn.init.normal_(p, std=0.02)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 16, device="cuda")).square().mean().backward()
opt.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("predict", [False, True])
def test_meta_init_of_sharded_parameters_on_the_virtual_cuda_device(tmp_path, capsys, predict):
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "2", *(["--predict"] if predict else []),
                                "--device", "cuda", "--json", str(out),
                                str(_script(tmp_path, META_INIT)))
    assert code == 0, err
    document = _validated(out)
    # Linear(16, 32) and Linear(32, 16): 512 + 32 + 512 + 16 = 1072 float32 values, half on
    # each rank (dim 0 in two even shards): 536 · 4 = 2144 B, the same for the gradients.
    for rank in document["ranks"]:
        assert rank["held"]["parameter"] == {"float32": 2144}
        assert rank["held"]["gradient"] == {"float32": 2144}
    assert "FSDP2 compute" not in text  # fully_shard's default policy casts nothing
    if not predict:  # the real ranks ran DTensor's random op on their CPU generator
        assert "DTensor's random ops (nn.init on sharded parameters) drew from each rank's " \
               "CPU generator" in " ".join(text.split())
