"""DDP and FSDP2: real 2-process gloo runs of gpt2-tiny, and the fake-process-group prediction
checked against them (collective dtypes and bytes, sharded bytes held per rank)."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from ampscope.distributed import Parallel, launch, parse_mp_policy, predict
from ampscope.distributed.report import collective, summarize
from ampscope.errors import AmpscopeError
from ampscope.records import OpCall, TensorMeta

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or "spawn" not in multiprocessing.get_all_start_methods(),
    reason="needs torch.distributed with gloo and the spawn start method")

MODEL, BATCH, SEQ = "gpt2-tiny", 2, 16
# gpt2-tiny: 136,960 parameters (wte tied with lm_head), every one float32.
PARAMS = 136_960
FP32, BF16 = 4, 2
FSDP = Parallel("fsdp", 2, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
DDP = Parallel("ddp", 2, reduce_dtype=torch.bfloat16)
RUN = {"setting": "fp32", "batch": BATCH, "seq": SEQ}


@pytest.fixture(scope="module")
def fsdp_run():
    return launch(MODEL, FSDP, timeout=90, **RUN)


@pytest.fixture(scope="module")
def ddp_run():
    return launch(MODEL, DDP, timeout=90, **RUN)


# -- pure parts -------------------------------------------------------------------------------


@pytest.mark.fast
def test_mp_policy_parses_fsdp_fields():
    assert parse_mp_policy("param=bf16, reduce=fp32") == {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    assert parse_mp_policy(None) == {}
    with pytest.raises(AmpscopeError, match="bad --mp-policy"):
        parse_mp_policy("params=bf16")
    with pytest.raises(AmpscopeError, match="DDP keeps parameters"):
        Parallel("ddp", 2, param_dtype=torch.bfloat16)


def _op(name: str, *tensors: tuple[str, tuple[int, ...]]) -> OpCall:
    metas = tuple(TensorMeta(d, s) for d, s in tensors)
    return OpCall(index=7, op=name, module="h.0", phase="backward", inputs=metas,
                  outputs=metas, autocast_cast=False, caller=None, source=None,
                  input_names=(None,) * len(metas))


@pytest.mark.fast
def test_collective_bytes_are_the_unsharded_buffer_and_the_ring_share():
    # all-gather on 4 ranks: output 400 elements, input 100; bf16.
    c = collective(_op("c10d._allgather_base_.default", ("bfloat16", (400,)),
                       ("bfloat16", (100,))), 4)
    assert (c.kind, c.dtype, c.payload_bytes, c.wire_bytes) == ("all_gather", "bfloat16", 800, 600)
    c = collective(_op("c10d._reduce_scatter_base_.default", ("float32", (100,)),
                       ("float32", (400,))), 4)
    assert (c.kind, c.payload_bytes, c.wire_bytes) == ("reduce_scatter", 1600, 1200)
    c = collective(_op("c10d.allreduce_.default", ("float32", (100,))), 4)
    assert (c.kind, c.payload_bytes, c.wire_bytes) == ("all_reduce", 400, 600)
    assert collective(_op("aten.add.Tensor", ("float32", (4,))), 4) is None


# -- real 2-process runs, and the prediction against them -------------------------------------


@needs_gloo
def test_fsdp2_real_run_gathers_in_bf16_and_reduce_scatters_in_fp32(fsdp_run):
    report = fsdp_run
    assert (report.mode, report.backend) == ("run", "gloo")
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.unshard_dtypes == ["bfloat16"]
    assert report.reduce_dtypes == ["float32"]
    for rank in report.ranks:
        rows = {(r.kind, r.phase, r.dtype): r for r in summarize(rank.collectives)}
        assert set(rows) == {("all_gather", "forward", "bfloat16"),
                             ("all_gather", "backward", "bfloat16"),
                             ("reduce_scatter", "backward", "float32")}
        # Forward gathers every parameter once, in bf16; backward reduce-scatters every
        # gradient once, in fp32 (3 groups: 2 blocks and the root).
        assert rows["all_gather", "forward", "bfloat16"].payload_bytes == PARAMS * BF16
        assert rows["reduce_scatter", "backward", "float32"].payload_bytes == PARAMS * FP32
        assert rows["reduce_scatter", "backward", "float32"].calls == 3
        # Each rank holds half of every parameter, gradient and Adam moment, in fp32.
        assert rank.held["parameter"] == {"float32": PARAMS * FP32 // 2}
        assert rank.held["gradient"] == {"float32": PARAMS * FP32 // 2}
        assert rank.held_bytes("optimizer_state") == 2 * PARAMS * FP32 // 2 + 4 * 28  # + steps
    assert report.trace is not None and report.trace.mode == "run"
    assert any(o.op == "c10d._reduce_scatter_base_.default" for o in report.trace.ops)


@needs_gloo
def test_ddp_real_run_allreduces_in_the_compress_hooks_dtype(ddp_run):
    report = ddp_run
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.unshard_dtypes == []
    assert report.reduce_dtypes == ["bfloat16"]
    for rank in report.ranks:
        [row] = summarize(rank.collectives)
        assert (row.kind, row.phase, row.dtype) == ("all_reduce", "backward", "bfloat16")
        assert row.payload_bytes == PARAMS * BF16
        # DDP replicates: every rank holds the whole model, its gradients and Adam state.
        assert rank.held["parameter"] == {"float32": PARAMS * FP32}
        assert rank.held["gradient"] == {"float32": PARAMS * FP32}


@needs_gloo
@pytest.mark.parametrize("parallel, fixture", [(FSDP, "fsdp_run"), (DDP, "ddp_run")])
def test_prediction_at_two_ranks_matches_the_real_run(parallel, fixture, request):
    real = request.getfixturevalue(fixture)
    predicted = predict(MODEL, parallel, **RUN)
    assert predicted.mode == "predict" and len(predicted.ranks) == 1
    assert predicted.ranks[0].held == real.ranks[0].held
    assert summarize(predicted.ranks[0].collectives) == summarize(real.ranks[0].collectives)
    # each rank's peak, as `ampscope memory` counts one process: under FSDP2 the same as a
    # real rank's; a predicted DDP step runs unwrapped, without DDP's gradient buckets
    assert real.ranks[0].peak is not None and real.ranks[1].peak is not None
    if parallel.strategy == "fsdp":
        assert predicted.ranks[0].peak == real.ranks[0].peak
    else:
        assert predicted.ranks[0].peak.bytes < real.ranks[0].peak.bytes
    assert not dist.is_initialized()  # the fake group is gone


@pytest.mark.fast
def test_fsdp_prediction_shards_by_the_number_of_ranks():
    report = predict(MODEL, Parallel("fsdp", 8, param_dtype=torch.bfloat16), **RUN)
    held = report.ranks[0].held_bytes("parameter")
    # Dim-0 shards: rank 0 gets ceil(rows / 8) of every parameter, so at least an eighth.
    assert PARAMS * FP32 // 8 <= held < PARAMS * FP32 // 8 * 1.1
    [gather] = [r for r in summarize(report.ranks[0].collectives)
                if (r.kind, r.phase) == ("all_gather", "forward")]
    assert gather.dtype == "bfloat16" and gather.payload_bytes >= PARAMS * BF16
    assert gather.wire_bytes == pytest.approx(gather.payload_bytes * 7 / 8, abs=8)


def test_cli_memory_distributed_predict_writes_the_per_rank_report(tmp_path, capsys):
    from ampscope.cli import main

    out = tmp_path / "dist.json"
    code = main(["memory", MODEL, "--distributed", "fsdp", "--nproc", "4", "--predict",
                 "-s", "fp32", "--mp-policy", "param=bf16,reduce=fp32", "--seq", "16",
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "ampscope.distributed/1"
    assert data["parallel"] == {"strategy": "fsdp", "world_size": 4, "mp_policy": {
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None}}
    assert (data["unshard_dtypes"], data["reduce_dtypes"]) == (["bfloat16"], ["float32"])
    assert "Held by each rank" in capsys.readouterr().out
