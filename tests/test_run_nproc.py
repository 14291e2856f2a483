"""`ampscope run --nproc N`: a torchrun-style script, unmodified, as N real gloo ranks.

The scripts are written here as a user writes them for torchrun: they read the environment
torchrun sets, name "nccl", call `torch.cuda.set_device(LOCAL_RANK)` and `dist.barrier()`, and
check inside themselves what a rank must see (a failed check fails the run, and the test).
Byte counts are derived by hand from the model's shapes: Linear(4, 8) holds 4·8 + 8 = 40
parameters and Linear(8, 2) 8·2 + 2 = 18, 58 in all.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from ampscope import schemas
from ampscope.cli import main
from ampscope.errors import AmpscopeError
from tests.test_json_schema import _exact

PARAMS = 4 * 8 + 8 + 8 * 2 + 2  # hand-derived: the two Linear layers' weights and biases

# torchrun's variables for a one-machine job (torch/distributed/elastic/agent/server/
# local_elastic_agent.py sets these for every worker).
ENV_CHECKS = """
import os
for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
    assert name in os.environ, name
assert os.environ["GROUP_RANK"] == "0" and os.environ["MASTER_ADDR"] == "127.0.0.1"
assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == os.environ["ROLE_RANK"]
assert os.environ["WORLD_SIZE"] == os.environ["LOCAL_WORLD_SIZE"] == "2"
"""

DDP = ENV_CHECKS + """
import sys
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group(backend="nccl")
local_rank = int(os.environ["LOCAL_RANK"])
on_cuda = sys.argv[1] == "cuda"
if on_cuda:
    assert torch.cuda.device_count() == 2
    torch.cuda.set_device(local_rank)
    assert torch.cuda.current_device() == local_rank
device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
assert next(model.parameters()).device == device
ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if on_cuda else None)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
dist.barrier()
for step in range(2):
    loss = ddp(torch.randn(3, 4, device=device)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _script(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _validated(path: Path) -> dict:
    document = json.loads(path.read_text())
    schema = schemas.load("distributed")
    assert document["schema"] == schema["$id"]
    assert list(Draft202012Validator(schema).iter_errors(document)) == []
    # The schema declares exactly the fields written (test_json_schema.py's closed copy).
    assert list(Draft202012Validator(_exact(schema)).iter_errors(document)) == []
    return document


def _ampscope(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_ddp_two_ranks_all_reduce_the_gradients_in_fp32(device, tmp_path, capsys):
    script = _script(tmp_path, DDP)
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "2", "--device", device, "--json", str(out),
                                str(script), device)
    assert code == 0, err
    document = _validated(out)
    assert document["parallel"]["strategy"] == "ddp" and document["backend"] == "gloo"
    assert [r["rank"] for r in document["ranks"]] == [0, 1]
    for rank in document["ranks"]:
        # DDP's first step all-reduces every gradient in one bucket, in the gradients' dtype
        # (float32 parameters, no hook): the payload is every gradient's bytes, 58 · 4.
        assert [(c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                for c in rank["collectives"]] == [("all_reduce", "backward", "float32",
                                                   PARAMS * 4)]
        assert rank["held"] == {"parameter": {"float32": PARAMS * 4},
                                "gradient": {"float32": PARAMS * 4}}
    assert document["reduce_dtypes"] == ["float32"] and document["unshard_dtypes"] == []
    # The constructor's checks and parameter broadcast ran before the first forward pass.
    assert any("broadcast float32 232 B" in n for n in document["notes"])
    assert "Collectives of each rank" in text
    # The script named nccl: the note says what it ran on instead.
    assert "process group ('nccl') ran on gloo" in text.replace("\n", " ")


def test_a_script_without_a_process_group_runs_on_every_rank(tmp_path, capsys):
    script = _script(tmp_path, ENV_CHECKS + """
        import torch
        from torch import nn
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        """.replace("\n        ", "\n"))
    out = tmp_path / "ranks.json"
    code, text, err = _ampscope(capsys, "--nproc", "2", "--json", str(out), str(script))
    assert code == 0, err
    document = _validated(out)
    assert document["parallel"]["strategy"] == "none"
    assert [r["collectives"] for r in document["ranks"]] == [[], []]
    assert [r["held"]["parameter"] for r in document["ranks"]] == [{"float32": 10 * 4}] * 2
    assert "No rank ran a collective" in text


def test_a_rank_that_raises_is_named_in_one_line(tmp_path, capsys):
    script = _script(tmp_path, """
        import os
        import torch.distributed as dist
        dist.init_process_group("nccl")
        if os.environ["RANK"] == "1":
            raise ValueError("rank one cannot go on")
        dist.barrier()  # rank 0 waits here for a peer that is gone: killed by the parent
        """)
    code, _, err = _ampscope(capsys, "--nproc", "2", "--timeout", "60", str(script))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "rank 1 of 2 failed" in lines[0]
    assert f"ValueError at {script.name}:6: rank one cannot go on" in lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "0"], "--nproc must be between 1 and 8"),
    (["--nproc", "-3"], "--nproc must be between 1 and 8"),
    (["--nproc", "9"], "--nproc must be between 1 and 8"),
    (["--nproc", "5000", "--predict"], "--nproc with --predict must be between 1 and 4096"),
    (["--timeout", "5"], "--timeout only applies with --nproc N"),
])
def test_bad_nproc_input_is_one_line(argv, message, tmp_path, capsys):
    script = _script(tmp_path, "print('never runs')\n")
    code, out, err = _ampscope(capsys, *argv, str(script))
    assert code == 2 and "never runs" not in out
    assert len(err.strip().splitlines()) == 1 and message in err


FSDP2 = ENV_CHECKS + """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

device = sys.argv[1]
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("cuda:nccl,cpu:gloo")
mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(3, 4, device=device)).float().sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_all_gathers_in_bf16_and_reduce_scatters_in_fp32(device, tmp_path, capsys):
    """On "cuda" the mesh is `init_device_mesh("cuda", ...)` on the virtual device: FSDP2
    makes its reduce-scatter buffers with `torch.empty(..., device="cuda:k")` inside autograd's
    backward, where only dispatch modes see the call (runtime/device_mode.py)."""
    script = _script(tmp_path, FSDP2)
    out = tmp_path / "ranks.json"
    code, _, err = _ampscope(capsys, "--nproc", "2", "--device", device, "--json", str(out),
                             str(script), device)
    assert code == 0, err
    document = _validated(out)
    assert document["parallel"]["strategy"] == "fsdp"
    assert document["unshard_dtypes"] == ["bfloat16"] and document["reduce_dtypes"] == ["float32"]
    # Each layer is its own FSDP2 group; dim 0 of every parameter (8, 8, 2, 2) divides by 2,
    # so no padding: a group's all-gather output is its 40 or 18 parameters in bf16 (2 bytes),
    # its reduce-scatter input their gradients in fp32 (4 bytes). The layers reshard after
    # forward (fully_shard's default), so backward all-gathers them again.
    for rank in document["ranks"]:
        calls = [(c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                 for c in rank["collectives"]]
        assert sorted(c for c in calls if c[1] == "forward") == [
            ("all_gather", "forward", "bfloat16", 18 * 2),
            ("all_gather", "forward", "bfloat16", 40 * 2)]
        assert sorted(c for c in calls if c[0] == "reduce_scatter") == [
            ("reduce_scatter", "backward", "float32", 18 * 4),
            ("reduce_scatter", "backward", "float32", 40 * 4)]


RANK_FAILS = """
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
torch.nn.Linear(4, 4)(torch.randn(2, 4))
if dist.get_rank() == 1:
    raise ValueError("rank one is unhappy")
dist.barrier()
"""


def test_a_failed_rank_is_one_line_and_its_own_traceback_under_debug(tmp_path, capsys):
    script = _script(tmp_path, RANK_FAILS, name="fails.py")
    assert main(["run", "--nproc", "2", "-q", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("ampscope: error: rank 1 of 2 failed: fails.py raised ValueError at "
                           "fails.py:7: rank one is unhappy")
    with pytest.raises(AmpscopeError) as raised:
        main(["--debug", "run", "--nproc", "2", "-q", str(script)])
    told = "\n".join(getattr(raised.value, "__notes__", []))
    assert "rank 1's traceback:" in told
    assert 'File "' + str(script) + '", line 7' in told or "fails.py\", line 7" in told
    assert told.rstrip().endswith("ValueError: rank one is unhappy")
