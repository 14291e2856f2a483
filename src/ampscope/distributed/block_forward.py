"""Do a model's repeated blocks run alike? `fit --gpus` traces the first blocks only and takes
them for all, which holds when every block runs the same ops on the same shapes.

Alike parameters are not enough: a block may keep wider activations than another through its
own attributes (a width factor, a window) or through what the model's loop hands it. So the
whole model's forward runs once here, on fake tensors (one sample of `seq` tokens; a fake op
costs the same at any size), and each block's ops are listed with the shapes and dtypes they
make; any block whose list differs from block 0's is named. Forward only, without autograd:
its backward follows from these ops, and the probes trace it for the blocks they keep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ampscope import workloads
from ampscope.models.base import LoadedModel
from ampscope.precision import Setting
from ampscope.records import dtype_name
from ampscope.runs.environment import RunEnvironment
from ampscope.runtime.predict import fake_batch
from ampscope.torchcompat.dispatch import TorchDispatchMode

Signature = tuple[tuple[str, tuple], ...]  # (op, its tensors' (shape, dtype)) in order


@dataclasses.dataclass(frozen=True)
class Unlike:
    """The blocks whose forward differs from block 0's, and the first difference of the
    first of them."""

    blocks: list[int]
    first: str

    def said(self) -> str:
        """"blocks 6, 7 run unlike block 0 though the parameters match (block 6's op 10, …)"."""
        many = len(self.blocks) > 1
        return (f"block{'s' if many else ''} {_spans(self.blocks)} run{'' if many else 's'} "
                f"unlike block 0 though the parameters match (block {self.blocks[0]}'s "
                f"{self.first})")


class _Ops(TorchDispatchMode):
    """Each op run inside a block, with the shapes and dtypes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None
        self.ops: dict[int, list[tuple[str, tuple]]] = {}

    def entering(self, k: int) -> Callable[..., None]:
        """Block k's forward pre-hook."""
        def hook(_module, _args) -> None:
            self.block = k
        return hook

    def leaving(self, _module, _args, _output) -> None:
        """Every block's forward hook."""
        self.block = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            flat = out if isinstance(out, tuple | list) else (out,)
            self.ops.setdefault(self.block, []).append(
                (str(func), tuple((tuple(t.shape), t.dtype) for t in flat
                                  if isinstance(t, torch.Tensor))))
        return out


def unlike_blocks(lm: LoadedModel, setting: Setting, seq: int) -> Unlike | None:
    """The blocks of `lm` whose forward runs other ops or shapes than block 0's (None: every
    block runs alike). The model is left as it was: its weights are the run's fake working
    copies only while it runs, and the hooks are removed."""
    blocks = workloads.repeated_blocks(lm.module)
    ops = _Ops()
    hooks = []
    for k, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(ops.entering(k)))
        hooks.append(block.register_forward_hook(ops.leaving))
    env = RunEnvironment(setting, predict=True)
    assert env.fake is not None
    try:
        with env.applied(lm.module), env.predicting(collecting=False):
            data = fake_batch(lm.make_batch(1, seq, "train", torch.Generator().manual_seed(0)),
                              env.fake)
            with torch.no_grad(), setting.autocast(), ops:
                lm.loss(data)
    finally:
        for hook in hooks:
            hook.remove()
    signatures: list[Signature] = [tuple(ops.ops.get(k, ())) for k in range(len(blocks))]
    differ = [k for k in range(1, len(blocks)) if signatures[k] != signatures[0]]
    if not differ:
        return None
    return Unlike(differ, _first_difference(signatures[0], signatures[differ[0]], differ[0]))


def _first_difference(first: Signature, other: Signature, k: int) -> str:
    """Block k's first op unlike block 0's, short: `op 10, aten.repeat: [1, 64, 1024] bf16,
    block 0's [1, 64, 64] bf16`."""
    for n, (a, b) in enumerate(zip(first, other, strict=False)):
        if a != b:
            said = (f"op {n + 1}, {_op(b[0])}: {_shapes(b[1])}, block 0's "
                    + (f"{_shapes(a[1])}" if a[0] == b[0] else f"{_op(a[0])}: {_shapes(a[1])}"))
            return said if len(said) <= 120 else said[:119] + "…"
    return f"{len(other)} ops, block 0 {len(first)}"


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
