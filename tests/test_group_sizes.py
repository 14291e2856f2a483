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

import ampscope
from ampscope import hardware
from ampscope.analysis.op_time import Link, collective_seconds
from ampscope.analysis.step_time import step_time
from ampscope.hardware import kernels
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
    from ampscope.distributed.fake_world import fake_world

    with fake_world(WORLD):
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




class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


@contextlib.contextmanager
def _world_of(how: str, size: int) -> Iterator[None]:
    """A fake world of `size` ranks, as `run --nproc N --predict` or `fit --gpus` makes it."""
    if how == "run-predict":
        with FakeGroups().active():
            dist.init_process_group("nccl", rank=0, world_size=size)
            yield
    else:
        from ampscope.distributed.fake_world import fake_world

        with fake_world(size):
            yield


def _link(name: str, figures) -> Link:
    """The link called `name`, from the kernel figures by hand."""
    return Link(name, figures[f"{name}_bytes_per_s"] * figures["link_efficiency"],
                figures[f"{name}_step_s"], figures["collective_base_s"])


@pytest.mark.parametrize("how", ["run-predict", "fit-probes"])
def test_a_2d_mesh_records_the_nodes_each_group_spans(how):
    """16 ranks as FSDP 2 x TP 8, TP innermost (as `fit --gpus 16 --tp 8` makes its mesh): rank
    0's TP group is ranks 0-7, one node of 8 GPUs; its FSDP group is ranks 0 and 8, one on each
    of two nodes. Both are small; only the FSDP group's collectives cross the network."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with _world_of(how, 16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("dp", "tp"))
        model = _Mlp()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        trace = ampscope.trace(model, {"x": torch.randn(4, 16)}, predict=False)
    recorded = {(o.op, o.group, o.group_span) for o in trace.ops if o.group is not None}
    assert recorded == {
        ("c10d._allgather_base_.default", 2, (0, 8)),  # FSDP's parameters, over dp
        ("_c10d_functional.all_reduce.default", 8, (0, 7)),  # the row-parallel sums, over tp
        ("c10d._reduce_scatter_base_.default", 2, (0, 8)),  # FSDP's gradients, over dp
    }
    assert not [n for n in trace.notes if "process group" in n]
    # On an H100 (8 GPUs a node): the tp group's all-reduce on NVLink, the dp group's
    # collectives on the network, though 2 ranks would fit a node.
    acc = hardware.by_name("h100")
    figures = kernels.params(acc)
    assert figures["gpus_per_node"] == 8
    timed = {t.op: t for t in step_time(trace, acc, world_size=16).ops if t.collective}
    for op, ranks, link in (("c10d._allgather_base_.default", 2, "network"),
                            ("_c10d_functional.all_reduce.default", 8, "nvlink"),
                            ("c10d._reduce_scatter_base_.default", 2, "network")):
        t = timed[op]
        assert t.ranks == ranks
        assert t.seconds == pytest.approx(
            collective_seconds(str(t.collective), t.bytes, ranks, _link(link, figures)))
