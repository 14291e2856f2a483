"""The speed tricks of a predicted rank (FSDP2, tensor parallelism) give its exact records.

`fsdp-shard` makes only the chunks of each parameter that FSDP2 reads; the `foreach` trick
runs an in-place optimizer op over one DTensor entry of each kind. The ground truth is the same
rank traced on the exact path (no trick), and torch's own `_chunk_with_empty`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ampscope import tricks
from ampscope.api import parallel_plans
from ampscope.api.preparation import resolved
from ampscope.distributed.fake_world import fake_world, mesh_2d
from ampscope.distributed.launch import predict
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.probe_depth import truncate
from ampscope.models import registry
from ampscope.runs import foreach
from ampscope.torchcompat import distributed as compat
from tests.helpers import assert_same_trace

pytestmark = pytest.mark.skipif(not compat.fake_collectives(),
                                reason="predicted ranks need c10d's fake collectives")


@pytest.mark.fast
@pytest.mark.parametrize(("shape", "n", "dim"), [
    ((10, 3), 4, 0), ((64, 2), 64, 0), ((65, 2), 64, 0), ((3,), 8, 0), ((1,), 3, 0),
    ((4, 6), 3, 1), ((7, 5), 2, 1),
])
def test_rank_chunks_are_torchs_chunks(shape, n, dim):
    original = compat.fsdp_param_module()._chunk_with_empty
    t = torch.zeros(shape)
    theirs, ours = original(t, n, dim), compat.rank_chunks(original)(t, n, dim)
    assert len(ours) == len(theirs) == n

    def described(c: torch.Tensor) -> tuple:
        return c.shape, c.stride(), c.storage_offset(), c.data_ptr() - t.data_ptr() \
            if c.numel() else None

    assert [described(c) for c in ours] == [described(c) for c in theirs]
    assert described(ours[-1]) == described(theirs[-1])
    assert [described(c) for c in ours[1:3]] == [described(c) for c in theirs[1:3]]
    with pytest.raises(IndexError):
        ours[n]


def _took_part(monkeypatch) -> dict[str, int]:
    """Count what the two tricks answered during the test."""
    seen = {"chunks": 0, "dtensor foreach": 0}
    made = compat.rank_chunks

    def counting(original):
        lazy = made(original)

        def chunk_with_empty(*args, **kwargs):
            seen["chunks"] += 1
            return lazy(*args, **kwargs)

        return chunk_with_empty

    monkeypatch.setattr(compat, "rank_chunks", counting)
    thinned = foreach.thinned_call

    def spy(func, args, kwargs):
        out = thinned(func, args, kwargs)
        if out is not foreach.NOT_THINNED and any(
                hasattr(t, "placements") for t in args[0]):
            seen["dtensor foreach"] += 1
        return out

    monkeypatch.setattr(foreach, "thinned_call", spy)
    return seen


def test_a_predicted_fsdp_rank_with_the_tricks_equals_the_exact_path(monkeypatch):
    seen = _took_part(monkeypatch)
    quick = predict("gpt2-tiny", Parallel("fsdp", 8, param_dtype=torch.bfloat16),
                    setting="cuda:fp32", seq=16)
    assert seen["chunks"] > 0 and seen["dtensor foreach"] > 0
    with tricks.exact_path():
        full = predict("gpt2-tiny", Parallel("fsdp", 8, param_dtype=torch.bfloat16),
                       setting="cuda:fp32", seq=16)
    assert_same_trace(quick.trace, full.trace)
    # Every rank's shards, collectives and peak.
    assert quick.to_dict() == full.to_dict()


def test_a_tensor_parallel_probe_with_the_tricks_equals_the_exact_path(monkeypatch):
    seen = _took_part(monkeypatch)
    base = resolved("cuda:bf16")
    lm = registry.resolve("llama-3.2-1b", device="meta", target_device=base.device)
    parallel = Parallel("fsdp", 4)
    truncate(lm.module, 3)

    def probe():
        with fake_world(4):
            return parallel_plans._probe(lm, base, parallel, mesh_2d(2, 2), 3, 2, 32, "adamw",
                                         True)

    quick = probe()
    assert seen["chunks"] > 0 and seen["dtensor foreach"] > 0
    with tricks.exact_path():
        full = probe()
    assert quick == full


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def _dtensors(mesh, placement, n: int = 12) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [DTensor.from_local(torch.empty(2, 3), mesh, [placement], run_check=False)
            for _ in range(n)]


@pytest.mark.parametrize("thinned", [True, False])
def test_an_in_place_op_over_dtensors_runs_one_entry_of_each_kind(mesh, thinned):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Partial, Shard

    with FakeTensorMode():
        # A pending reduction (Partial) would make a collective per entry: never thinned.
        xs = _dtensors(mesh, Shard(0) if thinned else Partial())
        ran = []

        class Seen(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._foreach_mul_.Scalar:
                    ran.append(len(args[0]))
                return func(*args, **(kwargs or {}))

        with Seen():
            out = foreach.thinned_call(torch.ops.aten._foreach_mul_.Scalar, (xs, 0.9), {})
        if thinned:
            assert out is None and ran == [1]
        else:
            assert out is foreach.NOT_THINNED and ran == []
        # Out of place over DTensors: its results would have to be made as DTensors.
        assert foreach.thinned_call(torch.ops.aten._foreach_sqrt.default, (xs,), {}) \
            is foreach.NOT_THINNED
