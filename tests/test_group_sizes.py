"""A tensor-parallel collective's group size when fake process groups are made one after
another in one process (as `fit --gpus` probes do, then a plan traced whole): DTensor's
sharding cache keeps the mesh of the first world, whose group names the second world reuses
for other groups or lacks. The ground truth is the mesh each test makes: 8 ranks as 4 x 2,
its "tp" dimension a group of 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ampscope.runtime.process_group import FakeGroups
from ampscope.torchcompat import distributed as compat
from ampscope.torchcompat.dispatch import TorchDispatchMode

WORLD, TP = 8, 2


class _Sizes(TorchDispatchMode):
    """Each functional collective's group size as the trace reads it (an unreadable one as
    the reason), its group name beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int | str | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == compat.FUNCTIONAL_NAMESPACE and "all_reduce" in func.name():
            try:
                size: int | str | None = compat.collective_group_size(func, args, kwargs)
            except compat.GroupSizeUnknown as e:
                size = str(e)
            self.seen.append((args[2], size))
            return args[0].clone()  # no collective runs: only its size is asked
        return func(*args, **kwargs)


def _run_world() -> Iterator[None]:
    """A fake world of 8 ranks as `run --nproc 8 --predict` makes it (FakeGroups)."""
    with FakeGroups().active():
        dist.init_process_group("nccl", rank=0, world_size=WORLD)
        yield


def _plans_world() -> Iterator[None]:
    """A fake world of 8 ranks as `fit --gpus` makes one for its probes."""
    from ampscope.api.parallel_plans import _fake_group

    with _fake_group(WORLD):
        yield


def _tp_all_reduce(world: Callable[[], Iterator[None]], meshes_before: int
                   ) -> tuple[list[tuple[str, int | str | None]], str]:
    """A row-parallel matmul's all-reduce over "tp", in a fake world of 8 ranks where
    `meshes_before` equal meshes were made first (the group names count up); the sizes seen
    and the name of the tp group of the mesh it ran on."""
    with contextlib.contextmanager(world)():
        for _ in range(meshes_before):
            init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))
        tp = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))["tp"]
        a = distribute_tensor(torch.ones(4, 6), tp, [Shard(1)])
        b = distribute_tensor(torch.ones(6, 4), tp, [Shard(0)])
        sizes = _Sizes()
        with sizes:
            (a @ b).redistribute(tp, [Replicate()])  # partial sums: an all-reduce over tp
        return sizes.seen, tp.get_group().group_name


@pytest.mark.parametrize("world", [
    _run_world,
    _plans_world,
], ids=["run-predict", "fit-probes"])
def test_a_tp_all_reduce_in_a_second_world_reads_its_own_group(world):
    first, first_name = _tp_all_reduce(world, meshes_before=1)
    second, second_name = _tp_all_reduce(world, meshes_before=0)
    assert first_name != second_name  # the same mesh, its tp group under another name
    assert first == [(first_name, TP)]
    # Before DTensor's cache was emptied with the world, the second all-reduce named the
    # first world's tp group, which this world lacks: its size was unknown (the world taken).
    assert second == [(second_name, TP)]
    assert not dist.is_initialized()

