"""A replayed block (runs/repeats.py): what its recorded twins left for it (`BlockPass`),
and `Replayed`, the autograd Function it runs as instead of dispatching an op: its forward and
backward append their recorded twins' records under its names and return fake tensors.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ampscope.runs.tensor_meta import fake_from, no_torch_function
from ampscope.runs.windows import Recorders, Window
from ampscope.tricks import TrickFailed


class ReplayDoubt(TrickFailed):
    """A replayed block's recorded twins turned out to differ: trace the step again in full."""


@contextlib.contextmanager
def bookkeeping(what: str) -> Iterator[None]:
    """ampscope's own work around a block (never the block's code): should it fail, that is a
    doubt — the step runs again with every block dispatched — and never the user's error."""
    try:
        yield
    except ReplayDoubt:
        raise
    except Exception as e:  # any failure of the bookkeeping is a doubt, raised as one
        raise ReplayDoubt(f"{what}: {type(e).__name__}: {e}") from e


@dataclass(eq=False)
class BlockPass:
    """One forward pass through a run of blocks (a new one starts at block 0), and what its
    recorded blocks left for the replayed ones."""

    off: bool = False  # something did not check out: the rest of the pass runs for real
    last: int = 0
    replayed: int = 0
    first_inputs: list[weakref.ref] = field(default_factory=list)  # block 0's tensor arguments
    forward: RecordedForward | None = None  # block 1's forward, usable for replay
    forward_twin: RecordedForward | None = None  # the second-to-last block's forward
    backward: RecordedBackward | None = None  # the second-to-last block's backward


@dataclass(eq=False)
class RecordedForward:
    """A recorded block forward, ready to replay."""

    window: Window
    spec: Any  # the arguments' structure
    leaves: list  # per argument leaf: a tensor's key, or the plain value
    shared: list[bool]  # per tensor argument: the same tensor block 0 got
    inputs: list  # the tensor arguments' storage entries (to tell which it freed)
    out_spec: Any
    out_leaves: list  # per output leaf: a tensor `described`, or the value
    # Positions its graph saved in [*tensor arguments, *parameters, *buffers].
    saved_inputs: list[int]
    fates: list  # per storage made: ("out", k), ("freed", offset) or "kept"
    input_frees: list[tuple[int, int]]  # (tensor argument position, offset freed at)
    state: tuple  # grad mode and autocast as it ran
    normalized: tuple = ()  # its records made relative, to compare with its twin


@dataclass(eq=False)
class RecordedBackward:
    """A recorded block backward, ready to replay."""

    window: Window
    fates: list  # per storage made: ("grad_in", k), ("grad_param", k), "freed", "kept"
    frees: list[tuple]  # (("made", j) | ("input", k) | ("grad_out", k), offset)
    grad_inputs: list  # per input needing grad: its gradient, `described`
    grad_params: list  # per parameter: its gradient, `described` (or None)
    normalized: tuple = ()


@dataclass(eq=False)
class ReplayContext:
    """What a replayed block's forward leaves for its backward: no tensor (autograd holds what
    the block saves, and frees it as it would), the entries of its arguments' storages."""

    replay: Recorders
    name: str  # the replayed block's
    p: BlockPass
    tensors: list | None  # its tensor arguments, until the forward replay is done
    needing: int  # how many of them want a gradient
    all_params: list  # the block's parameters, as its replay found them
    params: list  # those of them that want a gradient
    buffers: list  # the block's buffers
    inputs: list = field(default_factory=list)  # the arguments' storage entries
    made: list = field(default_factory=list)  # per storage block 1's forward made: its twin


class Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, context: ReplayContext, *tensors):
        with bookkeeping(context.name):
            template = context.p.forward
            # (the replay checked the template; the tensors go at the end of this forward)
            assert template is not None and context.tensors is not None
            replay = context.replay
            descriptions = [d for d in template.out_leaves if isinstance(d, tuple)]
            with no_torch_function():
                outputs = [fake_from(context.tensors[0] if context.tensors else tensors[0], d)
                           for d in descriptions]
                inputs = context.inputs = [replay.storages.entry_of(t) for t in context.tensors]
                made = template.window.append_renamed(
                    replay, context.name, template.fates,
                    real={("out", i): t for i, t in enumerate(outputs)},
                    pins=[(inputs[i], offset) for i, offset in template.input_frees])
            context.made = made
            ctx.context = context
            held = [*context.tensors, *context.all_params, *context.buffers]
            ctx.save_for_backward(*[held[i] for i in template.saved_inputs])
            context.tensors = None
            not_differentiable = [t for t, d in zip(outputs, descriptions, strict=True)
                                  if not d[4]]
            if not_differentiable:
                ctx.mark_non_differentiable(*not_differentiable)
            return tuple(outputs) if len(outputs) != 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        with bookkeeping(ctx.context.name):
            return Replayed._backward(ctx, grad_outputs)

    @staticmethod
    def _backward(ctx, grad_outputs: tuple):
        context: ReplayContext = ctx.context
        p, replay = context.p, context.replay
        template, twin = p.backward, p.forward_twin
        if template is None or twin is None or p.forward is None or \
                twin.normalized != p.forward.normalized:
            raise ReplayDoubt(f"{context.name}'s backward has no recorded twin to replay")
        with no_torch_function():
            like = grad_outputs[0] if grad_outputs else None
            assert like is not None  # autograd runs a backward only for outputs: one grad each
            grad_inputs = [None if d is None else fake_from(like, d) for d in template.grad_inputs]
            grad_params = [None if d is None else fake_from(like, d) for d in template.grad_params]
            real = {("grad_in", i): g for i, g in enumerate(grad_inputs) if g is not None}
            real |= {("grad_param", i): g for i, g in enumerate(grad_params) if g is not None}
            inputs = context.inputs
            grad_entries = [replay.storages.entry_of(g) if g is not None else None
                            for g in grad_outputs]
            releases = []
            for (kind, j), offset in template.frees:
                if kind == "made":
                    releases.append((context.made[j], offset))
                elif kind == "input":
                    releases.append((inputs[j], offset))
                else:
                    releases.append((grad_entries[j] if j < len(grad_entries) else None, offset))
            template.window.append_renamed(replay, context.name, template.fates, real=real,
                                           pins=releases)
        trainable = {id(q) for q in context.params}
        by_param = [g for q, g in zip(context.all_params, grad_params, strict=True)
                    if id(q) in trainable]
        return (None, *grad_inputs[:context.needing], *by_param)
