"""A world of N ranks in this process, for `fit --gpus`'s probes: PyTorch's fake process group
(this process rank 0) and the (dp, tp) device meshes on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from ampscope.errors import AmpscopeError


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """PyTorch's fake process group of `world` ranks, this process rank 0. DTensor's sharding
    cache is emptied on both sides: it matches meshes by their ranks, so an earlier world's
    mesh (and its process groups' names) would come back in this one."""
    from ampscope.torchcompat.distributed import fake_store, forget_meshes

    if dist.is_initialized():
        raise AmpscopeError("a process group is already initialised here; search plans from a "
                            "process of its own")
    forget_meshes()
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def mesh_2d(dp: int, tp: int):
    """The (dp, tp) mesh (made outside the fake mode: DeviceMesh reads real values)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
