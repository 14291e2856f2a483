"""Fake ops answered from FakeTensorMode's own cache, found by a cheaper key: `CachedAnswers`,
one per op recorder, under the same switch as foreach thinning.

FakeTensorMode keys its cache by the op, a few global settings and every argument's full
metadata: about 35 µs of a 120 µs dispatch, where making the results from the entry costs 20.
On a 70B Llama's predicted step the ops that still reach it (the four dispatched decoder layers,
the head and the loss, the first entry of each foreach kind) spent a quarter of the run there,
and those layers ask the cache what an earlier call already asked. What the cheaper key holds,
which calls are answered (only those FakeTensorMode would answer from its cache, and only where
every mode below the recorder `passes_through(func)`) and how each answer is made:
docs/how-it-works.md#other-ops-answered-from-faketensormodes-own-cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ampscope.runs.foreach import NOT_THINNED
from ampscope.runs.tensor_meta import no_torch_function
from ampscope.runtime.predict import new_fake
from ampscope.torchcompat import fake
from ampscope.torchcompat.dispatch import (
    OpOverload,
    active_fake_mode,
    default_device,
    dispatch_mode_stack,
    dispatch_stack_depth,
    proxy_mode_active,
)
from ampscope.torchcompat.fake import FakeTensor, FakeTensorMode, PlainOutput

_VALUES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                     torch.layout, torch.memory_format})
# Sentinels, typed Any as they stand where other types are declared.
_UNCACHED: Any = object()  # a key FakeTensorMode keeps no entry for: always dispatched
_UNKNOWN: Any = object()  # this build's dispatch cache, not looked up yet


class CachedAnswers:
    """FakeTensorMode's cache entries learned in one run, by the cheaper key."""

    def __init__(self) -> None:
        # Per key: a PlainOutput, (entry, FakeTensorMode's key), or _UNCACHED.
        self._entries: dict[tuple, PlainOutput | tuple[object, object]] = {}
        # This build's dispatch cache, as the trick expects it: looked up on the first call (a
        # real run never calls, and never detects it); tricks.py turns the trick off where it
        # is None.
        self._api: fake.CacheAPI | None = _UNKNOWN

    def call(self, func: OpOverload, args: tuple, kwargs: dict):
        """The op's result, or NOT_THINNED (as foreach's) where it has to be dispatched."""
        api = self._api
        if api is _UNKNOWN:
            api = self._api = fake.cache_api()
        mode = active_fake_mode()
        if api is None or mode is None or not mode.cache_enabled or mode.shape_env is not None:
            return NOT_THINNED
        key: list = [func, torch.get_default_dtype(), default_device(),
                     torch.is_inference_mode_enabled(), dispatch_stack_depth(),
                     not proxy_mode_active()]
        with no_torch_function():  # metadata reads are no user's calls
            if not _add(args, mode, key) or (kwargs and not _add_named(kwargs, mode, key)):
                return NOT_THINNED
        known = tuple(key)
        found = self._entries.get(known)
        if found is None:  # the key's first call in this run
            with no_torch_function():
                fake_key = _fake_key(api, mode, func, args, kwargs)
            entry = api.entry(fake_key) if fake_key is not None else None
            if fake_key is not None and entry is None:
                # Not in FakeTensorMode's cache yet: this call runs through the modes, and the
                # entry FakeTensorMode makes of it answers the key's later calls.
                out = func(*args, **kwargs)
                with no_torch_function():
                    self._entries[known] = _answer_from(api.entry(fake_key), fake_key)
                return out
            # Already there (an earlier call with another cheap key, an earlier run in this
            # process): answered from it now, as FakeTensorMode's cache hit would be.
            with no_torch_function():
                found = self._entries[known] = _answer_from(entry, fake_key)
        if found is _UNCACHED:
            return NOT_THINNED
        if type(found) is PlainOutput:  # the most common answer, made as new_fake makes one
            return new_fake(mode, found.shape, found.stride, found.dtype, found.device)
        entry, fake_key = found
        return api.output(mode, entry, fake_key, func, args)


def _add(values, mode: FakeTensorMode, key: list) -> bool:
    """Append what FakeTensorMode's key holds of `values`; False for a value it cannot hold."""
    for v in values:
        kind = type(v)
        if kind is FakeTensor:
            if v.fake_mode is not mode or v.constant is not None or v.layout != torch.strided:
                return False
            key.append((v.dtype, v.shape, v.stride(), v.storage_offset(),
                        v.untyped_storage().nbytes(), v.fake_device, v.requires_grad,
                        v.is_conj(), v.is_neg(), v.is_inference()))
        elif kind is list or kind is tuple:
            key.append((kind, len(v)))
            if not _add(v, mode, key):
                return False
        elif kind in _VALUES:
            key.append((kind, v))
        else:
            return False
    return True


def _add_named(kwargs: dict, mode: FakeTensorMode, key: list) -> bool:
    key.append(tuple(kwargs))
    return _add(kwargs.values(), mode, key)


def _fake_key(api: fake.CacheAPI, mode: FakeTensorMode, func: OpOverload, args: tuple,
              kwargs: dict):
    """FakeTensorMode's own cache key for the call; None when it would not use its cache for
    it, or when a mode between the recorder and it may change the op's results."""
    for other in dispatch_mode_stack():
        passes = getattr(other, "passes_through", None)
        if other is not mode and (passes is None or not passes(func)):
            return None
    return api.key(mode, func, args, kwargs)


def _answer_from(entry: object | None, fake_key: object):
    """What a key's calls are answered from: FakeTensorMode's valid entry (as a `PlainOutput`
    where it makes one plain new tensor), or `_UNCACHED` (no entry, or a mode's own refusal)."""
    if entry is None:
        return _UNCACHED
    return fake.plain_output(entry) or (entry, fake_key)
