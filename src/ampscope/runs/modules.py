"""Which module is running, forward and backward, and a `ModuleCall` record for each call, from
public PyTorch hooks: docs/how-it-works.md#module-tracking-forward-and-backward says which, and
why not PyTorch's `ModTracker`.

Namesakes, the same concern at another layer: `torchcompat/modules.py`."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Literal

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from ampscope.patches import patch
from ampscope.records import ModuleCall, Phase, TensorMeta
from ampscope.runs.tensor_meta import metas, metas_of, no_torch_function, tensors_in
from ampscope.torchcompat.autograd import graph_task_id, queue_engine_callback
from ampscope.torchcompat.modules import drop_global_forward_hook


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return graph_task_id() != -1


def _no_local_tracing(frame, event: str, arg) -> None:
    """A global trace function that traces no new frame."""
    return None


def _running_forward(module: nn.Module):
    """The frame on this thread's stack running `module`'s own forward (called directly), or
    None. The outermost one, should forward call itself."""
    import inspect

    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    found = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get(code.co_varnames[0]) is module:
            found = frame
        frame = frame.f_back
    return found


def _on_gradients(tensors: list[torch.Tensor], hook: Callable,
                  mode: Literal["all", "any"]) -> None:
    """`register_multi_grad_hook(tensors, hook, mode=mode)`. For one tensor (most module calls)
    the tensor's own hook does the same for less than half the cost: autograd runs it once per
    backward pass, as either mode would (their lock and per-pass counts serve several tensors;
    "all" hands the gradients over as a list)."""
    if len(tensors) != 1:
        register_multi_grad_hook(tensors, hook, mode=mode)
    elif mode == "any":
        tensors[0].register_hook(hook)
    else:
        tensors[0].register_hook(lambda grad: hook([grad]))


def _quiet(hook: Callable) -> Callable:
    """`hook` run with torch functions off: the dtypes, shapes and flags it reads are no user
    calls for a TorchFunctionMode to see (see runs/tensor_meta.py)."""

    @functools.wraps(hook)
    def quiet(*args, **kwargs):
        with no_torch_function():
            return hook(*args, **kwargs)

    return quiet


class PhaseClock:
    """Which phase the run is in. Backward is read off the autograd engine. Once a backward
    pass has run, what follows until the model's next forward call — gradient clipping,
    GradScaler unscaling, `optimizer.step()` — is the optimizer phase."""

    def __init__(self) -> None:
        self.after_backward = False
        self.in_optimizer_step = False
        self.steps = 0  # optimizer.step() calls begun (runs/passes.py: was a pass stepped on)

    def step_begun(self) -> None:
        self.in_optimizer_step = True
        self.steps += 1

    def now(self) -> Phase:
        if in_backward():
            return Phase.BACKWARD
        if self.in_optimizer_step or self.after_backward:
            return Phase.OPTIMIZER
        return Phase.FORWARD


class OpenCall:
    """A module call whose record is not complete yet."""

    __slots__ = ("index", "name", "type", "phase", "depth", "inputs", "outputs", "module_id")

    def __init__(self, index: int, name: str, type_: str, phase: Phase, depth: int, inputs):
        self.index, self.name, self.type, self.phase = index, name, type_, phase
        self.depth, self.inputs = depth, inputs
        self.outputs: tuple[TensorMeta, ...] = ()
        self.module_id = 0  # id() of the module called, to tell module(...) from .forward(...)


# The backward hooks of one module call (two per call: a step makes thousands). Objects with
# slots rather than closures wrapped by `_quiet`: `functools.wraps` alone cost more than the
# hook's whole work.
class _BackwardStart:
    """Opens the module's backward call when its output's gradient arrives. With
    `enter=False` (a module that returned its input) the call is recorded, never entered: its
    backward runs no op."""

    __slots__ = ("tracker", "name", "type", "depth", "enter")

    def __init__(self, tracker: weakref.ref, name: str, type_: str, depth: int,
                 enter: bool) -> None:
        self.tracker, self.name, self.type, self.depth, self.enter = (tracker, name, type_,
                                                                      depth, enter)

    def __call__(self, grad: torch.Tensor) -> None:
        with no_torch_function():  # as `_quiet`
            tracker = self.tracker()
            if tracker is not None:
                call = OpenCall(tracker.call_count(), self.name, self.type, Phase.BACKWARD,
                                self.depth, metas(grad))
                tracker.open_backward(call, self.enter)


class _BackwardEnd:
    """Closes the module's backward call when its inputs' gradients are all computed."""

    __slots__ = ("tracker", "name")

    def __init__(self, tracker: weakref.ref, name: str) -> None:
        self.tracker, self.name = tracker, name

    def __call__(self, grads) -> None:
        with no_torch_function():  # as `_quiet`
            tracker = self.tracker()
            if tracker is not None:
                tracker.close_backward(self.name, grads)


class ModuleTracker:
    """Records module calls and knows the innermost running module.

    `names` maps modules of the traced model to their qualified names; a module outside it
    (a loss module built on the fly) is named by its class.
    """

    def __init__(self, names: dict[nn.Module, str]):
        self._names = names
        self._forward_stack: list[OpenCall] = []
        self._backward_stack: list[OpenCall] = []
        self._calls: list[OpenCall] = []
        self._handles: list = []
        self._engine_callback_queued = False
        # Set by the capture session: the phase clock (told when a backward pass is over), and
        # what to do when the root module is called (a new step begins) and has returned.
        self.phase: PhaseClock | None = None
        self.on_root_forward: Callable[[], None] | None = None
        self.on_root_forward_end: Callable[[object], None] | None = None  # with its output
        # Set when the model is not known yet (a script): called with the first module that
        # runs outside any other, and its arguments, before that call is recorded.
        self.on_new_root: Callable[[nn.Module, tuple], None] | None = None

    def add_names(self, names: dict[nn.Module, str]) -> None:
        self._names.update(names)

    # -- the calls recorded so far, for the replay engine (runs/windows.py)
    def call_count(self) -> int:
        return len(self._calls)

    def calls_between(self, start: int, end: int) -> list[OpenCall]:
        return self._calls[start:end]

    def add_call(self, name: str, type_: str, phase: Phase, depth: int, inputs: tuple,
                 outputs: tuple) -> OpenCall:
        """Append a call that ran no hook: a replayed block's module call, already closed."""
        call = OpenCall(len(self._calls), name, type_, phase, depth, inputs)
        call.outputs = outputs
        self._calls.append(call)
        return call

    def innermost_forward(self) -> OpenCall | None:
        """The innermost module call running in the forward pass, None outside any."""
        return self._forward_stack[-1] if self._forward_stack else None

    def current_in(self, backward: bool) -> str | None:
        """Qualified name of the innermost module running in the backward pass (`backward`)
        or the forward pass; None outside any module."""
        stack = self._backward_stack if backward else self._forward_stack
        return stack[-1].name if stack else None

    def records(self) -> list[ModuleCall]:
        return [ModuleCall(c.index, c.name, c.type, c.phase, c.depth, c.inputs, c.outputs)
                for c in sorted(self._calls, key=lambda c: c.index)]

    def watch_direct_calls(self, module: nn.Module,
                           on_call: Callable[[nn.Module, tuple, dict], None]
                           ) -> Callable[[], None]:
        """Record `module.forward(...)` called directly (as samplers do), which runs no hook,
        like `module(...)`; `on_call` stands for the module's own forward pre-hooks. Returns
        what undoes it."""
        original = module.forward

        @functools.wraps(original)  # its signature names the model's inputs
        def forward(*args, **kwargs):
            stack = self._forward_stack
            if stack and stack[-1].module_id == id(module):  # module(...): its hooks ran
                return original(*args, **kwargs)
            self._forward_pre(module, args)
            on_call(module, args, kwargs)
            try:
                output = original(*args, **kwargs)
            except BaseException:
                self._forward_post(module, args, None)
                raise
            self._forward_post(module, args, kwargs, output)
            return output

        return patch(module, "forward", forward)

    def enter_running(self, module: nn.Module,
                      on_call: Callable[[nn.Module, tuple, dict], None]) -> bool:
        """Record a call of `module` that is already running: a script called
        `model.forward(...)` directly before the model was known, so neither a hook nor the
        `watch_direct_calls` wrapper saw it start. The call is opened now, with the arguments
        its frame holds, and closed with its return value when that frame returns (a trace
        function on that one frame). False, and nothing recorded, where the frame is not found
        or another tracer (a debugger, coverage) owns `sys.settrace`."""
        frame = _running_forward(module)
        if frame is None or sys.gettrace() is not None:
            return False
        code = frame.f_code
        named = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]  # after self
        local = frame.f_locals
        args = tuple(local[n] for n in named if n in local)
        self._forward_pre(module, args)
        on_call(module, args, {})

        def on_event(f, event: str, arg):
            if event == "return":  # also as an exception leaves it (arg None)
                sys.settrace(None)
                self._forward_post(module, args, {}, arg)
            return on_event

        frame.f_trace = on_event
        frame.f_trace_lines = False
        sys.settrace(_no_local_tracing)  # return events reach f_trace only while tracing is on
        return True

    # -- install / remove
    def __enter__(self) -> ModuleTracker:
        self._handles = [
            register_module_forward_pre_hook(self._forward_pre),
            register_module_forward_hook(self._forward_post, with_kwargs=True, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
            # A global forward hook's handle does not remove its with_kwargs/always_call
            # entries (a PyTorch bug): remove them, so the global dicts are as they were.
            drop_global_forward_hook(handle.id)
        self._handles = []
        if sys.gettrace() is _no_local_tracing:  # a running call that never returned
            sys.settrace(None)

    # -- forward
    def _name(self, module: nn.Module) -> str:
        name = self._names.get(module)
        return name if name is not None else type(module).__name__

    @_quiet
    def _forward_pre(self, module: nn.Module, args) -> None:
        if in_backward():  # a module called inside a custom backward: not a model call
            return
        if self.on_new_root is not None and not self._forward_stack:
            self.on_new_root(module, args)
        name = self._name(module)
        if name == "" and not self._forward_stack and self.on_root_forward is not None:
            self.on_root_forward()
        phase = self.phase.now() if self.phase is not None else Phase.FORWARD
        call = OpenCall(
            len(self._calls), name, type(module).__name__, phase,
            len(self._forward_stack), metas(args),
        )
        call.module_id = id(module)
        self._calls.append(call)
        self._forward_stack.append(call)

    @_quiet
    def _forward_post(self, module: nn.Module, args, *rest) -> None:
        # Normally (module, args, kwargs, output); when the module raised, PyTorch calls
        # always_call hooks as (module, args, output) even when registered with_kwargs.
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        if in_backward() or not self._forward_stack:
            return
        call = self._forward_stack.pop()
        if call.depth == 0 and call.name == "" and self.on_root_forward_end is not None:
            self.on_root_forward_end(output)
        # Global pre-hooks see positional arguments only; the post-hook sees keyword tensors
        # too (Hugging Face modules take `hidden_states=`), and dtypes cannot change in place.
        input_tensors = tensors_in((args, kwargs))
        outputs = tensors_in(output)
        call.inputs, call.outputs = metas_of(input_tensors), metas_of(outputs)
        if torch.is_grad_enabled():
            # The backward hooks reach the tracker through a weak reference: autograd may keep a
            # hook after the step, and it must not keep the tracker (and all its records) alive.
            tracker, name = weakref.ref(self), self._name(module)
            inputs = {id(t) for t in input_tensors}
            # A module that returned its input (nn.Identity, Dropout(p=0)): its backward runs no
            # op, and the gradient it would wait for is the one the module before it produces.
            returned_input = bool(outputs) and all(id(t) in inputs for t in outputs)
            # Leaf inputs are left out: an "all"-mode multi-grad hook on a leaf is kept alive by
            # autograd after the step (with the gradients it buffered). A module fed a leaf is
            # closed by the end-of-backward callback instead.
            inputs_needing_grad = [t for t in input_tensors
                                   if t.requires_grad and t.grad_fn is not None]
            if inputs_needing_grad and not returned_input:
                _on_gradients(inputs_needing_grad, _BackwardEnd(tracker, name), "all")
            needing_grad = [t for t in outputs if t.requires_grad]
            if needing_grad:
                _on_gradients(needing_grad, _BackwardStart(tracker, name, type(module).__name__,
                                                           call.depth, not returned_input), "any")

    # -- backward
    def open_backward(self, call: OpenCall, enter: bool) -> None:
        """A module's backward call begins (its output's gradient arrived)."""
        self._queue_end_of_backward()
        self._calls.append(call)
        if not enter:
            call.outputs = call.inputs
            return
        # Keep the deepest module innermost: a parent that returns its child's output as is
        # starts its backward on the same gradient, after the child.
        stack = self._backward_stack
        position = len(stack)
        while position and stack[position - 1].depth > call.depth:
            position -= 1
        stack.insert(position, call)

    def close_backward(self, name: str, grads) -> None:
        """Module `name`'s backward call ends with its inputs' gradients `grads`."""
        for i in range(len(self._backward_stack) - 1, -1, -1):
            call = self._backward_stack[i]
            if call.name == name:
                call.outputs = metas([g for g in grads if g is not None])
                del self._backward_stack[i]
                return

    def _queue_end_of_backward(self) -> None:
        # Modules whose inputs need no gradient (an embedding fed token ids) never see their
        # backward end: close them when the whole backward pass is over.
        if self._engine_callback_queued:
            return
        self._engine_callback_queued = True

        def end_of_backward() -> None:
            self._backward_stack.clear()
            self._engine_callback_queued = False
            if self.phase is not None:
                self.phase.after_backward = True

        queue_engine_callback(end_of_backward)
