"""`StorageTracker`: every storage a step allocates, when it was made and freed, and what it is.

Memory belongs to storages, not tensors: the tracker keys each by its `untyped_storage()`
object (the same object while the storage lives, for fake tensors too) and learns of its free
from a weak reference to it. It is told of the model's tensors before the step (`register`)
and of each aten op's results (`on_op`), walks autograd's saved tensors as a backward pass
begins (`_walk`), follows storages resized in place (`watch_resizes`) and gives each storage
its category at the end (`records`): docs/memory.md#method says what is seen when, and the
categories' precedence. Storages made outside any recorded op (inside a kernel, or by C++
without dispatching) are not seen; neither are the allocator's own reserves.

Namesakes, the same concern at another layer: `analysis/memory.py`, `render/memory.py`."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ampscope.patches import patch
from ampscope.records import (
    STORAGE_CATEGORIES,
    OpCall,
    StorageCategory,
    StorageRecord,
    TensorMeta,
    from_rows,
)
from ampscope.records.fp8 import fp8_casts
from ampscope.runs.tensor_meta import PLAIN_TENSORS, meta_of, stored_tensors
from ampscope.torchcompat.autograd import (
    UnreadableSaved,
    graph_task_id,
    reads_saved_raw,
    saved_tensors,
    saving_through_hooks,
)

# Identity before the step, identity at the end, origin, lifetime.
_RANK: dict[str, int] = {c: i for i, c in enumerate(STORAGE_CATEGORIES)}
_ACTIVATION, _TEMPORARY = StorageCategory.ACTIVATION, StorageCategory.TEMPORARY


class _Storage(weakref.ref):
    """A weak reference to one storage that carries what is known of it (the reference is the
    record: one object per storage, and its callback receives it). `dated`: the op index its
    free is dated at, when a replayed block (runs/repeats.py) knows it better than the
    moment the storage goes; `followers`: replayed storages freed when this one is."""

    __slots__ = ("key", "nbytes", "meta", "created", "freed", "saved", "category", "names",
                 "dated", "followers")
    key: int  # id() of the storage object
    nbytes: int
    meta: TensorMeta
    created: int | None  # None: before the step
    freed: int | None
    saved: bool
    category: str | None
    names: list[str]
    dated: int | None
    followers: list[_Replayed] | None


class _Replayed:
    """A storage a replayed block would have made: never allocated, dated from its twin, the
    storage `leader` that a recorded block made (whose `saved` it shares)."""

    __slots__ = ("nbytes", "meta", "created", "freed", "category", "names", "leader")
    nbytes: int
    meta: TensorMeta
    created: int
    freed: int | None
    category: str | None
    names: list[str]
    leader: _Storage

    def __init__(self, leader: _Storage, created: int, freed: int | None) -> None:
        self.nbytes, self.meta, self.leader = leader.nbytes, leader.meta, leader
        self.created, self.freed = created, freed
        self.category, self.names = None, []

    @property
    def saved(self) -> bool:
        return self.leader.saved


class StorageTracker:
    def __init__(self, ops: list[tuple]) -> None:
        self._ops = ops  # the OpRecorder's rows: their count dates a free
        self._live: dict[int, _Storage] = {}  # id(storage object) -> entry, while it lives
        self._seen: list[_Storage | _Replayed] = []
        # The autograd nodes walked in the backward pass now running (id -> node), and its id.
        self._walked: dict[int, object] = {}
        self._graph_task = -1
        # On a build that can only unpack saved tensors (torch 2.9), unpacking one saved
        # through hooks (activation checkpointing's) would run them: once the forward pass has
        # saved through hooks, no saved tensor is read, and `saved_unknown` says so.
        self._unpacking = not reads_saved_raw()
        self.saved_unknown = False
        # Bytes live now and at most so far, in CUDA's 512-byte blocks: what a script's own
        # torch.cuda.memory_allocated() reads on a virtual device.
        self.live_bytes = 0
        self.peak_bytes = 0
        # Frees while a replayed block's twin is recorded (see `start_log`).
        self.log: list[_Storage] = []
        self._logging = 0
        # Storages alive but resized to 0 bytes (a life ended by `on_resize`): what they were.
        self._shrunk: dict[int, TensorMeta] = {}
        self._held_at: int | None = None  # the op count at `hold`

    # -- collecting
    def _entry(self, storage: torch.UntypedStorage, meta: TensorMeta,
               created: int | None) -> _Storage:
        entry = _Storage(storage, self._on_free)
        entry.key, entry.nbytes, entry.meta, entry.created = id(storage), storage.nbytes(), meta, created
        entry.freed, entry.saved, entry.category, entry.names = None, False, None, []
        entry.dated = entry.followers = None
        self._live[id(storage)] = entry
        self._seen.append(entry)
        self.live_bytes += _blocks(entry.nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return entry

    def hold(self) -> None:
        """The run's end: a storage alive now stays alive in the record, whatever goes later. A
        stopped script's frames and globals go while it unwinds, and the garbage collector frees
        them whenever it next runs (the globals dict is a cycle with the script's functions):
        dating those frees would make the record depend on when the collector ran. A storage
        made later (by an exit handler's ops) is followed as before."""
        self._held_at = len(self._ops)

    def _held(self, entry: _Storage | None) -> bool:
        """Whether `entry` (None: a storage not followed now) was alive at `hold`."""
        return self._held_at is not None and (
            entry is None or entry.created is None or entry.created < self._held_at)

    def _on_free(self, entry: _Storage) -> None:
        if self._held_at is not None and self._held(entry):  # (every free: no call before)
            return
        if entry.freed is not None and self._live.get(entry.key) is not entry:
            # A life `on_resize` ended: its free is dated, and the storage it was is going now.
            self._shrunk.pop(entry.key, None)
            return
        entry.freed = len(self._ops) - 1 if entry.dated is None else entry.dated
        if self._live.get(entry.key) is entry:
            del self._live[entry.key]
            self.live_bytes -= _blocks(entry.nbytes)
        if self._logging:
            self.log.append(entry)
        if entry.followers:
            for follower in entry.followers:
                if follower.freed is None:
                    follower.freed = entry.freed
                    self.live_bytes -= _blocks(follower.nbytes)
            entry.followers = None

    # -- storages resized in place
    def watch_resizes(self) -> Callable[[], None]:
        """Follow `UntypedStorage.resize_` until the returned function is called: no dispatch
        mode sees it, and FSDP2 frees and regrows every unsharded parameter with it."""
        original = torch.UntypedStorage.resize_
        on_resize = self.on_resize

        def resize_(storage, size):
            result = original(storage, size)
            on_resize(storage)
            return result

        return patch(torch.UntypedStorage, "resize_", resize_)

    def on_resize(self, storage: torch.UntypedStorage) -> None:
        """`storage` was just resized: its life at the old size ends after the last op
        recorded, and one at the new size (none at 0 bytes) starts at the next op. A storage
        never seen is left unseen, as one made without an op."""
        key, nbytes = id(storage), storage.nbytes()
        entry = self._live.get(key)
        if self._held(entry):
            return
        if entry is not None:
            if entry.nbytes == nbytes:
                return
            entry.freed = len(self._ops) - 1
            del self._live[key]
            self.live_bytes -= _blocks(entry.nbytes)
            meta: TensorMeta | None = entry.meta
        else:
            meta = self._shrunk.get(key)
        if meta is None:
            return
        if nbytes:
            self._shrunk.pop(key, None)
            self._entry(storage, meta, len(self._ops))
        else:
            self._shrunk[key] = meta

    # -- for replayed blocks (runs/repeats.py)
    def start_log(self) -> int:
        """Start noting frees (nested starts are counted); returns where the log is now."""
        self._logging += 1
        return len(self.log)

    def stop_log(self) -> int:
        self._logging -= 1
        return len(self.log)

    # -- the storages recorded so far, for the replay engine (runs/windows.py)
    def created_count(self) -> int:
        return len(self._seen)

    def created_between(self, start: int, end: int) -> list:
        return self._seen[start:end]

    def live_keys(self):
        """The keys (ids of storage objects) of the storages alive now, as a set-like view."""
        return self._live.keys()

    def entry_of(self, tensor: torch.Tensor):
        """The entry of a live tensor's storage, None when it has not been seen."""
        storage = storage_of(tensor)
        return self._live.get(id(storage)) if storage is not None else None

    def made_by_replay(self, tensor: torch.Tensor, created: int, twin: _Storage):
        """A tensor a replayed block returns (made without an op): its storage, dated as made
        by op `created`, described as its twin's (the first tensor seen on it may have been a
        view with another shape: a bias gradient summed with keepdim)."""
        storage = storage_of(tensor)
        if storage is None:
            return None
        return self._live.get(id(storage)) or self._entry(storage, twin.meta, created)

    def replayed(self, leader: _Storage, created: int, freed: int | None) -> _Replayed:
        """A storage a replayed block made at op `created`, the twin of `leader`: freed at op
        `freed`, or when `leader` is (or as `date_free` dates it), when `freed` is None."""
        entry = _Replayed(leader, created, None)
        self._seen.append(entry)
        self.live_bytes += _blocks(entry.nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if freed is not None:
            self.date_free(entry, freed)
        elif leader.freed is not None and self._live.get(leader.key) is not leader:
            raise LookupError("a replayed storage's twin is already gone")
        else:
            leader.followers = [*(leader.followers or ()), entry]
        return entry

    def date_free(self, entry, index: int) -> None:
        """Date `entry`'s free at op `index`: now for a replayed storage, when it goes (or
        now, when it is gone already) for a real one."""
        if isinstance(entry, _Replayed):
            if entry.freed is None:
                entry.freed = index
                self.live_bytes -= _blocks(entry.nbytes)
            return
        entry.dated = index
        if self._live.get(entry.key) is not entry:
            entry.freed = index

    def register(self, tensor: torch.Tensor, category: str, name: str) -> None:
        """Name a storage that exists before the step (or, for `input`, as the model is first
        called), or give a name and category to one seen at the end. A storage keeps the
        category of highest precedence it is given, and every name. A tensor that wraps others
        (a DTensor) is held in theirs (its local shard)."""
        for held in stored_tensors(tensor):
            storage = storage_of(held)
            if storage is None:
                continue
            entry = self._live.get(id(storage))
            if entry is None:
                entry = self._entry(storage, meta_of(held), None)
            if entry.category is None or _RANK[category] < _RANK[entry.category]:
                entry.category = StorageCategory(category)
            if name not in entry.names:  # named at a step's end and again at the run's
                entry.names.append(name)

    def on_op(self, index: int, outputs: list[torch.Tensor], metas: tuple[TensorMeta, ...],
              node=None) -> None:
        """Op `index` returned `outputs` (described by `metas`): note the storages it made.
        `node` is the autograd node running it, in backward: the first op of a backward pass
        has every saved tensor of the graph still in place, so the graph is walked then."""
        live = self._live
        for t, meta in zip(outputs, metas, strict=True):
            held = stored_tensors(t) if type(t) not in PLAIN_TENSORS else None
            if held is not None and held[0] is not t:  # a wrapper's memory is its inner tensors'
                for inner in held:
                    storage = storage_of(inner)
                    if storage is not None and id(storage) not in live:
                        self._entry(storage, meta_of(inner), index)
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
                continue
            if id(storage) not in live:
                self._entry(storage, meta, index)
        if node is None:
            if self._walked:  # backward is over: let its nodes go
                self._walked = {}
            if self._unpacking and not self.saved_unknown and saving_through_hooks():
                self.saved_unknown = True
            return
        task = graph_task_id()
        if task != self._graph_task:
            self._graph_task, self._walked = task, {}
        # A new pass, or a graph with several roots.
        if id(node) not in self._walked and not self.saved_unknown:
            self._walk(node)

    def _walk(self, root) -> None:
        """Mark the storages of every tensor saved in the autograd graph behind `root`.

        Read from the nodes themselves (torchcompat.autograd.saved_tensors, unpacked neither by
        autograd nor by a hook where the build allows), not by `saved_tensors_hooks`:
        docs/memory.md#method says why. A node whose tensors were saved through hooks that
        refuse to unpack them here (activation checkpointing's, on a build that can only
        unpack) holds no activation of its own: the hooks keep what they need elsewhere."""
        walked, live = self._walked, self._live
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in walked:
                continue
            walked[id(node)] = node  # held, so that its Python object (and id) stays the same
            try:
                for t in saved_tensors(node):
                    storage = storage_of(t)
                    entry = live.get(id(storage)) if storage is not None else None
                    if entry is not None:
                        entry.saved = True
            except UnreadableSaved:
                pass
            stack.extend(n for n, _ in node.next_functions if n is not None)

    # -- the result
    def records(self, ops: list[OpCall]) -> list[StorageRecord]:
        """One record per storage seen, in the order first seen; then forget them all (the
        weak references go, so no callback runs after this)."""
        rows: list[tuple] = []
        append = rows.append
        fp8 = fp8_casts(ops)
        fp8_made = {c.op: StorageCategory.FP8_CAST for c in fp8} | {c.scale_op: StorageCategory.FP8_SCALE for c in fp8
                                                      if c.scale_op is not None}
        for i, entry in enumerate(self._seen):
            created, category, saved, names, meta = (entry.created, entry.category, entry.saved,
                                                     entry.names, entry.meta)
            if created is not None and created >= len(ops):
                # Regrown (on_resize) after the last op: counted as live at it.
                created = len(ops) - 1 if ops else None
            module = phase = name = None
            if created is not None:
                op = ops[created]
                module, phase, name = op.module, op.phase, op.op
                if category is None and op.autocast_cast:
                    category = StorageCategory.AUTOCAST_CAST
                elif category is None:
                    category = fp8_made.get(created)
            if category is None:
                category = _ACTIVATION if saved else _TEMPORARY
            append((i, entry.nbytes, meta.dtype, meta.shape, created, entry.freed, category,
                    tuple(dict.fromkeys(names)) if names else (), module, phase, name, saved))
        self._seen, self._live, self._walked, self.log = [], {}, {}, []
        self._shrunk = {}
        return from_rows(StorageRecord, rows)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a plain tensor; of one that wraps others (`stored_tensors`), its first
    inner tensor's (a DTensor's local shard's)."""
    try:
        return stored_tensors(t)[0].untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
        return None


def _blocks(nbytes: int) -> int:
    """Bytes in CUDA's caching-allocator blocks of 512."""
    return -(-nbytes // 512) * 512
