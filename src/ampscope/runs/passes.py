"""What each forward pass of the model was for: a training micro-step, an evaluation, sampling.

Only the passes that train belong to the optimizer step: its tokens, its FLOPs, its gradient
accumulation. A pass trains when the backward pass reaches its output (a hook on the output's
autograd node fires); any other samples when a sampling op (`multinomial`, `argmax`, `topk`)
ran on the way to the next pass, and evaluates otherwise. A backpropagated pass whose gradients
were cleared before any optimizer step read them is discarded: no `optimizer.step()` began
after it, no GradScaler checked its gradients (a step it skipped on an overflow is still a
step), and when a later pass began the model's parameters held none. In a run that trained,
the other passes' ops, calls and module calls (a discarded pass's backward too) get the phase
"evaluation" when the run is finished: docs/how-it-works.md#phases tells why.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from ampscope.records import FUNCTION_ROW, OP_ROW, PassKind, PassRecord, Phase
from ampscope.runs.modules import ModuleTracker
from ampscope.runs.tensor_meta import no_torch_function, tensors_in
from ampscope.torchcompat.ops import GRAD_SCALER_CHECK_OPS

# Ops that turn a pass's output into tokens: a pass followed by one samples.
_SAMPLING_OPS = frozenset({"aten.multinomial.default", "aten.argmax.default",
                           "aten.topk.default"})
_OP_NAME, _OP_PHASE = OP_ROW.at("op"), OP_ROW.at("phase")
_FUNCTION_PHASE = FUNCTION_ROW.at("phase")


class _Backpropagated:
    """Set when the backward pass reaches a pass's output (a pre-hook of its autograd node).
    Holds nothing but its flag: autograd keeps the hook as long as the graph lives."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = False

    def __call__(self, grad_outputs):
        self.reached = True


class _OpenPass:
    __slots__ = ("grad", "first_op", "first_call", "first_function", "tokens", "backward",
                 "steps", "cleared")

    def __init__(self, grad: bool, first_op: int, first_call: int, first_function: int,
                 tokens: int, steps: int) -> None:
        self.grad, self.first_op, self.first_call, self.first_function = (grad, first_op,
                                                                          first_call,
                                                                          first_function)
        self.tokens = tokens
        self.backward = _Backpropagated()
        self.steps = steps  # optimizer steps begun before it (PhaseClock.steps)
        # No step since it began, and no parameter held a gradient when a later pass began.
        self.cleared = False


class _HasModel(Protocol):
    model: nn.Module | None


class PassLog:
    """The model's forward passes while a run is recorded (the capture session tells it where
    each begins and ends), classified when the run is finished."""

    def __init__(self, op_rows: list[tuple], function_rows: list[tuple],
                 tracker: ModuleTracker, capture: _HasModel) -> None:
        self._ops, self._functions, self._tracker = op_rows, function_rows, tracker
        # The capture whose model it is, once known (a script's is found while it runs); by a
        # weak reference, so that no cycle keeps a finished run alive.
        self._capture = weakref.ref(capture)
        self._open: list[_OpenPass] = []
        self._hooks: list = []  # the removable handles of the pre-hooks on outputs' nodes

    def begin(self, args: tuple, kwargs: dict, first_call: int) -> None:
        """The model is called outside any other module: a new pass, whose module call has
        the index `first_call`."""
        with no_torch_function():
            tokens = next((t.numel() for t in tensors_in((args, kwargs))
                           if not t.is_floating_point() and not t.is_complex()
                           and t.dtype is not torch.bool), 0)
            # The last backpropagated pass (an evaluation pass may have run since), not
            # stepped on since it began: are its gradients still there?
            last = next((p for p in reversed(self._open) if p.backward.reached), None)
            if last is not None and last.steps == self._steps():
                last.cleared = not self._holds_gradients() and not self._unscaled(last)
        self._open.append(_OpenPass(torch.is_grad_enabled(), len(self._ops), first_call,
                                    len(self._functions), tokens, self._steps()))

    def end(self, output: object) -> None:
        """The pass returned `output`: watch whether the backward pass reaches it."""
        if not self._open or not torch.is_grad_enabled():
            return
        hook = self._open[-1].backward
        with no_torch_function():
            nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(output)
                     if t.grad_fn is not None}
        for node in nodes.values():
            self._hooks.append(node.register_prehook(hook))

    def _steps(self) -> int:
        clock = self._tracker.phase
        return clock.steps if clock is not None else 0

    def _unscaled(self, p: _OpenPass) -> bool:
        """A GradScaler read the gradients after the pass began (its step taken or skipped)."""
        return any(self._ops[i][_OP_NAME] in GRAD_SCALER_CHECK_OPS
                   for i in range(p.first_op, len(self._ops)))

    def _holds_gradients(self) -> bool:
        capture = self._capture()
        model = capture.model if capture is not None else None
        return model is None or any(p.grad is not None for p in model.parameters())

    def close(self) -> None:
        """The recording is over: no hook stays on a graph the user's tensors may keep."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def records(self) -> list[PassRecord]:
        """Every pass, classified; relabels the ops and calls of the passes that did not train
        when some pass did (see the module's docstring). Call once, when the run is over."""
        if not self._open:  # a capture of code that never called its model
            return []
        ops = self._ops
        ends = [p.first_op for p in self._open[1:]] + [len(ops)]
        kinds = []
        for open_pass, end in zip(self._open, ends, strict=True):
            if open_pass.backward.reached:
                kinds.append(PassKind.DISCARDED if open_pass.cleared else PassKind.TRAIN)
            elif any(ops[i][_OP_NAME] in _SAMPLING_OPS for i in range(open_pass.first_op, end)):
                kinds.append(PassKind.SAMPLING)
            else:
                kinds.append(PassKind.EVALUATION)
        if PassKind.TRAIN in kinds:
            self._relabel(kinds, ends)
        else:  # nothing stepped after it: what it trained for is unknown, not discarded
            kinds = [PassKind.TRAIN if k is PassKind.DISCARDED else k for k in kinds]
        return [PassRecord(kind, p.grad, p.first_op, end, p.tokens)
                for kind, p, end in zip(kinds, self._open, ends, strict=True)]

    def _relabel(self, kinds: list[PassKind], ends: list[int]) -> None:
        ops, functions = self._ops, self._functions
        call_ends = [p.first_call for p in self._open[1:]] + [self._tracker.call_count()]
        function_ends = [p.first_function for p in self._open[1:]] + [len(functions)]
        relabel_op = OP_ROW.replacer("phase")
        relabel_function = FUNCTION_ROW.replacer("phase")
        for kind, p, end, call_end, function_end in zip(kinds, self._open, ends, call_ends,
                                                        function_ends, strict=True):
            if kind is PassKind.TRAIN:
                continue
            # A discarded pass's backward is not the step's either.
            moved = (Phase.FORWARD, Phase.BACKWARD) if kind is PassKind.DISCARDED else \
                (Phase.FORWARD,)
            for i in range(p.first_op, end):
                if ops[i][_OP_PHASE] in moved:
                    ops[i] = relabel_op(ops[i], Phase.EVALUATION)
            for i in range(p.first_function, function_end):
                if functions[i][_FUNCTION_PHASE] in moved:
                    functions[i] = relabel_function(functions[i], Phase.EVALUATION)
            for call in self._tracker.calls_between(p.first_call, call_end):
                if call.phase in moved:
                    call.phase = Phase.EVALUATION
