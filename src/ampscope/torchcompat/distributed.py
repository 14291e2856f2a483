"""Distributed details: the collectives' op names, c10d's implementation module, the fake process
group's store, DTensor's sharding cache (its meshes outlive their groups), PREMUL_SUM's factor,
FSDP2's mixed-precision policy, DDP's compression hook, storage ids, FSDP2's per-rank chunking.

Namesakes, the same concern at another layer: `render/distributed.py`."""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ampscope.torchcompat.dispatch import op_schema
from ampscope.torchcompat.features import Feature

# The collectives' ops as the dispatcher shows them (c10d's in-place ops, some under underscored
# names, and the functional ones in the underscored `_c10d_functional` namespace), by what
# they do: an op's name without namespace and overload → its kind.
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
}
FUNCTIONAL_NAMESPACE = "_c10d_functional"
NAMESPACES = ("c10d", FUNCTIONAL_NAMESPACE)
FUNCTIONAL_PREFIX = FUNCTIONAL_NAMESPACE + "."


def c10d_module():
    """torch.distributed's implementation module, where `init_process_group` and `new_group`
    live beside their re-exports (`init_device_mesh` calls them there); None on a build
    without it."""
    import torch.distributed as dist

    return getattr(dist, "distributed_c10d", None)


def mesh_module():
    """`torch.distributed.device_mesh`, whose module-level `new_group` (imported by name)
    DeviceMesh calls for its subgroups; None where this build lacks it or cannot import it."""
    try:
        import torch.distributed.device_mesh as mesh
    except ImportError:
        return None
    return mesh


def fake_store():
    """The store torch's fake process group ("fake" backend) is initialised with."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def compress_hook(dtype: torch.dtype, bucket):
    """DDP's compression hook body: all-reduce the bucket in `dtype`, then copy back."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook

    # None is the default group: torch's body handles it, its annotation says ProcessGroup only.
    return _compress_hook(dtype, None, bucket)  # type: ignore[arg-type]


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation cache. Its keys hold DeviceMeshes, which compare
    equal by their ranks and dimension names, not by their process groups: an op's output
    spec comes back with the mesh of the first call that filled the entry. Once that mesh's
    process group is destroyed and another made, a collective on that output names the old
    mesh's groups, whose names are reused or gone (a tensor-parallel all-reduce then read its
    group as the world). Whoever makes a process group after another was destroyed in the same
    process calls it (runtime/process_group.py's groups, on entry and on exit)."""
    if "torch.distributed.tensor" not in sys.modules:
        # Nothing made a DTensor, so nothing is cached; and importing the debug package would
        # import inductor, which makes its cache folder in the user's TMPDIR.
        return
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a build without DTensor (no cache) or without this helper
        return
    _clear_sharding_prop_cache()


class GroupSizeUnknown(Exception):
    """A collective names a process group whose size this build cannot read; the message says
    why (the caller keeps the op's size unknown and says so in a note)."""


# What reading a group raises on a build or a value it does not expect: an unboxing that finds
# no ProcessGroup (RuntimeError), a name no group is registered under (RuntimeError), an
# argument of another type (TypeError), a function that is not there (AttributeError), a group
# torch's registry of ranks does not hold (KeyError).
_GROUP_ERRORS = (AttributeError, KeyError, RuntimeError, TypeError, ValueError)


@dataclass(frozen=True, slots=True)
class CollectiveGroup:
    """The process group a collective runs over: how many ranks it holds, and the lowest and
    highest global rank among them (which nodes it spans: every rank between lies on a node
    between). `span` is None where the ranks could not be read; `why` then says why."""

    size: int
    span: tuple[int, int] | None
    why: str | None = None


def collective_group(func, args: tuple, kwargs: dict) -> CollectiveGroup | None:
    """The group a collective op runs over: its `process_group` argument (c10d's in-place
    ops, the group boxed), or the group its `group_name` names (the functional ones). None for
    an op that takes neither (`wait_tensor`, a barrier without a group): no group to read.
    Raises `GroupSizeUnknown`, with the reason, where the op names a group whose size this
    build cannot read; a group whose size is read but whose ranks are not has `span` None."""
    import torch.distributed as dist

    try:
        names = [a.name for a in op_schema(func).arguments]
    except AttributeError as e:  # no schema: not an OpOverload as this build makes them
        raise GroupSizeUnknown(f"{func} has no schema to find its group in ({e})") from e
    for name, read in (("process_group", _unboxed_group), ("group_name", _named_group)):
        if name not in names:
            continue
        at = names.index(name)
        value = args[at] if at < len(args) else kwargs.get(name)
        if value is None:
            return None
        try:
            group = read(dist, value)
            size = group.size()
        except _GROUP_ERRORS as e:
            raise GroupSizeUnknown(f"the size of {func}'s {name} could not be read "
                                   f"({type(e).__name__}: {_first_line(e)})") from e
        try:
            ranks = _group_ranks(dist, group)
        except _GROUP_ERRORS as e:
            return CollectiveGroup(size, None, f"the ranks of {func}'s {name} could not be "
                                   f"read ({type(e).__name__}: {_first_line(e)})")
        if len(ranks) != size:  # a registry out of step with the group: no span to trust
            return CollectiveGroup(size, None, f"{func}'s {name} holds {size} ranks, torch's "
                                   f"registry lists {len(ranks)}")
        return CollectiveGroup(size, (min(ranks), max(ranks)))
    return None


def collective_group_size(func, args: tuple, kwargs: dict) -> int | None:
    """How many ranks a collective op runs over (`collective_group`'s size)."""
    group = collective_group(func, args, kwargs)
    return None if group is None else group.size


def _unboxed_group(dist, group):
    return dist.ProcessGroup.unbox(group)


def _named_group(dist, name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def _group_ranks(dist, group) -> list[int]:
    """The global ranks of `group`, as torch's registry of groups lists them."""
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


@functools.cache
def group_size_readers() -> tuple[bool, str]:
    """Whether this build has both ways `collective_group_size` reads a group's size:
    `ProcessGroup.unbox` (c10d's in-place ops pass the group boxed) and
    `_resolve_process_group` (the functional ones pass its registered name)."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        return False, f"no torch.distributed on this build ({e})"
    missing = [what for what, found in (
        ("ProcessGroup.unbox", getattr(getattr(dist, "ProcessGroup", None), "unbox", None)),
        ("distributed_c10d._resolve_process_group",
         getattr(c10d_module(), "_resolve_process_group", None))) if not callable(found)]
    if missing:
        return False, f"missing: torch.distributed's {' and '.join(missing)}"
    return True, "ProcessGroup.unbox, distributed_c10d._resolve_process_group"


@functools.cache
def group_rank_reader() -> tuple[bool, str]:
    """Whether this build lists a group's global ranks (`get_process_group_ranks`), which
    `collective_group` reads a collective's span of nodes from."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        return False, f"no torch.distributed on this build ({e})"
    if not callable(getattr(dist, "get_process_group_ranks", None)):
        return False, "missing: torch.distributed.get_process_group_ranks"
    return True, "torch.distributed.get_process_group_ranks"


@functools.cache
def _local_shape_found() -> tuple[Callable | None, str]:
    """DTensor's own shard-shape computation and the root-mesh reader `shard_shapes` needs."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor._utils import (
            _compute_local_shape_and_global_offset as local_shape_at,
        )
    except ImportError as e:
        return None, f"not on this build ({e})"
    if not callable(getattr(DeviceMesh, "_get_root_mesh", None)):
        return None, "DeviceMesh._get_root_mesh is not on this build"
    return local_shape_at, "DTensor's _compute_local_shape_and_global_offset, a mesh's root mesh"


def shard_shapes(t: torch.Tensor) -> dict[int, tuple[int, ...]] | None:
    """For a DTensor, the shape of its local shard on every rank of its mesh's root mesh, as
    DTensor itself works it out for a mesh coordinate (uneven and strided shards included). A
    mesh sliced from a larger one (`mesh["dp"]`) holds only this rank's slice; each other rank
    has the same slice through its own coordinates, read off the root mesh. None for another
    tensor, or where this build does not work it out that way (`features()` says why; the
    caller then runs every rank)."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", None)
    if mesh is None or placements is None:
        return None
    local_shape_at = _local_shape_found()[0]
    if local_shape_at is None:
        return None
    try:
        root = mesh._get_root_mesh()
        mesh_shape = tuple(mesh.mesh.shape)
        if root is mesh:
            dims = list(range(len(mesh_shape)))
        else:
            names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
            if not names or not root_names or any(n not in root_names for n in names):
                return None  # a flattened dimension: not one of the root's
            dims = [root_names.index(n) for n in names]
        layout = root.mesh.tolist()  # the rank at each coordinate
        known: dict[tuple[int, ...], tuple[int, ...]] = {}
        shapes = {}
        for coordinate in itertools.product(*(range(n) for n in root.mesh.shape)):
            mine = tuple(coordinate[d] for d in dims)
            if mine not in known:
                known[mine] = tuple(local_shape_at(tuple(t.shape), mesh_shape, list(mine),
                                                   placements, skip_offset=True)[0])
            shapes[int(functools.reduce(lambda row, i: row[i], coordinate, layout))] = known[mine]
        return shapes
    # DTensor's private helper, on a user's mesh and placements, may fail in any way a release
    # makes it: an unknown answer only costs speed (the caller runs every rank).
    except Exception:  # noqa: BLE001 - any failure: the shapes are not known
        return None


def storage_id(t: torch.Tensor) -> int:
    """An id of `t`'s storage that every tensor object on it shares (a DTensor makes a new
    local tensor object on every call)."""
    return t.untyped_storage()._cdata


# The collectives a predicted rank dispatches on fake tensors (FSDP2's, DDP's, DeviceMesh's).
_COLLECTIVES = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_",
                "c10d::broadcast_")


def fake_collectives() -> bool:
    """Whether this build's c10d collectives run on fake tensors (they have Meta kernels: torch
    2.11 and later); without them a rank cannot be predicted."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if not callable(has_kernel):
        return False
    try:
        import torch.distributed as _  # noqa: F401 - registers the c10d ops

        return all(has_kernel(op, "Meta") for op in _COLLECTIVES)
    except (RuntimeError, ImportError):  # an op this build does not define
        return False


def no_fake_collectives(what: str) -> str | None:
    """The one line that says `what` cannot run on this build (None where it can)."""
    if fake_collectives():
        return None
    return (f"{what} needs PyTorch's collectives to run on fake tensors, which torch "
            f"{torch.__version__} lacks (they came in 2.11): run the ranks for real (`ampscope "
            "run --nproc N` without --predict, up to 8), or use torch 2.11 or later")


def fsdp_mixed_precision(module: torch.nn.Module
                         ) -> tuple[torch.dtype | None, torch.dtype | None] | None:
    """The `param_dtype` and `reduce_dtype` of the MixedPrecisionPolicy `fully_shard` gave
    `module`; None where it is not an FSDP2 module, or this build keeps the policy elsewhere
    (FSDP2's state, reached by `_get_fsdp_state()`, holds it as `_mp_policy`)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        policy = getattr(get_state(), "_mp_policy", None)
    except (AssertionError, AttributeError, RuntimeError):  # a state not made yet
        return None
    if policy is None:
        return None
    return getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)


class PremulFactorUnknown(RuntimeError):
    """A `ReduceOp.PREMUL_SUM` whose factor this build does not let Python read."""


def premul_factor(op: object) -> float | torch.Tensor | None:
    """The factor of a `ReduceOp.PREMUL_SUM(factor)` (NCCL's sum of inputs each multiplied by
    it), None for any other op; raises PremulFactorUnknown where the build hides it. The
    factor is the op object's `factor` (its pickled state, `(op type, factor)`, before that)."""
    from torch.distributed import ReduceOp

    if not isinstance(op, ReduceOp) or op != ReduceOp.PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        state = getattr(op, "__getstate__", lambda: ())()
        factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    if not isinstance(factor, (float, int, torch.Tensor)):
        raise PremulFactorUnknown(f"torch {torch.__version__} does not expose the factor of "
                                  "ReduceOp.PREMUL_SUM")
    return factor


def fsdp_param_module():
    """FSDP2's `_fsdp_param`, where each FSDPParam cuts its parameter into one chunk per rank
    with `_chunk_with_empty` (imported there by name); None on a build without it."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        return None
    return _fsdp_param if callable(getattr(_fsdp_param, "_chunk_with_empty", None)) else None


class RankChunks(Sequence):
    """What `_chunk_with_empty(tensor, n, dim)` returns — `torch.chunk`'s chunks of `tensor`
    along `dim`, then empty tensors up to n — with each chunk made when it is first read, as
    the same view `torch.chunk` makes (`narrow`). FSDPParam reads two of them, its rank's and
    the first; on fake tensors each chunk made is a dispatch through FakeTensorMode, and a
    64-rank mesh made 64 of them for every parameter, twice."""

    def __init__(self, tensor: torch.Tensor, chunks: int, dim: int) -> None:
        size = tensor.size(dim)
        self._tensor, self._n, self._dim, self._size = tensor, chunks, dim, size
        self._step = -(-size // chunks)  # torch.chunk's: ceil(size / n), the last shorter
        self._real = -(-size // self._step)  # the chunks before the empty ones
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(index)
        if i not in self._made:
            if i < self._real:
                start = i * self._step
                self._made[i] = self._tensor.narrow(self._dim, start,
                                                    min(self._step, self._size - start))
            else:
                self._made[i] = self[0].new_empty(0)
        return self._made[i]


def rank_chunks(original: Callable) -> Callable:
    """`_chunk_with_empty` answering with RankChunks (`original` for an empty dimension, which
    torch.chunk cuts otherwise)."""
    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int):
        if tensor.size(dim) == 0 or num_chunks < 1:
            return original(tensor, num_chunks, dim)
        return RankChunks(tensor, num_chunks, dim)

    return chunk_with_empty


def rank_chunks_patch() -> tuple[object, str, Callable] | None:
    """What the `fsdp-shard` trick replaces, and with what: (FSDP2's `_fsdp_param`,
    "_chunk_with_empty", its RankChunks answer); None on a build without it."""
    module = fsdp_param_module()
    if module is None:
        return None
    return module, "_chunk_with_empty", rank_chunks(module._chunk_with_empty)


@functools.cache
def rank_chunks_status() -> tuple[bool, str]:
    """Whether FSDP2's chunking can be answered by RankChunks here: the function is where it is
    expected, and on a few shapes each chunk equals torch's (size, strides, offset)."""
    module = fsdp_param_module()
    if module is None:
        return False, "FSDP2's _fsdp_param._chunk_with_empty is not on this build"
    original = module._chunk_with_empty
    lazy = rank_chunks(original)
    try:
        for shape, n, dim in (((10, 3), 4, 0), ((3,), 8, 0), ((65, 2), 64, 0), ((4, 6), 3, 1)):
            t = torch.zeros(shape)
            theirs, ours = original(t, n, dim), lazy(t, n, dim)
            if len(theirs) != len(ours) or any(
                    (a.shape, a.stride(), a.storage_offset()) != (b.shape, b.stride(),
                                                                  b.storage_offset())
                    for a, b in zip(theirs, ours, strict=True)):
                return False, "FSDP2's _chunk_with_empty cuts differently on this build"
    except Exception as e:  # noqa: BLE001 - a probe: any failure turns the trick off, said here
        return False, (f"FSDP2's _chunk_with_empty cannot be called as expected "
                       f"({type(e).__name__}: {e})")
    return True, "FSDP2's _fsdp_param._chunk_with_empty"


def features() -> list[Feature]:
    try:
        fake_store()
        ok, why = True, "torch's fake process group store"
    except (ImportError, AttributeError, RuntimeError) as e:  # not built with distributed support
        ok, why = False, f"not on this build ({type(e).__name__}: {e})"
    collectives = fake_collectives()
    sizes, sizes_why = group_size_readers()
    shapes, shapes_why = _local_shape_found()
    return [Feature("FSDP2 per-rank chunks", *rank_chunks_status(), "fsdp-shard"),
            Feature("fake process group", ok, why, "every predicted rank"),
            Feature("collectives on fake tensors", collectives,
                    "c10d's Meta kernels" if collectives else
                    "not on this build: no rank can be predicted (run --nproc --predict, "
                    "trace --distributed --predict, fit --gpus)", "every predicted rank"),
            Feature("collective group sizes", sizes, sizes_why,
                    "a collective's own group in the wire bytes (the world size is taken)"),
            Feature("collective group ranks", *group_rank_reader(),
                    "the link a collective crosses by the nodes its ranks are on (by its "
                    "group's size)"),
            Feature("DTensor shard shapes", shapes is not None, shapes_why,
                    "run --nproc --predict's roles (every rank runs)")]


def dtensor_rng_state_reader() -> tuple[type, str] | None:
    """Where DTensor's RNG tracker (random ops on sharded parameters: `nn.init.normal_` after
    FSDP2's `to_empty`) reads the device generator's state as Philox's and moves it to the
    device: (class, method name), or None where this build has no such method."""
    try:
        from torch.distributed.tensor import _random
    except ImportError:
        return None
    tracker, name = getattr(_random, "OffsetBasedRNGTracker", None), "_get_device_state"
    return (tracker, name) if tracker is not None and name in vars(tracker) else None


def dtensor_rng_op() -> tuple[object, str] | None:
    """Where DTensor's dispatch finds `run_dtensor_rng_op`, the operator that runs a random op
    on a shard at its offset of the device's Philox generator (CUDA only): (module, name), or
    None where this build has none."""
    try:
        from torch.distributed.tensor import _dispatch
    except ImportError:
        return None
    name = "run_dtensor_rng_op"
    return (_dispatch, name) if hasattr(_dispatch, name) else None
