"""The tensor inventory: parameters (with gradient dtypes), buffers, optimizer state, inputs,
taken at the end of a capture, while the run's own tensors are still in the model (tied
parameters: docs/how-it-works.md#tied-weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ampscope.records import (
    TARGET_NAMES,
    BufferRecord,
    HeldRecord,
    InputRecord,
    OptimizerStateRecord,
    ParameterRecord,
    dtype_name,
    from_rows,
)
from ampscope.runs.tensor_meta import dtensor_layout, local_tensor
from ampscope.torchcompat import modules as module_state
from ampscope.torchcompat.distributed import shard_shapes


def parameters_and_names(model: nn.Module) -> tuple[list[nn.Parameter], dict[int, list[str]]]:
    """`list(model.parameters())` and id(parameter) -> every name it goes by (first name
    first), from one walk of the model."""
    params: list[nn.Parameter] = []
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        known = names.get(id(p))
        if known is None:
            names[id(p)] = [name]
            params.append(p)
        else:
            known.append(name)
    return params, names


def parameters(names: dict[int, list[str]], params: list[nn.Parameter]) -> list[ParameterRecord]:
    """One record per parameter of `parameters_and_names`."""
    return [
        ParameterRecord(
            name=names[id(p)][0],
            dtype=dtype_name(p.dtype),
            shape=tuple(p.shape),
            requires_grad=p.requires_grad,
            grad_dtype=dtype_name(p.grad.dtype) if p.grad is not None else None,
            tied_to=tuple(names[id(p)][1:]),
            local_shape=local_shape(p),
        )
        for p in params
    ]


def local_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of the shard of `t` this process stores, when `t` is a DTensor (its own
    `shape` is the full tensor's); None for an ordinary tensor."""
    local = local_tensor(t)
    return tuple(local.shape) if local is not t else None


def job_roles(params: Iterable[torch.Tensor]) -> list[int]:
    """For each rank of the job of this process's default process group, the lowest rank whose
    shard of every one of `params` has the same shape (its role): ranks of one role hold alike,
    run the same ops on the same shapes, and send the same collectives. [] without a process
    group, where no parameter is a DTensor, or where DTensor's own computation of a shard's
    shape is not on this build."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    world_size = dist.get_world_size()
    layouts: dict[tuple, dict[int, tuple[int, ...]]] = {}
    for p in params:
        layout = dtensor_layout(p)
        if layout is None:
            continue
        key = (*layout, tuple(p.shape))
        if key not in layouts:
            shapes = shard_shapes(p)
            if shapes is None:
                return []
            layouts[key] = shapes
    if not layouts or world_size < 2:
        return []
    first: dict[tuple, int] = {}
    return [first.setdefault(tuple(s.get(rank) for s in layouts.values()), rank)
            for rank in range(world_size)]


def buffers(model: nn.Module) -> list[BufferRecord]:
    records = []
    for module_name, module in model.named_modules():
        for name, b in module_state.buffers(module).items():
            if b is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            persistent = name not in module_state.non_persistent_buffers(module)
            records.append(BufferRecord(full, dtype_name(b.dtype), tuple(b.shape), persistent))
    return records


def optimizer_state(optimizers: Iterable[torch.optim.Optimizer],
                    names: dict[int, list[str]]) -> list[OptimizerStateRecord]:
    """`names`: the parameters' (`parameters_and_names`)."""
    rows = []  # thousands on a large model: built at once (from_rows)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                param = names.get(id(p), ["<not in model>"])[0]
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        rows.append((param, key, dtype_name(value.dtype), tuple(value.shape),
                                     local_shape(value)))
    return from_rows(OptimizerStateRecord, rows)


def named_tensors(named: Mapping[str, object], role: str | None = None) -> list[InputRecord]:
    """Records for named model inputs or outputs; `role` None means infer input/target."""
    records = []
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            r = role or ("target" if name in TARGET_NAMES else "input")
            records.append(InputRecord(name, r, dtype_name(value.dtype), tuple(value.shape)))
    return records


# What nn.Module itself keeps in a module's __dict__ (hooks, children, parameters, buffers):
# never the model's own state.
_MODULE_OWN = module_state.module_fields()
_DEPTH = 4  # cache.layers[0].keys: an object, its list, an entry, the entry's tensor


def held_state(model: nn.Module, arguments: dict[str, object],
               params: list[nn.Parameter] | None = None) -> list[HeldRecord]:
    """The tensors the model holds outside its parameters and buffers: plain tensor attributes
    of its modules (and in their lists, dicts and objects), and the tensors inside the
    non-tensor objects passed to it (`arguments`: a KV cache), each tensor once. `params`:
    `list(model.parameters())`, when the caller has it."""
    params = list(model.parameters()) if params is None else params
    own = {id(t) for t in params} | {id(t) for t in model.buffers()}
    records: list[HeldRecord] = []
    seen: set[int] = set()

    def add(found, where: str) -> None:
        for name, t in found:
            if id(t) in own or id(t) in seen:
                continue
            seen.add(id(t))
            records.append(HeldRecord(name, where, dtype_name(t.dtype), tuple(t.shape)))

    # One walk for the whole model: an object many modules share (a transformers config held
    # by every layer) is looked into once, unless a later path reaches it with more depth left.
    walked: dict[int, int] = {}
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            # A name-mangled attribute is a library's own machinery, not the model's state
            # (FSDP2 keeps its per-module state under "__composable_api_state_key_<uuid>").
            if key not in _MODULE_OWN and key != "forward" and not key.startswith("__"):
                name = f"{prefix}.{key}" if prefix else key
                add(_tensors_in(value, name, _DEPTH, walked), "attribute")
    for name, value in arguments.items():
        add(_tensors_in(value, name, _DEPTH, walked), "argument")
    return records


def _tensors_in(value: object, path: str, depth: int, walked: dict[int, int]):
    """(path, tensor) for every tensor in `value`, through lists, tuples, dicts and plain
    objects' attributes, `depth` levels down (modules are left to the parameter inventory).
    `walked` holds the objects already looked into, with the depth left then."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth == 0 or walked.get(id(value), -1) >= depth or isinstance(
            value, (nn.Module, str, bytes, type)):
        return
    walked[id(value)] = depth
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__") and not callable(value):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items() if not k.startswith("__")]
    else:
        return
    for item_path, item in items:
        yield from _tensors_in(item, item_path, depth - 1, walked)
