"""FSDP2 on predicted ranks: the unsharded parameters FSDP2 all-gathers into buffers of its own
are fake, as the shards they come from are (runtime/fake_buffers.py). Made real, they held
whole weights in this machine's memory and ran the model for real, and a real activation that
autograd recorded could not meet a fake tensor (a registered buffer) later in the forward pass:
PyTorch's fake mode refuses to take in a non-leaf real tensor."""

from __future__ import annotations

import pytest

from tests.test_run_nproc import _ampscope, _script, _validated

FSDP_WITH_BUFFER = """
import os, sys
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.register_buffer("scale", torch.ones(32))

    def forward(self, x):
        return (self.proj(x) * self.scale).to(x.dtype)  # the activation meets a fake buffer

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
model = nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(32, 16)).cuda()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
fully_shard(model[0], mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(4, 16, device="cuda")
print("data", x.sum().item() == x.sum().item())  # the script's own data stays real (not NaN)
model(x).float().square().mean().backward()
opt.step()
"""


@pytest.mark.slow
def test_fsdp2_unsharded_parameters_are_fake_on_predicted_ranks(tmp_path, capsys):
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "2", "--predict", "--device", "cuda",
                                "--json", str(out), str(_script(tmp_path, FSDP_WITH_BUFFER)))
    assert code == 0, err
    document = _validated(out)
    # Linear(16, 32) and Linear(32, 16): 512 + 32 + 512 + 16 = 1072 float32 values, split in
    # two even shards: 536 · 4 = 2144 B on each rank, and the same of gradients.
    for rank in document["ranks"]:
        assert rank["held"]["parameter"] == {"float32": 2144}
        assert rank["held"]["gradient"] == {"float32": 2144}
    assert "data True" in text + err
    # The header names the MixedPrecisionPolicy the script gave fully_shard.
    assert "(float32 weights, FSDP2 compute bfloat16, reduce float32, no autocast)" in \
        " ".join(text.split())
    setting = document["setting"]
    assert (setting["fsdp_param_dtype"], setting["fsdp_reduce_dtype"]) == ("bfloat16", "float32")
