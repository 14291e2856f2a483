"""Repeated blocks traced once: in a predicted run, the records of a model's identical blocks
are recorded from two of them and replayed for the others, which never dispatch an op.

Within each run of at least five structurally identical consecutive children (runs/alike.py) of
a `ModuleList` or `Sequential`, blocks 0 and 1 and the last two run as usual; block 1's forward
and the second-to-last block's backward are recorded as windows (runs/windows.py), and every
block between them whose call matches block 1's appends them under its own names from an
autograd Function (runs/replayed.py). A window is used only when everything it made and freed
is accounted for; when the recorded twins differ after all, `ReplayDoubt` is raised and the
caller runs the step again without replaying. docs/how-it-works.md#repeated-blocks-traced-once
tells how, and why it is exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampscope.patches import patch
from ampscope.runs.alike import PLAIN_VALUES, attribute_ids, repeated_runs
from ampscope.runs.blockio import (
    grad_and_autocast_state,
    plain_spec,
    saved_storages,
    shared_with_first,
)
from ampscope.runs.memory import StorageTracker, storage_of
from ampscope.runs.modules import ModuleTracker
from ampscope.runs.replayed import (
    BlockPass,
    RecordedBackward,
    RecordedForward,
    ReplayContext,
    ReplayDoubt,
    Replayed,
    bookkeeping,
)
from ampscope.runs.tensor_meta import described, no_torch_function, tensor_key
from ampscope.runs.windows import Window
from ampscope.torchcompat.autograd import graph_task_id
from ampscope.torchcompat.dispatch import pytree
from ampscope.torchcompat.fake import FakeTensor


class _Run:
    """One run of identical blocks, its forwards wrapped for recording or replaying."""

    def __init__(self, replay: BlockReplay, names: list[str], blocks: list[nn.Module]) -> None:
        self.replay = replay
        self.names = names
        self.blocks = blocks
        self.current: BlockPass | None = None

    def wrap(self, k: int) -> Callable[[], None]:
        block = self.blocks[k]
        original = block.forward

        def forward(*args, **kwargs):
            return self.call(k, original, args, kwargs)

        return patch(block, "forward", forward)

    def call(self, k: int, original: Callable, args: tuple, kwargs: dict):
        tracker = self.replay.tracker
        innermost = tracker.innermost_forward()
        if innermost is None or innermost.module_id != id(self.blocks[k]) or \
                graph_task_id() != -1:
            return original(*args, **kwargs)  # called as .forward(...), or inside a backward
        if k == 0:
            self.current = BlockPass()
        p = self.current
        if p is None or p.off or p.last != k - 1 and k != 0:
            if p is not None:
                p.off = True
            return original(*args, **kwargs)
        p.last = k
        n = len(self.blocks)
        if k == 0:
            with no_torch_function():
                p.first_inputs = [weakref.ref(t) for t in pytree.tree_flatten((args, kwargs))[0]
                                  if isinstance(t, torch.Tensor)]
            return original(*args, **kwargs)
        if k == 1 or k == n - 2:
            return self.record_forward(p, k, original, args, kwargs)
        if 2 <= k <= n - 3 and p.forward is not None:
            with bookkeeping(self.names[k]):
                replayed = self.replay_forward(p, k, args, kwargs)
            if replayed is not _NOT_REPLAYED:
                return replayed
        return original(*args, **kwargs)

    # -- recording
    def record_forward(self, p: BlockPass, k: int, original: Callable, args: tuple, kwargs: dict):
        replay = self.replay
        block = self.blocks[k]
        with bookkeeping(self.names[k]), no_torch_function():
            leaves, spec = pytree.tree_flatten((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            fake = all(isinstance(t, FakeTensor) for t in tensors) and tensors
            inputs = [replay.storages.entry_of(t) for t in tensors]
            state = grad_and_autocast_state()
            attributes = attribute_ids(block)
        with bookkeeping(self.names[k]):
            window = Window(replay, self.names[k])
        out = original(*args, **kwargs)
        with bookkeeping(self.names[k]), no_torch_function():
            window.close(replay)
            usable = fake and attribute_ids(block) == attributes
            recorded = self._forward_of(window, p, k, spec, leaves, tensors, inputs, out, state) \
                if usable else None
        if k == 1:
            p.forward = recorded
        else:
            p.forward_twin = recorded
            if p.replayed and (recorded is None or p.forward is None or
                               recorded.normalized != p.forward.normalized):
                raise ReplayDoubt(f"{self.names[k]}'s forward differs from {self.names[1]}'s")
            self.replay.unchecked.discard(p)
        if recorded is not None and torch.is_grad_enabled():
            with bookkeeping(self.names[k]):
                self._watch_backward(p, k, window.prefix, tensors, out, recorded)
        return out

    def _forward_of(self, window: Window, p: BlockPass, k: int, spec, leaves: list,
                    tensors: list, inputs: list, out, state: tuple) -> RecordedForward | None:
        replay = self.replay
        out_leaves, out_spec = pytree.tree_flatten(out)
        if not plain_spec(spec) or not plain_spec(out_spec):
            return None
        outputs = []
        descriptions: list = []
        for leaf in out_leaves:
            if isinstance(leaf, torch.Tensor):
                outputs.append(replay.storages.entry_of(leaf))
                descriptions.append(described(leaf))
            elif isinstance(leaf, PLAIN_VALUES):
                descriptions.append(leaf)
            else:
                return None  # an object made by the block (a cache): cannot be made up
        made = window.created(replay)
        index = {id(e): j for j, e in enumerate(made)}
        if any(e is None or id(e) not in index for e in outputs) or \
                len({id(e) for e in outputs}) != len(outputs):
            return None  # an output that is an input, or a view of another output
        fates = window.fates(replay, {id(e): ("out", i) for i, e in enumerate(outputs)})
        input_of = {id(e): i for i, e in enumerate(inputs) if e is not None}
        input_frees = []
        for e in window.external_frees(replay):
            if id(e) not in input_of:
                return None  # freed something that is not its argument
            input_frees.append((input_of[id(e)], e.freed - window.r0))
        if not window.is_own(replay, forward=True):
            return None
        shared = shared_with_first(tensors, p.first_inputs)
        keys = [tensor_key(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        if any(not isinstance(t, (torch.Tensor, *PLAIN_VALUES)) for t in leaves):
            return None  # an object argument (a cache) the block may change
        # What its autograd graph saved from outside it: a replayed twin saves the same (for
        # the storages' `saved` flags and lifetimes), or the window is not used.
        # (Only storages the tracker knows: a Python scalar autograd saves as a tensor made
        # without an op is no memory the trace counts.)
        found = saved_storages(out, tensors)
        if found is None:
            return None
        saved = (found & replay.storages.live_keys()) - {e.key for e in made}
        held = [*tensors, *self.blocks[k].parameters(), *self.blocks[k].buffers()]
        saved_inputs = [i for i, t in enumerate(held) if id(storage_of(t)) in saved]
        if saved - {id(storage_of(held[i])) for i in saved_inputs}:
            return None
        recorded = RecordedForward(window, spec, keys, shared, inputs, out_spec, descriptions,
                            saved_inputs, fates, input_frees, state)
        recorded.normalized = window.normalized(replay, [*fates, *input_frees, *saved_inputs])
        return recorded

    def _watch_backward(self, p: BlockPass, k: int, prefix: str, tensors: list, out,
                        recorded: RecordedForward) -> None:
        """Record this block's backward as a window: from its outputs' gradients arriving to
        its inputs' gradients leaving (tensor hooks; they change no gradient)."""
        outputs = [t for t in pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        needing = [t for t in tensors if t.requires_grad and t.grad_fn is not None]
        if not outputs or not needing:
            return
        params = list(self.blocks[k].parameters())
        wanted = len(needing)  # a count: a hook holding its own tensor would keep it alive
        run = weakref.ref(self)
        state: dict[str, Any] = {"grad_out": [], "grad_in": {}, "window": None}

        def arrived(i):
            def hook(grad):
                self_ = run()
                if self_ is None:
                    return
                state["grad_out"].append((i, self_.replay.storages.entry_of(grad)))
                if state["window"] is None:
                    state["window"] = Window(self_.replay, prefix)
            return hook

        def left(i):
            def hook(grad):
                self_ = run()
                if self_ is None or state["window"] is None:
                    return
                state["grad_in"][i] = (self_.replay.storages.entry_of(grad), described(grad))
                if len(state["grad_in"]) == wanted:
                    window = state["window"]
                    window.close(self_.replay)
                    with bookkeeping(prefix), no_torch_function():
                        self_.backward_of(p, k, window, state, wanted, params, recorded)
            return hook

        for i, t in enumerate(outputs):
            t.register_hook(arrived(i))
        for i, t in enumerate(needing):
            t.register_hook(left(i))

    def backward_of(self, p: BlockPass, k: int, window: Window, state: dict, wanted: int,
                     params: list, recorded: RecordedForward) -> None:
        replay = self.replay
        grad_in = {id(entry): ("grad_in", i) for i, (entry, _) in state["grad_in"].items()
                   if entry is not None}
        grads = [q.grad for q in params]
        grad_param = {id(replay.storages.entry_of(g)): ("grad_param", i)
                      for i, g in enumerate(grads) if g is not None}
        fates = window.fates(replay, grad_in | grad_param)
        forward_made = {id(e): j for j, e in enumerate(recorded.window.created(replay))}
        inputs = {id(e): i for i, e in enumerate(recorded.inputs) if e is not None}
        grad_outs = {id(e): i for i, e in state["grad_out"] if e is not None}
        frees: list[tuple] = []
        usable = len(grad_in) == wanted and len(grad_param) == sum(g is not None for g in grads)
        for e in window.external_frees(replay):
            offset = e.freed - window.r0
            if id(e) in forward_made:
                frees.append((("made", forward_made[id(e)]), offset))
            elif id(e) in inputs:
                frees.append((("input", inputs[id(e)]), offset))
            elif id(e) in grad_outs:
                frees.append((("grad_out", grad_outs[id(e)]), offset))
            else:
                usable = False
        usable = usable and window.is_own(replay, forward=False)
        backward = None
        if usable:
            backward = RecordedBackward(window, fates, frees,
                                 [state["grad_in"][i][1] for i in range(wanted)],
                                 [None if g is None else described(g) for g in grads])
            backward.normalized = window.normalized(replay, [*fates, *frees])
        if k == len(self.blocks) - 2:
            p.backward = backward
        elif p.replayed and (backward is None or p.backward is None
                             or backward.normalized != p.backward.normalized):
            replay.doubts.append(f"{self.names[k]}'s backward differs from {self.names[-2]}'s")

    # -- replaying
    def replay_forward(self, p: BlockPass, k: int, args: tuple, kwargs: dict):
        template = p.forward
        assert template is not None
        with no_torch_function():
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != template.spec or len(leaves) != len(template.leaves):
                return _NOT_REPLAYED
            tensors = []
            for leaf, key in zip(leaves, template.leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    if not isinstance(leaf, FakeTensor) or tensor_key(leaf) != key:
                        return _NOT_REPLAYED
                    tensors.append(leaf)
                elif not isinstance(leaf, PLAIN_VALUES) or leaf != key or type(leaf) is not type(key):
                    return _NOT_REPLAYED
            shared = shared_with_first(tensors, p.first_inputs)
            if shared != template.shared or grad_and_autocast_state() != template.state:
                return _NOT_REPLAYED
            block = self.blocks[k]
            params = list(block.parameters())
            if torch.is_grad_enabled() and any(q.grad is not None for q in params):
                return _NOT_REPLAYED  # a second micro-step: gradients accumulate in place
            if any(t.requires_grad and t.grad_fn is None for t in tensors):
                return _NOT_REPLAYED  # a leaf argument that wants a gradient
            needing = [t for t in tensors if t.requires_grad]
            trainable = [q for q in params if q.requires_grad]
        p.replayed += 1
        self.replay.replayed += 1
        self.replay.unchecked.add(p)  # until its forward twin is compared
        context = ReplayContext(self.replay, self.names[k], p, tensors, len(needing), params,
                                trainable, list(block.buffers()))
        outputs = Replayed.apply(context, *needing, *trainable)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        it = iter(outputs)
        values = [next(it) if isinstance(d, tuple) else d for d in template.out_leaves]
        return pytree.tree_unflatten(values, template.out_spec)


_NOT_REPLAYED = object()


class BlockReplay:
    """Replays repeated blocks for one capture (see the module's docstring)."""

    def __init__(self, tracker: ModuleTracker, functions, ops, storages: StorageTracker) -> None:
        self.tracker, self.functions, self.ops, self.storages = tracker, functions, ops, storages
        self.replayed = 0
        self.doubts: list[str] = []
        # Passes that replayed blocks and never reached their second-to-last block, whose
        # forward confirms the replayed ones (a model that stops early, calls blocks out of order).
        self.unchecked: set[BlockPass] = set()

    def install(self, model: nn.Module) -> Callable[[], None]:
        undo: list[Callable[[], None]] = []
        for names, blocks in repeated_runs(model):
            run = _Run(self, names, blocks)
            undo.extend(run.wrap(k) for k in range(len(blocks)))

        def restore() -> None:
            for u in undo:
                u()

        return restore

    def check(self) -> None:
        """Raise `ReplayDoubt` when something replayed was not confirmed by its twins."""
        if self.doubts:
            raise ReplayDoubt(self.doubts[0])
        if self.unchecked:
            raise ReplayDoubt("a pass replayed blocks but never ran the block that confirms them")
