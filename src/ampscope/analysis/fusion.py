"""What `torch.compile` (Inductor) makes of a step's ops on a GPU: fused kernels, and their time.

ampscope runs compiled code eagerly and records its ops one by one, marked `compiled`
(runtime/compiled.py); Inductor would run each run of pointwise and reduction ops between its
library kernels (matmuls, convolutions, fused attention) as one generated kernel. The rule
here, applied to a step's op times (what a fused kernel is, the bytes it moves, its time), and
what it leaves out of Inductor: docs/performance.md, "Compiled code"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from ampscope.analysis.op_time import OpTime, collective_kind, memory_seconds, tensor_bytes
from ampscope.hardware.kernels import KernelParams
from ampscope.hardware.known import Accelerator
from ampscope.records import OpCall, StorageRecord
from ampscope.torchcompat.ops import LOCAL_SCALAR_DENSE, is_view_op

_HOST_READS = frozenset({str(LOCAL_SCALAR_DENSE)})  # `.item()`: the graph breaks there


def fused_runs(ops: Sequence[OpCall]) -> list[list[int]]:
    """The positions in `ops` (a step's ops, in order) of each fused kernel's ops: runs of at
    least one op that is not a view."""
    runs: list[list[int]] = []
    current: list[int] = []
    phase = None
    for k, o in enumerate(ops):
        fusible = (o.compiled and not o.flops and o.op not in _HOST_READS
                   and collective_kind(o) is None)
        if not fusible or o.phase != phase:
            _close(ops, current, runs)
            current = []
        phase = o.phase
        if fusible:
            current.append(k)
    _close(ops, current, runs)
    return runs


def _close(ops: Sequence[OpCall], run: list[int], runs: list[list[int]]) -> None:
    if any(not is_view_op(ops[k].op) for k in run):
        runs.append(run)


def made_by(storages: Sequence[StorageRecord]) -> dict[int, list[StorageRecord]]:
    """The storages by the index of the op that made them (those that existed before the
    step left out)."""
    out: dict[int, list[StorageRecord]] = {}
    for s in storages:
        if s.created is not None:
            out.setdefault(s.created, []).append(s)
    return out


def kernel_bytes(run: Sequence[OpCall], made: Mapping[int, list[StorageRecord]]) -> int:
    """Bytes one fused kernel moves (docs/performance.md): inputs from outside the run, outputs
    whose storage lives past its last op (`made`: the step's storages, `made_by`; empty for a
    trace without them, whose every output is counted)."""
    inside: Counter = Counter()
    read = 0
    for o in run:
        if is_view_op(o.op):
            continue
        for m in o.inputs:
            if not inside[(m.dtype, m.shape)]:
                read += tensor_bytes(m.shape, m.dtype)
        inside.update((m.dtype, m.shape) for m in o.outputs)
    if not made:  # a trace without its storages (memory not followed): every output
        return read + sum(tensor_bytes(m.shape, m.dtype) for o in run if not is_view_op(o.op)
                          for m in o.outputs)
    last = run[-1].index
    written = sum(s.nbytes for o in run for s in made.get(o.index, ())
                  if s.freed is None or s.freed > last)
    return read + written


def fuse(timed: list[OpTime], ops: Sequence[OpCall], storages: Sequence[StorageRecord],
         acc: Accelerator, params: KernelParams) -> int:
    """Replace, in `timed` (aligned with `ops`), the times of each fused kernel's ops by their
    share of the kernel's time; the number of kernels made."""
    runs = fused_runs(ops)
    made = made_by(storages)
    for run in runs:
        nbytes = kernel_bytes([ops[k] for k in run], made)
        memory = memory_seconds(nbytes, acc, params)
        seconds = max(memory, params["compiled_host_s"]) + params["launch_s"]
        bound = "launch" if seconds - memory > memory else "memory"
        # Eager seconds: > 0 for every op but a view, and a run has one such op.
        total = sum(timed[k].seconds for k in run)
        for k in run:
            t = timed[k]
            share = t.seconds / total
            timed[k] = OpTime(t.index, t.op, t.phase, t.module, seconds * share,
                              bound if share else "none", t.flops, round(nbytes * share),
                              t.mode, 0.0, memory * share)
    return len(runs)
