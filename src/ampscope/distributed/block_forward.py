"""Do a model's repeated blocks run alike? `fit --gpus` traces the first blocks only and takes
them for all, which holds when every block runs the same ops on the same shapes.

Alike parameters are not enough: a block may keep wider activations than another through its
own attributes (a width factor, a window) or through what the model's loop hands it. So the
whole model's forward runs once here (one sample of `seq` tokens, without autograd: the
backward follows from these ops, and the probes trace it), and each block's ops are listed with
the shapes and dtypes they make; any block whose list differs from block 0's is named. The
model runs on fake tensors, each block on meta tensors of its inputs' shapes, where an op
already run on the same shapes is not run again: on llama-3-70b (80 blocks) at seq 8192 the
check takes about 0.6 s of CPU, against 3.4 s on fake tensors throughout. Before it,
`unlike_lead` finds the first blocks whose modules, parameters or buffers differ from the
others' (DeepSeek-V3's dense layers before its mixture-of-experts ones), which every probe
keeps and the comparison leaves out, and refuses blocks that differ otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from ampscope import workloads
from ampscope.errors import AmpscopeError
from ampscope.models.base import LoadedModel
from ampscope.patches import patched
from ampscope.precision import Setting
from ampscope.records import dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.runtime.predict import fake_batch
from ampscope.torchcompat.dispatch import TorchDispatchMode, modes_off
from ampscope.torchcompat.fake import fake_mode_suspended

Signature = tuple[tuple[str, tuple], ...]  # (op, its tensors' (shape, dtype)) in order


@dataclasses.dataclass(frozen=True)
class Unlike:
    """The blocks whose forward differs from block `reference`'s (the first of those the
    depth rule takes for all), and the first difference of the first of them."""

    blocks: list[int]
    first: str
    reference: int = 0

    def said(self) -> str:
        """"blocks 6, 7 run unlike block 0 though the parameters match (block 6's op 10, …)"."""
        many = len(self.blocks) > 1
        return (f"block{'s' if many else ''} {_spans(self.blocks)} run{'' if many else 's'} "
                f"unlike block {self.reference} though the parameters match (block "
                f"{self.blocks[0]}'s {self.first})")


class _Ops(TorchDispatchMode):
    """Each op run inside a block, with the shapes and dtypes of the tensors it returns. With
    a `memo` (meta tensors only), an op already run on inputs of the same shapes, strides and
    dtypes and the same other arguments is not run again: a meta kernel's answer depends on
    nothing else, and alike blocks run the same ops on the same shapes, so the 80 blocks of
    a 70B model cost about one."""

    def __init__(self, memo: dict | None = None) -> None:
        super().__init__()
        self.block: int | None = None
        self.ops: dict[int, list[tuple[str, tuple]]] = {}
        self.memo = memo

    @contextlib.contextmanager
    def at(self, k: int) -> Iterator[None]:
        """Block k's ops listed while entered (this mode on the stack)."""
        self.block = k
        try:
            with self:
                yield
        finally:
            self.block = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _key(func, args, kwargs) if self.memo is not None else None
        made = self.memo.get(key) if self.memo is not None and key is not None else None
        if made is not None:
            out = _remade(made)
        else:
            out = func(*args, **kwargs)
            if self.memo is not None and key is not None and (made := _made(out)) is not None:
                self.memo[key] = made
        if self.block is not None:
            flat = out if isinstance(out, tuple | list) else (out,)
            tensors = tuple((tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor))
            if tensors:  # (a query of a tensor's device or size makes none: not the block's work)
                self.ops.setdefault(self.block, []).append((str(func), tensors))
        return out


class _NoKey(Exception):
    """An argument the memo does not key on (a fake tensor, an object): the op runs."""


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(func, args: tuple, kwargs: dict) -> tuple | None:
    try:
        return func, _described(args), _described(tuple(sorted(kwargs.items())))
    except _NoKey:
        return None


def _described(value):
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or type(value) is not torch.Tensor:
            raise _NoKey
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, tuple | list):
        return type(value), tuple(_described(v) for v in value)
    if value is None or isinstance(value, _PLAIN):
        return value
    raise _NoKey


def _made(out) -> tuple | None:
    """What an op returned, to make again: its meta tensors' shapes, strides, offsets and
    dtypes (None: something else, a tensor on another device included: not kept)."""
    if isinstance(out, torch.Tensor) and type(out) is torch.Tensor and out.is_meta:
        return ("tensor", tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
    if isinstance(out, tuple | list) and all(type(t) is torch.Tensor and t.is_meta for t in out):
        return (type(out), tuple(_made(t) for t in out))
    return None


def _remade(made: tuple):
    """A fresh meta tensor (or several) as `_made` described, made past every mode (the
    modes under this one would see it as an op of the block's)."""
    if made[0] == "tensor":
        _, shape, stride, offset, dtype = made
        with modes_off():
            if offset == 0:
                return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) \
                if all(shape) else 0
            base = torch.empty((offset + span,), dtype=dtype, device="meta")
            return base.as_strided(shape, stride, offset)
    kind, parts = made
    return kind(_remade(p) for p in parts)


def unlike_lead(name: str, blocks: list[nn.Module], deepest: int) -> int:
    """How many first blocks differ from the others in their modules, parameters or buffers
    (shapes, dtypes, whether a parameter trains): 0 where every block is alike; k where the
    blocks after the first k are alike and more than `deepest` (the probes' deepest), as
    DeepSeek-V3's dense layers come before its mixture-of-experts ones. The search keeps those
    k in every probe and takes a few of the others for all. Any other model whose blocks
    differ is refused."""
    def signature(block: nn.Module) -> tuple:
        return (tuple((n, type(m).__name__) for n, m in block.named_modules()),
                tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                      for n, t in block.named_parameters()),
                tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()))

    signatures = [signature(block) for block in blocks]
    lead = len(blocks) - 1
    while lead > 0 and signatures[lead - 1] == signatures[-1]:
        lead -= 1
    if lead and len(blocks) - lead <= deepest:
        k = next(k for k, s in enumerate(signatures) if s != signatures[0])
        raise AmpscopeError(
            f"{name}'s block {k} differs from block 0 (its modules, parameters or "
            "buffers): its plans cannot be derived from its first blocks; `ampscope run "
            "--nproc N --predict --gpu NAME SCRIPT` traces a script's plan whole")
    return lead


def unlike_blocks(lm: LoadedModel, setting: Setting, seq: int, lead: int = 0) -> Unlike | None:
    """The blocks of `lm` after its first `lead` (`unlike_lead`) whose forward runs other ops
    or shapes than block `lead`'s (None: those blocks run alike). The model is left as it was:
    its weights are the run's fake working copies only while it runs, and its blocks'
    forwards are its own again after."""
    blocks = workloads.repeated_blocks(lm.module)
    ops = _Ops()
    memo: dict = {}  # the blocks' meta ops, shared
    env = RunEnvironment(setting, predict=True)
    fake = env.fake
    assert fake is not None
    with contextlib.ExitStack() as stack:
        for k, block in enumerate(blocks):
            stack.enter_context(patched(block, "forward", _on_meta(block, k, ops, memo)))
        with env.applied(lm.module), env.predicting(collecting=False):
            data = fake_batch(lm.make_batch(1, seq, "train", torch.Generator().manual_seed(0)),
                              fake)
            with torch.no_grad(), setting.autocast():
                lm.loss(data)
    signatures: list[Signature] = [tuple(ops.ops.get(k, ())) for k in range(len(blocks))]
    differ = [k for k in range(lead + 1, len(blocks)) if signatures[k] != signatures[lead]]
    if not differ:
        return None
    return Unlike(differ, _first_difference(signatures[lead], signatures[differ[0]], lead),
                  lead)


def _on_meta(block: nn.Module, k: int, ops: _Ops, memo: dict) -> Callable:
    """Block k's forward, run on meta tensors of the fake ones' shapes and dtypes, its ops
    listed: a meta kernel costs a tenth of a fake tensor's cached dispatch, and the 80 blocks
    of a 70B model are most of its forward. Its outputs go back to the model as fake tensors
    of the same shapes. A block the meta device cannot run (an op that needs a value) runs on
    its fake tensors instead, its ops listed the same way."""
    forward = block.forward

    calling = _Calling(block, forward)

    def run(*args, **kwargs):
        with fake_mode_suspended():  # (what is made here is made on meta, not faked)
            weights = {f"block.{name}": _meta(t) for name, t in
                       [*block.named_parameters(), *block.named_buffers()]}
            meta_args, meta_kwargs = _meta(args), _meta(kwargs)
            listed = _Ops(memo)
            try:
                with listed.at(k):
                    out = functional_call(calling, weights, meta_args, meta_kwargs)
            except (RuntimeError, NotImplementedError):
                out = None  # value needed (`.item()`): the block runs on its fake tensors
        if out is not None:
            ops.ops[k] = listed.ops[k]
            return _faked(out, _device(args, kwargs))
        with ops.at(k):
            return forward(*args, **kwargs)

    return run


class _Calling(nn.Module):
    """The block's own forward (not the one `_on_meta` puts in its place), its weights the
    block's: what `functional_call` runs with meta weights swapped in."""

    def __init__(self, block: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.block = block
        self.own_forward = forward

    def forward(self, *args, **kwargs):
        return self.own_forward(*args, **kwargs)


def _meta(value):
    """`value` with every tensor as an empty meta tensor of its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, tuple | list):
        return type(value)(_meta(v) for v in value)
    if isinstance(value, dict):
        return {key: _meta(v) for key, v in value.items()}
    return value


def _faked(value, device: torch.device):
    """`value`'s meta tensors as fake ones of the same shapes on `device`, for the model (the
    fake mode is on: what is made here is fake)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=device)
    if isinstance(value, tuple | list):
        return type(value)(_faked(v, device) for v in value)
    if isinstance(value, dict):
        return {key: _faked(v, device) for key, v in value.items()}
    return value


def _device(args: tuple, kwargs: dict) -> torch.device:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _first_difference(first: Signature, other: Signature, reference: int) -> str:
    """A block's first op unlike block `reference`'s (`first`), short: `op 10, aten.repeat:
    [1, 64, 1024] bf16, block 0's [1, 64, 64] bf16`."""
    for n, (a, b) in enumerate(zip(first, other, strict=False)):
        if a != b:
            said = (f"op {n + 1}, {_op(b[0])}: {_shapes(b[1])}, block {reference}'s "
                    + (f"{_shapes(a[1])}" if a[0] == b[0] else f"{_op(a[0])}: {_shapes(a[1])}"))
            return said if len(said) <= 120 else said[:119] + "…"
    return f"{len(other)} ops, block {reference} {len(first)}"


def _op(name: str) -> str:
    return name.removesuffix(".default")


def _shapes(tensors: tuple) -> str:
    return ", ".join(f"{list(shape)} {dtype_name(dtype)}" for shape, dtype in tensors) \
        or "no tensor"


def _spans(blocks: list[int]) -> str:
    """`[1, 2, 3, 4, 7, 8]` as "1–4, 7, 8": a long list of blocks stays one short line."""
    runs: list[list[int]] = []
    for k in blocks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
