"""Repeated blocks traced once: in a predicted run, the records of a model's identical blocks
are recorded from two of them and replayed for the others, which never dispatch an op.

A transformer's N blocks run the same ops on the same metadata; on fake tensors each op costs
its dispatch and nothing else, so a step costs about N times one block. Here, within each run of
at least `MIN_BLOCKS` structurally identical children of a `ModuleList` or `Sequential`:

- blocks 0 and 1, and the last two, run and are recorded as usual. Block 1's forward and the
  second-to-last block's backward are recorded as *windows*: the op, call and module records
  they appended, the storages they made, and the storages that were freed while they ran;
- every block in between whose call matches block 1's (same argument structure, the same
  tensor metadata, the same tensors shared with block 0, the same plain values, the same grad
  and autocast state, no gradients yet) does not run. Its forward appends block 1's records,
  renamed to its own modules and parameters, makes fake tensors for its outputs, and returns
  them from an autograd Function whose backward appends the second-to-last block's backward
  records and returns fake gradients for its inputs and parameters;
- storages follow their twin: one a replayed block made that block 1's twin kept past its
  forward is freed when that twin is (an autocast cast dropped with autocast's cache), unless
  the backward replay frees it first, where the recorded backward freed its own twin. Storages
  from outside a window that it freed (the block's input, the gradient of its output) are
  dated where the window freed them.

Nothing is assumed without being checked: a block is replayed only when its structure (classes,
parameters, buffers, attributes; an integer attribute may differ only by being the block's
index, and the classes may read it only to pass it on or index with it) and its call match,
and a window is used only when everything it made and freed is accounted for. The recorded
blocks are then compared with one another (block 1's forward with the second-to-last block's,
block 1's backward with the second-to-last block's): when they differ, `ReplayDoubt` is raised
and the caller runs the step again without replaying. docs/how-it-works.md tells the rest.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ampscope.recorders.memory import StorageTracker, storage_of
from ampscope.recorders.modules import ModuleTracker, OpenCall
from ampscope.recorders.tensors import meta_of, no_torch_function

MIN_BLOCKS = 5  # two recorded at each end and at least one replayed

# What every nn.Module keeps in its __dict__: not part of a block's structure.
_MODULE_FIELDS = frozenset({
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_modules", "_compiled_call_impl",
})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class ReplayDoubt(Exception):
    """A replayed block's recorded twins turned out to differ: trace the step again in full."""


@contextlib.contextmanager
def _bookkeeping(what: str) -> Iterator[None]:
    """ampscope's own work around a block (never the block's code): should it fail, that is a
    doubt — the step runs again with every block dispatched — and never the user's error."""
    try:
        yield
    except ReplayDoubt:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the bookkeeping is a doubt
        raise ReplayDoubt(f"{what}: {type(e).__name__}: {e}") from e


# -- which blocks are alike


def _value_key(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return (type(value), tuple(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.stride()))
    if isinstance(value, functools.partial):  # an activation made per layer: gelu(tanh)
        return ("partial", _value_key(value.func), tuple(map(_value_key, value.args)),
                tuple(sorted((k, _value_key(v)) for k, v in value.keywords.items())))
    if isinstance(value, types.MethodType):  # bound to its own module: the same method
        return ("method", value.__func__, type(value.__self__))
    if type(value).__eq__ is not object.__eq__:  # a config made per layer (a frozen dataclass)
        try:
            hash(value)
            return ("equal", type(value), value)
        except TypeError:
            pass
    return ("object", id(value))  # a shared config object, a function: the same object


def _structure(block: nn.Module) -> list[tuple] | None:
    """(where, what) pairs describing a block; None when it carries hooks or its own forward."""
    out: list[tuple] = []
    for rel, m in block.named_modules():
        if any(getattr(m, h, None) for h in _HOOKS) or "forward" in m.__dict__:
            return None
        out.append((rel, "class", type(m)))
        for kind, named in (("parameter", m._parameters), ("buffer", m._buffers)):
            for key, t in named.items():
                out.append((rel, kind, key, None if t is None else (
                    type(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad)))
        for key, value in m.__dict__.items():
            if key not in _MODULE_FIELDS:
                out.append((rel, "attribute", key, _value_key(value)))
    return out


def _reads_index(cls: type, attribute: str) -> bool:
    """Whether a class's methods (other than __init__, its own or inherited) use
    `self.<attribute>` other than as a call's argument or a subscript: code that branches on a
    block's index makes the blocks differ. A method whose source cannot be read counts as one
    that does."""
    passed = re.compile(r"[(,\[]\s*(?:\w+\s*=\s*)?self\." + attribute + r"\s*[,)\]]")
    used = re.compile(r"self\." + attribute + r"\b")
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for name, member in vars(klass).items():
            if name == "__init__" or not inspect.isfunction(member):
                continue
            try:
                source = inspect.getsource(member)
            except (OSError, TypeError):
                return True
            if len(used.findall(source)) != len(passed.findall(source)):
                return True
    return False


def alike(blocks: list[nn.Module], first_index: int = 0) -> bool:
    """Whether the blocks are structurally identical up to an index attribute (each block's
    position in its list: `first_index` for the first of them)."""
    structures = [_structure(b) for b in blocks]
    if any(s is None for s in structures):
        return False
    first = structures[0]
    if any(len(s) != len(first) for s in structures):
        return False
    for entries in zip(*structures, strict=True):
        if all(e == entries[0] for e in entries):
            continue
        where, kind, key = entries[0][0], entries[0][1], entries[0][2]
        # Only an integer attribute that is each block's index may differ (layer_idx).
        if kind != "attribute" or any(e[:3] != (where, kind, key) or type(e[3]) is not int
                                      or e[3] != first_index + i for i, e in enumerate(entries)):
            return False
        module = blocks[0].get_submodule(where) if where else blocks[0]
        if _reads_index(type(module), key):
            return False
    ids = [id(p) for b in blocks for p in b.parameters()]
    return len(ids) == len(set(ids))  # no parameter shared between blocks


def _stretches(blocks: list[nn.Module]) -> list[tuple[int, int]]:
    """The longest stretches [start, end) of at least MIN_BLOCKS consecutive blocks that look
    alike — the same structure, an integer attribute equal to each one's position aside — as
    candidates for `alike` (a model whose first layers are dense and the rest mixtures of
    experts has one stretch of each)."""
    structures = [_structure(b) for b in blocks]
    # Integer attributes whose value varies along the list may be an index; one that is the
    # same in every block (8 key-value groups) is no index where it equals a position (block 8).
    values: dict[tuple, set] = {}
    for structure in structures:
        for e in structure or ():
            if e[1] == "attribute" and type(e[3]) is int:
                values.setdefault(e[:3], set()).add(e[3])
    varying = {where for where, seen in values.items() if len(seen) > 1}
    keys = [None if structure is None else tuple(
        (*e[:3], "index") if e[:3] in varying and e[3] == i else e for e in structure)
        for i, structure in enumerate(structures)]
    stretches, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or keys[i] != keys[start]:
            if keys[start] is not None and i - start >= MIN_BLOCKS:
                stretches.append((start, i))
            start = i
    return stretches


def repeated_runs(model: nn.Module) -> list[tuple[list[str], list[nn.Module]]]:
    """The outermost runs of identical blocks: (qualified names, blocks) of each. A run is a
    whole ModuleList or Sequential, or a stretch of consecutive children of one."""
    names = {m: n for n, m in model.named_modules()}
    runs: list[tuple[list[str], list[nn.Module]]] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(m.children())
        for start, end in _stretches(children) if len(children) >= MIN_BLOCKS else ():
            blocks = children[start:end]
            if alike(blocks, start):
                runs.append(([names[b] for b in blocks], blocks))
                inside.update(id(x) for b in blocks for x in b.modules())
    return runs


# -- windows: what a recorded block call did


def _renamer(old: str, new: str) -> Callable[[str | None], str | None]:
    dotted = old + "."

    def rename(name: str | None) -> str | None:
        if name is None:
            return None
        if name == old:
            return new
        if name.startswith(dotted):
            return new + name[len(old):]
        return name

    return rename


class _Window:
    """One recorded block call in one phase: where its records start and end, the storages it
    made (their fates) and the storages from outside it that it freed."""

    def __init__(self, replay: BlockReplay, prefix: str) -> None:
        self.prefix = prefix
        self.r0 = len(replay.ops.rows)
        self.f0 = len(replay.functions.rows)
        self.c0 = len(replay.tracker._calls)
        self.s0 = len(replay.storages._seen)
        self.log0 = replay.storages.start_log()
        self.r1 = self.f1 = self.c1 = self.s1 = self.log1 = 0

    def close(self, replay: BlockReplay) -> None:
        self.r1 = len(replay.ops.rows)
        self.f1 = len(replay.functions.rows)
        self.c1 = len(replay.tracker._calls)
        self.s1 = len(replay.storages._seen)
        self.log1 = replay.storages.stop_log()
        # The calls of its modules; not its own (opened by the module tracker's hooks, which
        # may run before or after the window's) nor the next block's backward, opened by the
        # same gradient that closes this one.
        children = self.prefix + "."
        self.calls = [c for c in replay.tracker._calls[self.c0:self.c1]
                      if c.name.startswith(children)]

    def created(self, replay: BlockReplay) -> list:
        return replay.storages._seen[self.s0:self.s1]

    def external_frees(self, replay: BlockReplay) -> list:
        """Storages made before the window and freed in it, with the op index they were
        freed at."""
        mine = {id(e) for e in self.created(replay)}
        return [e for e in replay.storages.log[self.log0:self.log1] if id(e) not in mine]

    def in_window(self, index: int | None) -> bool:
        return index is not None and self.r0 - 1 <= index < self.r1

    def normalized(self, replay: BlockReplay, fates: list) -> tuple:
        """The window's records with its block's names and its indices made relative: two
        windows of identical blocks that did the same thing compare equal."""
        rel = _renamer(self.prefix, "")
        rows = tuple(
            (r[1], rel(r[2]), r[3], r[4], r[5], r[6], None if r[7] is None else r[7] - self.f0,
             r[8], tuple(map(rel, r[9])), r[10], r[11], r[12], r[13])
            for r in replay.ops.rows[self.r0:self.r1])
        functions = tuple((r[1], rel(r[2]), r[3], r[4], r[5], r[6], r[7])
                          for r in replay.functions.rows[self.f0:self.f1])
        calls = tuple((rel(c.name), c.type, c.phase, c.depth, c.inputs, c.outputs)
                      for c in self.calls)
        storages = tuple((e.nbytes, e.meta, e.created - self.r0) for e in self.created(replay))
        return rows, functions, calls, storages, tuple(fates)


# -- the replay itself


class _Pass:
    """One forward pass through a run of blocks (a new one starts at block 0), and what its
    recorded blocks left for the replayed ones."""

    def __init__(self) -> None:
        self.off = False  # something did not check out: the rest of the pass runs for real
        self.last = 0
        self.replayed = 0
        self.first_inputs: list[weakref.ref] = []  # block 0's tensor arguments
        self.forward: _Forward | None = None  # block 1's forward window, usable for replay
        self.forward_twin: _Forward | None = None  # the second-to-last block's forward window
        self.backward: _Backward | None = None  # the second-to-last block's backward window


class _Forward:
    """A recorded block forward, ready to replay."""

    def __init__(self, window: _Window, spec, leaves: list, shared: list[bool],
                 inputs: list, out_spec, out_leaves: list, saved_inputs: list[int],
                 fates: list, input_frees: list[tuple[int, int]], state: tuple) -> None:
        self.window = window
        self.spec = spec  # the arguments' structure
        self.leaves = leaves  # per argument leaf: a tensor's key, or the plain value
        self.shared = shared  # per tensor argument: the same tensor block 0 got
        self.inputs = inputs  # the tensor arguments' storage entries (to tell which it freed)
        self.out_spec = out_spec
        self.out_leaves = out_leaves  # per output leaf: (shape, stride, dtype, device, grad) or value
        # Positions its graph saved in [*tensor arguments, *parameters, *buffers].
        self.saved_inputs = saved_inputs
        self.fates = fates  # per storage made: ("out", k), ("freed", offset) or "kept"
        self.state = state  # grad mode and autocast as it ran
        self.normalized: tuple = ()  # its records made relative, to compare with its twin
        self.input_frees = input_frees  # (tensor argument position, offset freed at)


class _Backward:
    """A recorded block backward, ready to replay."""

    def __init__(self, window: _Window, fates: list, frees: list[tuple], grad_inputs: list,
                 grad_params: list) -> None:
        self.window = window
        self.fates = fates  # per storage made: ("grad_in", k), ("grad_param", k), "freed", "kept"
        self.frees = frees  # (("made", j) | ("input", k) | ("grad_out", k), offset)
        self.grad_inputs = grad_inputs  # per input needing grad: its gradient's meta (or None)
        self.grad_params = grad_params  # per parameter: its gradient's meta (or None)
        self.normalized: tuple = ()


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device,
            t.requires_grad, t.grad_fn is None, type(t))


def _state() -> tuple:
    return (torch.is_grad_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                  for d in ("cpu", "cuda")))


class _Run:
    """One run of identical blocks, its forwards wrapped for recording or replaying."""

    def __init__(self, replay: BlockReplay, names: list[str], blocks: list[nn.Module]) -> None:
        self.replay = replay
        self.names = names
        self.blocks = blocks
        self.current: _Pass | None = None

    def wrap(self, k: int) -> Callable[[], None]:
        block = self.blocks[k]
        original = block.forward
        run = self

        def forward(*args, **kwargs):
            return run.call(k, original, args, kwargs)

        block.forward = forward
        return lambda: block.__dict__.pop("forward", None)

    def call(self, k: int, original: Callable, args: tuple, kwargs: dict):
        tracker = self.replay.tracker
        stack = tracker._forward_stack
        if not stack or stack[-1].module_id != id(self.blocks[k]) or torch._C._current_graph_task_id() != -1:
            return original(*args, **kwargs)  # called as .forward(...), or inside a backward
        if k == 0:
            self.current = _Pass()
        p = self.current
        if p is None or p.off or p.last != k - 1 and k != 0:
            if p is not None:
                p.off = True
            return original(*args, **kwargs)
        p.last = k
        n = len(self.blocks)
        if k == 0:
            with no_torch_function():
                p.first_inputs = [weakref.ref(t) for t in _leaves((args, kwargs))[0]
                                  if isinstance(t, torch.Tensor)]
            return original(*args, **kwargs)
        if k == 1 or k == n - 2:
            return self.record_forward(p, k, original, args, kwargs)
        if 2 <= k <= n - 3 and p.forward is not None:
            replayed = self.replay_forward(p, k, args, kwargs)
            if replayed is not _NOT_REPLAYED:
                return replayed
        return original(*args, **kwargs)

    # -- recording
    def record_forward(self, p: _Pass, k: int, original: Callable, args: tuple, kwargs: dict):
        replay = self.replay
        block = self.blocks[k]
        with _bookkeeping(self.names[k]), no_torch_function():
            leaves, spec = _leaves((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            fake = all(_is_fake(t) for t in tensors) and tensors
            inputs = [replay.storages.entry_of(t) for t in tensors]
            state = _state()
            attributes = _attribute_ids(block)
        with _bookkeeping(self.names[k]):
            window = _Window(replay, self.names[k])
        out = original(*args, **kwargs)
        with _bookkeeping(self.names[k]), no_torch_function():
            window.close(replay)
            usable = fake and _attribute_ids(block) == attributes
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
            with _bookkeeping(self.names[k]):
                self._watch_backward(p, k, window.prefix, tensors, out, recorded)
        return out

    def _forward_of(self, window: _Window, p: _Pass, k: int, spec, leaves: list,
                    tensors: list, inputs: list, out, state: tuple) -> _Forward | None:
        replay = self.replay
        out_leaves, out_spec = _leaves(out)
        if not _plain_spec(spec) or not _plain_spec(out_spec):
            return None
        outputs = []
        described: list = []
        for leaf in out_leaves:
            if isinstance(leaf, torch.Tensor):
                outputs.append(replay.storages.entry_of(leaf))
                described.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device,
                                  leaf.requires_grad))
            elif isinstance(leaf, _PLAIN):
                described.append(leaf)
            else:
                return None  # an object made by the block (a cache): cannot be made up
        made = window.created(replay)
        index = {id(e): j for j, e in enumerate(made)}
        if any(e is None or id(e) not in index for e in outputs) or \
                len({id(e) for e in outputs}) != len(outputs):
            return None  # an output that is an input, or a view of another output
        output_of = {id(e): i for i, e in enumerate(outputs)}
        fates: list = []
        for e in made:
            if id(e) in output_of:
                fates.append(("out", output_of[id(e)]))
            elif window.in_window(e.freed):
                fates.append(("freed", e.freed - window.r0))
            else:
                fates.append("kept")
        input_of = {id(e): i for i, e in enumerate(inputs) if e is not None}
        input_frees = []
        for e in window.external_frees(replay):
            if id(e) not in input_of:
                return None  # freed something that is not its argument
            input_frees.append((input_of[id(e)], e.freed - window.r0))
        if not self._window_closed(window):
            return None
        shared = _shared(tensors, p.first_inputs)
        keys = [_tensor_key(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        if any(not isinstance(t, (torch.Tensor, *_PLAIN)) for t in leaves):
            return None  # an object argument (a cache) the block may change
        # What its autograd graph saved from outside it: a replayed twin saves the same (for
        # the storages' `saved` flags and lifetimes), or the window is not used.
        # (Only storages the tracker knows: a Python scalar autograd saves as a tensor made
        # without an op is no memory the trace counts.)
        saved = (_saved_storages(out, tensors) & replay.storages._live.keys()) - {e.key for e in made}
        held = [*tensors, *self.blocks[k].parameters(), *self.blocks[k].buffers()]
        saved_inputs = [i for i, t in enumerate(held) if id(storage_of(t)) in saved]
        if saved - {id(storage_of(held[i])) for i in saved_inputs}:
            return None
        recorded = _Forward(window, spec, keys, shared, inputs, out_spec, described,
                            saved_inputs, fates, input_frees, state)
        recorded.normalized = window.normalized(replay, [*fates, *input_frees, *saved_inputs])
        return recorded

    def _window_closed(self, window: _Window) -> bool:
        """Every record in the window is the block's own, and its ops' callers are in it."""
        replay = self.replay
        rename = _renamer(window.prefix, "@")
        if any(not (rename(r[2]) or "").startswith("@") for r in replay.ops.rows[window.r0:window.r1]):
            return False
        if any(r[7] is not None and not window.f0 <= r[7] < window.f1
               for r in replay.ops.rows[window.r0:window.r1]):
            return False
        return len(window.calls) == window.c1 - window.c0

    def _watch_backward(self, p: _Pass, k: int, prefix: str, tensors: list, out,
                        recorded: _Forward) -> None:
        """Record this block's backward as a window: from its outputs' gradients arriving to
        its inputs' gradients leaving (tensor hooks; they change no gradient)."""
        outputs = [t for t in _leaves(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
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
                    state["window"] = _Window(self_.replay, prefix)
            return hook

        def left(i):
            def hook(grad):
                self_ = run()
                if self_ is None or state["window"] is None:
                    return
                state["grad_in"][i] = (self_.replay.storages.entry_of(grad), meta_of(grad),
                                       tuple(grad.stride()))
                if len(state["grad_in"]) == wanted:
                    window = state["window"]
                    window.close(self_.replay)
                    with _bookkeeping(prefix), no_torch_function():
                        self_._backward_of(p, k, window, state, wanted, params, recorded)
            return hook

        for i, t in enumerate(outputs):
            t.register_hook(arrived(i))
        for i, t in enumerate(needing):
            t.register_hook(left(i))

    def _backward_of(self, p: _Pass, k: int, window: _Window, state: dict, wanted: int,
                     params: list, recorded: _Forward) -> None:
        replay = self.replay
        made = window.created(replay)
        grad_in = {id(entry): i for i, (entry, _, _) in state["grad_in"].items() if entry is not None}
        grads = [q.grad for q in params]
        grad_param = {id(replay.storages.entry_of(g)): i for i, g in enumerate(grads)
                      if g is not None}
        fates: list = []
        for e in made:
            if id(e) in grad_in:
                fates.append(("grad_in", grad_in[id(e)]))
            elif id(e) in grad_param:
                fates.append(("grad_param", grad_param[id(e)]))
            elif window.in_window(e.freed):
                fates.append(("freed", e.freed - window.r0))
            else:
                fates.append("kept")
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
        usable = usable and self._window_closed_backward(window)
        backward = None
        if usable:
            backward = _Backward(
                window, fates, frees,
                [state["grad_in"][i][1:] for i in range(wanted)],
                [None if g is None else (meta_of(g), tuple(g.stride()), g.dtype, g.device)
                 for g in grads])
            backward.normalized = window.normalized(replay, [*fates, *frees])
        if k == len(self.blocks) - 2:
            p.backward = backward
        elif p.replayed and (backward is None or p.backward is None
                             or backward.normalized != p.backward.normalized):
            replay.doubts.append(f"{self.names[k]}'s backward differs from {self.names[-2]}'s")

    def _window_closed_backward(self, window: _Window) -> bool:
        rename = _renamer(window.prefix, "@")
        return all((rename(r[2]) or "").startswith("@")
                   for r in self.replay.ops.rows[window.r0:window.r1])

    # -- replaying
    def replay_forward(self, p: _Pass, k: int, args: tuple, kwargs: dict):
        with _bookkeeping(self.names[k]):
            return self._replay_forward(p, k, args, kwargs)

    def _replay_forward(self, p: _Pass, k: int, args: tuple, kwargs: dict):
        template = p.forward
        assert template is not None
        with no_torch_function():
            leaves, spec = _leaves((args, kwargs))
            if spec != template.spec or len(leaves) != len(template.leaves):
                return _NOT_REPLAYED
            tensors = []
            for leaf, key in zip(leaves, template.leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    if not _is_fake(leaf) or _tensor_key(leaf) != key:
                        return _NOT_REPLAYED
                    tensors.append(leaf)
                elif not isinstance(leaf, _PLAIN) or leaf != key or type(leaf) is not type(key):
                    return _NOT_REPLAYED
            shared = _shared(tensors, p.first_inputs)
            if shared != template.shared or _state() != template.state:
                return _NOT_REPLAYED
            block = self.blocks[k]
            params = list(block.parameters())
            if torch.is_grad_enabled() and any(q.grad is not None for q in params):
                return _NOT_REPLAYED  # a second micro-step: gradients accumulate in place
            if any(t.requires_grad and t.grad_fn is None for t in tensors):
                return _NOT_REPLAYED  # a leaf argument that wants a gradient
        p.replayed += 1
        self.replay.replayed += 1
        self.replay.unchecked.add(p)  # until its forward twin is compared
        needing = [t for t in tensors if t.requires_grad]
        trainable = [q for q in params if q.requires_grad]
        context = _Context(self, p, k, tensors, len(needing), trainable)
        outputs = _Replayed.apply(context, *needing, *trainable)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        it = iter(outputs)
        values = [next(it) if isinstance(d, tuple) else d for d in template.out_leaves]
        return pytree.tree_unflatten(values, template.out_spec)


_NOT_REPLAYED = object()


class _Context:
    """What a replayed block's forward leaves for its backward: no tensor (autograd holds what
    the block saves, and frees it as it would), the entries of its arguments' storages."""

    def __init__(self, run: _Run, p: _Pass, k: int, tensors: list, needing: int,
                 params: list) -> None:
        self.run, self.p, self.k = run, p, k
        self.tensors: list | None = tensors  # until the forward replay is done
        self.inputs: list = []  # the arguments' storage entries
        self.needing = needing
        self.params = params
        self.made: list = []  # per storage block 1's forward made: this block's twin entry


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, context: _Context, *tensors):
        with _bookkeeping(context.run.names[context.k]):
            return _Replayed._forward(ctx, context, tensors)

    @staticmethod
    def _forward(ctx, context: _Context, tensors: tuple):
        run, p, k = context.run, context.p, context.k
        template = p.forward
        replay = run.replay
        prefix = run.names[k]
        with no_torch_function():
            outputs = [_fake_like(context.tensors[0] if context.tensors else tensors[0], d)
                       for d in template.out_leaves if isinstance(d, tuple)]
            inputs = context.inputs = [replay.storages.entry_of(t) for t in context.tensors]
            made = replay.append_window(
                template.window, prefix, template.fates,
                real={("out", i): t for i, t in enumerate(outputs)},
                pins=[(inputs[i], offset) for i, offset in template.input_frees])
        context.made = made
        ctx.context = context
        block = run.blocks[k]
        held = [*context.tensors, *block.parameters(), *block.buffers()]
        ctx.save_for_backward(*[held[i] for i in template.saved_inputs])
        context.tensors = None
        not_differentiable = [t for t, d in zip(outputs, [d for d in template.out_leaves
                                                          if isinstance(d, tuple)], strict=True)
                              if not d[4]]
        if not_differentiable:
            ctx.mark_non_differentiable(*not_differentiable)
        return tuple(outputs) if len(outputs) != 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        with _bookkeeping(ctx.context.run.names[ctx.context.k]):
            return _Replayed._backward(ctx, grad_outputs)

    @staticmethod
    def _backward(ctx, grad_outputs: tuple):
        context: _Context = ctx.context
        run, p, k = context.run, context.p, context.k
        replay = run.replay
        template, twin = p.backward, p.forward_twin
        if template is None or twin is None or p.forward is None or \
                twin.normalized != p.forward.normalized:
            raise ReplayDoubt(f"{run.names[k]}'s backward has no recorded twin to replay")
        with no_torch_function():
            like = grad_outputs[0] if grad_outputs else None
            grad_inputs = [None if d is None else _fake_like(like, (d[0].shape, d[1], _dtype(d[0]),
                                                                     like.device, False))
                           for d in template.grad_inputs]
            grad_params = [None if d is None else _fake_like(like, (d[0].shape, d[1], d[2], d[3],
                                                                     False))
                           for d in template.grad_params]
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
            replay.append_window(template.window, run.names[k], template.fates, real=real,
                                 pins=releases)
        all_params = list(run.blocks[k].parameters())
        trainable = {id(q) for q in context.params}
        by_param = [g for q, g in zip(all_params, grad_params, strict=True) if id(q) in trainable]
        return (None, *grad_inputs[:context.needing], *by_param)


# -- helpers


def _leaves(tree) -> tuple[list, Any]:
    return pytree.tree_flatten(tree)


def _plain_spec(spec) -> bool:
    """Whether a pytree structure is made of tuples, lists and dicts only (an object that
    pytree knows how to flatten, a cache, may be changed by the block)."""
    return spec.type in (None, tuple, list, dict) and all(
        _plain_spec(c) for c in spec.children())


def _shared(tensors: list, first: list[weakref.ref]) -> list[bool]:
    """Per tensor: whether block 0 was given the very same tensor (a rotary table, a mask)."""
    given = [r() for r in first]
    return [any(t is g for g in given) for t in tensors]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _dtype(meta) -> torch.dtype:
    return getattr(torch, meta.dtype)


def _fake_like(like: torch.Tensor, described: tuple) -> torch.Tensor:
    """A fake tensor as described ((shape, stride, dtype, device, requires_grad)), made in
    `like`'s fake mode with no recorder or other mode seeing it."""
    shape, stride, dtype, device, _ = described
    with _disable_current_modes(), like.fake_mode:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _attribute_ids(block: nn.Module) -> list:
    return [(id(m), tuple((k, id(v)) for k, v in m.__dict__.items() if k not in _MODULE_FIELDS))
            for m in block.modules()]


def _saved_storages(out, inputs: list) -> set[int]:
    """Ids of the storages the autograd graph behind `out` saved, down to the block's inputs."""
    from ampscope.recorders.memory import saved_tensors

    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    found: set[int] = set()
    seen: set[int] = set()
    stack = [t.grad_fn for t in _leaves(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        for t in saved_tensors(node):
            s = storage_of(t)
            if s is not None:
                found.add(id(s))
        stack.extend(n for n, _ in node.next_functions)
    return found


class BlockReplay:
    """Replays repeated blocks for one capture (see the module's docstring)."""

    def __init__(self, tracker: ModuleTracker, functions, ops, storages: StorageTracker) -> None:
        self.tracker, self.functions, self.ops, self.storages = tracker, functions, ops, storages
        self.replayed = 0
        self.blocks = 0
        self.doubts: list[str] = []
        # Passes that replayed blocks and never reached their second-to-last block, whose
        # forward confirms the replayed ones (a model that stops early, calls blocks out of order).
        self.unchecked: set[_Pass] = set()

    def install(self, model: nn.Module) -> Callable[[], None]:
        undo: list[Callable[[], None]] = []
        for names, blocks in repeated_runs(model):
            run = _Run(self, names, blocks)
            self.blocks += len(blocks)
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

    def append_window(self, window: _Window, prefix: str, fates: list, *, real: dict,
                      pins: list) -> list:
        """Append a window's records renamed to `prefix`, its storages made again (as entries
        that follow their twins, or as the `real` tensors given for its outputs and
        gradients), and date the frees in `pins` ((entry, offset) pairs). Returns the entries
        made, one per storage the window made."""
        ops, functions, tracker, storages = self.ops, self.functions, self.tracker, self.storages
        rename = _renamer(window.prefix, prefix)
        r_start, f_start = len(ops.rows), len(functions.rows)
        shift_f = f_start - window.f0
        step = functions.step
        for r in functions.rows[window.f0:window.f1]:
            functions.rows.append((r[0] + shift_f, r[1], rename(r[2]), r[3], r[4], r[5], r[6],
                                   r[7], step))
        for c in window.calls:
            call = OpenCall(len(tracker._calls), rename(c.name), c.type, c.phase, c.depth, c.inputs)
            call.outputs = c.outputs
            tracker._calls.append(call)
        rows = ops.rows
        shift = r_start - window.r0
        for r in rows[window.r0:window.r1]:
            rows.append((r[0] + shift, r[1], rename(r[2]), r[3], r[4], r[5], r[6],
                         None if r[7] is None else r[7] + shift_f, r[8], tuple(map(rename, r[9])),
                         r[10], r[11], r[12], r[13]))
        functions.ops_seen += window.r1 - window.r0
        made = []
        for e, fate in zip(window.created(self), fates, strict=True):
            created = e.created + shift
            if isinstance(fate, tuple) and fate[0] != "freed":
                tensor = real.get(fate)
                made.append(storages.made_by_replay(tensor, created, e)
                            if tensor is not None else None)
            else:
                freed = fate[1] + r_start if isinstance(fate, tuple) else None
                try:
                    made.append(storages.replayed(e, created, freed))
                except LookupError as gone:
                    raise ReplayDoubt(f"{prefix}: {gone}") from None
        for entry, offset in pins:
            if entry is not None:
                storages.date_free(entry, r_start + offset)
        if ops._progress is not None:
            ops._progress.op(len(rows), rows[-1][3] if rows else "forward")
        return made

