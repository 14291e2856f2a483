"""`ampscope run --nproc N`: a torchrun-style script, unmodified, as N real ranks on this
machine, each traced as `ampscope run` traces one process.

Each rank is a spawned child (script/child.py) with torchrun's environment, its process groups
on gloo (runtime/process_group.py) and its virtual cuda device the GPU asked for (`gpu`,
`--gpu`); what each sees, and the one line a failure or the deadline gives: docs/distributed.md
("`ampscope run --nproc`").

When the job's deadline passes, or as soon as one rank fails, every rank's process group is
killed, with whatever the ranks started (a rank left waiting in a collective for a dead peer
would otherwise wait out gloo's timeout; a helper process or DataLoader worker would outlive
it). SIGTERM or SIGHUP sent to ampscope ends them too, and ampscope with 128 + the signal
(script/rank_groups.py). Each rank writes the collective it is in to a file of the job's folder
as it enters and leaves one (runtime/collective_watch.py), read at the deadline.

Namesakes, the same concern at another layer: `render/ranks.py`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence

from ampscope import hardware
from ampscope.analysis.findings import plural
from ampscope.distributed.launch import free_port
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import (
    DistributedReport,
    Held,
    RankReport,
    collectives,
    itemsize,
    rank_peak,
    summarize,
)
from ampscope.errors import AmpscopeError, first_line
from ampscope.hardware.cuda_allocator import config_for
from ampscope.records import Trace
from ampscope.runtime.collective_watch import describe, read_state
from ampscope.script.child import answer, spawn, traceback_of
from ampscope.script.rank_groups import Signals, end_groups

DEFAULT_TIMEOUT = 300.0  # seconds for the whole job, every rank's start-up included
MAX_NPROC = 8


def rank_environment(rank: int, nproc: int, port: int, run_id: str, *,
                     per_machine: int | None = None) -> dict[str, str]:
    """What torchrun sets for `rank` of an `nproc`-rank job on machines of `per_machine` ranks
    each (by default one machine of all `nproc`)."""
    local = min(nproc, per_machine or nproc)
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank % local), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local),
           "GROUP_WORLD_SIZE": str(-(-nproc // local)), "ROLE_RANK": str(rank),
           "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks must not each take every core
    return env


def gpu_name(gpu: str | hardware.Accelerator | None) -> str | None:
    """The name a rank's child finds `gpu` by in the hardware table (its virtual cuda device);
    None where none was asked for, or for figures given on a command line alone (`custom`),
    which name no GPU to be: the default then, as in a single-process run. An unknown name is
    refused here, before any rank starts."""
    if isinstance(gpu, str):
        gpu = hardware.by_name(gpu)
    return gpu.name if gpu is not None and gpu.name in {a.name for a in hardware.table()} \
        else None


def run_ranks(target: str, argv: Sequence[str], nproc: int, *, module: bool = False,
              device: str | None = None, steps: int = 1, max_forwards: int | None = 0,
              timeout: float = DEFAULT_TIMEOUT,
              gpu: str | hardware.Accelerator | None = None) -> list[Trace]:
    """Every rank's trace of `target` run as `nproc` ranks, rank 0 first; `gpu` (a name of
    `hardware.table()` or its entry, `--gpu`) is the GPU each rank's virtual cuda device is
    (default: an H100)."""
    if nproc < 1 or nproc > MAX_NPROC:
        raise AmpscopeError(f"--nproc must be between 1 and {MAX_NPROC} (ranks on this "
                            f"machine); got {nproc}")
    # An unreadable PYTORCH_CUDA_ALLOC_CONF stops a cuda job before it runs (each rank's
    # reserved peak is replayed with it); a job on another device goes on without it.
    config_for(device or "")
    request = {"target": target, "argv": list(argv), "module": module, "device": device,
               "steps": steps, "predict": False, "max_forwards": max_forwards, "rank": True,
               "gpu": gpu_name(gpu)}
    port, run_id = free_port(), f"ampscope-{uuid.uuid4().hex[:12]}"
    signals = Signals()
    with signals.active(f"the {plural(nproc, 'rank')}"), \
            tempfile.TemporaryDirectory(prefix="ampscope-ranks-") as folder:
        results = [os.path.join(folder, f"rank{k}.json") for k in range(nproc)]
        states = [os.path.join(folder, f"rank{k}.state") for k in range(nproc)]
        started: list[tuple[subprocess.Popen, list]] = []
        ended = False  # every rank ended well
        passed_on: int | None = None  # the signal passed on to the ranks
        try:
            with signals.held():  # no rank started but not yet listed, to be left behind
                for k in range(nproc):
                    started.append(spawn({**request, "watch": states[k]}, results[k],
                                         rank_environment(k, nproc, port, run_id),
                                         session=True))
            codes = _wait([p for p, _ in started], results, target,
                          time.monotonic() + timeout, timeout, states)
            ended = True
        except KeyboardInterrupt:
            passed_on = signal.SIGINT  # the ranks, in sessions of their own, did not get it
            raise
        finally:
            signals.hold()
            if not ended:  # a rank failed, the deadline passed, or ampscope was signalled
                end_groups([p for p, _ in started], signals.received or passed_on)
            for _, copiers in started:
                for copier in copiers:
                    copier.join(timeout=10)
        return [answer(results[k], codes[k], target) for k in range(nproc)]


def _wait(processes: list[subprocess.Popen], results: list[str], target: str,
          deadline: float, timeout: float, states: list[str]) -> list[int]:
    """Every rank's exit status, once all have ended well. A failed rank raises as one line
    naming it (the others are killed by the caller); of several, the one whose error is its
    own rather than gloo's news that a peer went away, the first to report among those. At
    the deadline, one line says where each rank still running was (its `states` file)."""
    nproc = len(processes)
    codes: dict[int, int] = {}
    while len(codes) < nproc:
        failed = []
        for k, process in enumerate(processes):
            if k in codes or (code := process.poll()) is None:
                continue
            codes[k] = code
            if _failure(results[k], code, target) is not None:
                failed.append(k)
        if failed:
            time.sleep(_GRACE)  # the peers a failure brought down report theirs meanwhile
            failed += [k for k, p in enumerate(processes) if k not in codes
                       and (code := p.poll()) is not None
                       and _failure(results[k], codes.setdefault(k, code), target)]
            errors = {k: _failure(results[k], codes[k], target) or "" for k in failed}
            first = min(failed, key=lambda k: (any(words in errors[k] for words in _PEER_GONE),
                                               _ended_at(results[k])))
            failure = AmpscopeError(f"rank {first} of {nproc} failed: {errors[first]}")
            told = traceback_of(results[first])
            if told and hasattr(failure, "add_note"):  # Python >= 3.11; shown under --debug
                failure.add_note(f"rank {first}'s traceback:\n{told.rstrip()}")
            raise failure from None
        if len(codes) < nproc:
            if time.monotonic() > deadline:
                waiting = [k for k in range(nproc) if k not in codes]
                # The script's name alone, and the ranks first: the CLI cuts a long line.
                raise AmpscopeError(
                    f"the {nproc}-rank run of {os.path.basename(target)} did not finish in "
                    f"{timeout:.0f} s: {_where(waiting, states)}. A collective its peers never "
                    "reach hangs: check the script, or give --timeout more")
            time.sleep(0.05)
    return [codes[k] for k in range(nproc)]


_GRACE = 0.5  # seconds to wait, after a rank failed, for the failures it caused


def _where(waiting: list[int], states: list[str]) -> str:
    """Where the ranks still running were, from the state each wrote as it entered and left
    its collectives: "rank 0 waits in all_reduce (float32, 16 B) at train.py:7; rank 1 was
    not in a collective (last: barrier at train.py:5)", ranks in the same state together."""
    together: dict[str, list[int]] = {}
    for k in waiting:
        together.setdefault(json.dumps(read_state(states[k]), sort_keys=True), []).append(k)
    return "; ".join(f"{_ranks(ks)} {describe(json.loads(state), many=len(ks) > 1)}"
                     for state, ks in together.items())


def _ranks(ks: list[int]) -> str:
    """"rank 3", or "ranks 0-2, 5, 6": runs of three or more consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    named = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r))
                      for r in runs)
    return f"rank{'s' if len(ks) > 1 else ''} {named}"


def _failure(result: str, code: int, target: str) -> str | None:
    """The first line of the error a rank reported (or of how it died); None if it traced."""
    with contextlib.suppress(OSError, ValueError), open(result, encoding="utf-8") as f:
        if "trace" in json.load(f):  # read back as a Trace once, by the caller
            return None
    try:
        answer(result, code, target)
    except Exception as e:  # noqa: BLE001 - any rank's failure ends the job
        return first_line(e)
    return None


# How gloo says a peer went away: the failure of a rank waiting on one that failed first.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "remote worker")


def _ended_at(result: str) -> float:
    """When a rank wrote its answer (none written: last)."""
    try:
        return os.stat(result).st_mtime_ns / 1e9
    except OSError:
        return float("inf")


def _held(trace: Trace) -> Held:
    """Bytes the rank's parameters, gradients and optimizer state hold, by dtype (a tied
    weight once): of a sharded parameter (a DTensor), the shard this rank stores (its
    `local_shape`; its gradient is sharded alike), not the full tensor."""
    held: Held = {}

    def add(category: str, dtype: str, shape: tuple[int, ...]) -> None:
        by_dtype = held.setdefault(category, {})
        by_dtype[dtype] = by_dtype.get(dtype, 0) + math.prod(shape) * itemsize(dtype)

    for p in trace.parameters:
        if p.tied_to and any(name < p.name for name in p.tied_to):
            continue  # the same storage, counted under its first name
        shape = p.shape if p.local_shape is None else p.local_shape
        for category, dtype in (("parameter", p.dtype), ("gradient", p.grad_dtype)):
            if dtype is not None:
                add(category, dtype, shape)
    for s in trace.optimizer_state:
        add("optimizer_state", s.dtype, s.shape if s.local_shape is None else s.local_shape)
    return held


def _step_start(trace: Trace) -> int:
    """The index of the first op of the model's first forward pass (0 without one): what ran
    before it is the script's setup (DDP's constructor checks and broadcasts the parameters)."""
    return trace.passes[0].first_op if trace.passes else 0


def rank_report(k: int, trace: Trace, nproc: int) -> RankReport:
    """Rank `k` of `nproc`: what it holds, the collectives of its steps (from its model's first
    forward pass on), its peak."""
    start = _step_start(trace)
    return RankReport(k, _held(trace), [c for c in collectives(trace.ops, nproc)
                                        if c.index >= start], rank_peak(trace))


def ranks_report(traces: list[Trace], target: str) -> DistributedReport:
    """The N ranks' traces as one distributed report (rank 0's trace kept in full). A rank's
    collectives are those of its steps, from its model's first forward pass on; those of the
    setup before it are summed in a note. The strategy is read off them: FSDP2 all-gathers
    parameters and reduce-scatters gradients, DDP only all-reduces."""
    n, first = len(traces), traces[0]
    ranks = [rank_report(k, t, n) for k, t in enumerate(traces)]
    setup = [c for c in collectives(first.ops, n) if c.index < _step_start(first)]
    kinds = {c.kind for r in ranks for c in r.collectives}
    strategy = "fsdp" if kinds & {"all_gather", "reduce_scatter"} else "ddp"
    notes = [f"{target} ran as {plural(n, 'rank')} on this machine (real tensors, gloo); the strategy "
             "is read off the collectives of the ranks' steps."]
    if setup:
        rows = ", ".join(f"{r.kind.replace('_', '-')} {r.dtype} {r.payload_bytes:,} B"
                         + (f" ×{r.calls}" if r.calls > 1 else "") for r in summarize(setup))
        notes.append(f"Before its model's first forward pass, rank 0 also ran: {rows} (the "
                     "script's setup, such as DDP's parameter checks and broadcast; left out "
                     "of the step's collectives).")
    if not any(collectives(t.ops, n) for t in traces):  # neither in the setup nor the steps
        notes.append("No rank ran a collective: the script made no process group, or used it "
                     "for nothing its run traced; each rank ran on its own.")
    return DistributedReport(
        model=first.model.name, parameters=first.model.parameters, setting=first.setting,
        parallel=Parallel(strategy, n), backend="gloo", mode="run", ranks=ranks,
        notes=notes, trace=first)


def report_dict(report: DistributedReport) -> dict:
    """The report's `ampscope.distributed/1` document; its strategy "none" where no rank ran
    a collective (a `Parallel` is DDP or FSDP2, which such a run is neither)."""
    data = report.to_dict()
    if not any(r.collectives for r in report.ranks):
        data["parallel"]["strategy"] = "none"
    return data
