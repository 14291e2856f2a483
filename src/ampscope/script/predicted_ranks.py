"""`ampscope run --nproc N --predict`: a torchrun-style script as ranks of an N-rank job, each
predicted on fake tensors (as `run --predict`: fake weights, real data) in a child process of
its own, for any N from 1 to 4096, every process group it makes PyTorch's fake one
(runtime/process_group.py's `FakeGroups`): no peer has to run, so the ranks run one after
another or side by side, as the cores allow. Each rank's environment, which ranks run and which
each other rank is taken to be: docs/distributed.md ("`ampscope run --nproc N --predict`").
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from ampscope import hardware
from ampscope.analysis.findings import plural
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport
from ampscope.errors import AmpscopeError
from ampscope.hardware.cuda_allocator import config_for
from ampscope.records import Trace
from ampscope.script.child import answer, spawn
from ampscope.script.rank_groups import Signals, end_groups
from ampscope.script.ranks import DEFAULT_TIMEOUT, gpu_name, rank_environment, rank_report
from ampscope.torchcompat.distributed import no_fake_collectives

MAX_PREDICTED = 4096
EVERY_RANK_UP_TO = 16  # ranks that differ: every rank runs up to this many
PER_MACHINE = 8  # GPUs per machine, for LOCAL_RANK and LOCAL_WORLD_SIZE


def run_predicted(target: str, argv: Sequence[str], nproc: int, ranks: Sequence[int], *,
                  module: bool = False, device: str | None = None, steps: int = 1,
                  max_forwards: int | None = 0, timeout: float = DEFAULT_TIMEOUT,
                  gpu: str | hardware.Accelerator | None = None) -> dict[int, Trace]:
    """The trace of each of `ranks` of an `nproc`-rank job, predicted, as many at once as
    this machine has cores (the fake group needs no peer running); `gpu` (`--gpu`) is the GPU
    each rank's virtual cuda device is (default: an H100)."""
    request = {"target": target, "argv": list(argv), "module": module, "device": device,
               "steps": steps, "predict": True, "max_forwards": max_forwards, "rank": True,
               "gpu": gpu_name(gpu)}
    run_id, width = f"ampscope-{uuid.uuid4().hex[:12]}", max(1, os.cpu_count() or 1)
    waiting: list[int] = list(ranks)
    running: dict[int, tuple[subprocess.Popen, list, str]] = {}
    traces: dict[int, Trace] = {}
    deadline = time.monotonic() + timeout
    signals = Signals()
    passed_on: int | None = None  # the signal passed on to the ranks
    with signals.active("the predicted ranks"), \
            tempfile.TemporaryDirectory(prefix="ampscope-predicted-") as folder:
        try:
            while waiting or running:
                while waiting and len(running) < width:
                    k = waiting.pop(0)
                    result = os.path.join(folder, f"rank{k}.json")
                    with signals.held():  # a rank started is listed before a signal ends it
                        running[k] = (*spawn(request, result,
                                             rank_environment(k, nproc, 29500, run_id,
                                                              per_machine=PER_MACHINE),
                                             session=True), result)
                for k, (process, copiers, result) in list(running.items()):
                    if (code := process.poll()) is None:
                        continue
                    for copier in copiers:
                        copier.join(timeout=10)
                    del running[k]
                    try:
                        traces[k] = answer(result, code, target)
                    except AmpscopeError as e:
                        raise AmpscopeError(f"rank {k} of {nproc} failed: {e}") from None
                if time.monotonic() > deadline:
                    raise AmpscopeError(f"the predicted ranks of {target} did not finish in "
                                        f"{timeout:.0f} s: give --timeout more")
                time.sleep(0.02)
        except KeyboardInterrupt:
            passed_on = signal.SIGINT  # the ranks, in sessions of their own, did not get it
            raise
        finally:
            signals.hold()
            # The ranks still running after a failure or a signal (passed on to them): only
            # those started here, each with the processes it started (script/rank_groups.py).
            end_groups([process for process, _, _ in running.values()],
                       signals.received or passed_on)
            for _, copiers, _ in running.values():
                for copier in copiers:
                    copier.join(timeout=10)
    return traces


def record(trace: Trace, nproc: int) -> tuple:
    """What two ranks must share to be taken as one: each parameter's name, dtype, shape,
    local shard and gradient dtype, the bytes held, every collective of the steps (kind,
    phase, module, dtype, payload) and the memory peak."""
    params = tuple((p.name, p.dtype, tuple(p.shape), getattr(p, "local_shape", None),
                    p.grad_dtype) for p in trace.parameters)
    rank = rank_report(0, trace, nproc)
    calls = tuple((c.kind, c.phase, c.module, c.dtype, c.payload_bytes) for c in rank.collectives)
    peak = rank.peak
    return params, tuple(sorted((k, tuple(sorted(v.items())))
                                for k, v in rank.held.items())), calls, \
        (peak.bytes, peak.rounded_bytes, peak.reserved_bytes) if peak is not None else None


def predict_ranks(target: str, argv: Sequence[str], nproc: int, *, all_ranks: bool = False,
                  **options) -> tuple[DistributedReport, dict[int, Trace], dict[int, int | None]]:
    """The predicted report of an `nproc`-rank job, the traces of the ranks that ran, and for
    every other rank the run rank it is taken to be (None: not run, not known)."""
    if nproc < 1 or nproc > MAX_PREDICTED:
        raise AmpscopeError(f"--nproc with --predict must be between 1 and {MAX_PREDICTED}; "
                            f"got {nproc}")
    why = no_fake_collectives("run --nproc --predict")
    if why is not None:
        raise AmpscopeError(why)
    config_for(options.get("device") or "")  # unreadable PYTORCH_CUDA_ALLOC_CONF: no cuda job
    first = sorted({0, nproc - 1}) if not all_ranks else list(range(nproc))
    traces = run_predicted(target, argv, nproc, first, **options)
    roles = traces[0].rank_roles if len(traces[0].rank_roles) == nproc else None
    if roles is not None and not all_ranks and len(set(roles)) <= EVERY_RANK_UP_TO:
        traces.update(run_predicted(target, argv, nproc,
                                    sorted(set(roles) - set(traces)), **options))
    records = {k: record(t, nproc) for k, t in traces.items()}
    if roles is not None and set(roles) <= set(traces) and len(set(roles)) > 1 and all(
            records[k] == records[roles[k]] for k in traces):
        taken: dict[int, int | None] = {k: roles[k] for k in range(nproc) if k not in traces}
        return _report(traces, target, nproc, False, _roles_note(traces, roles)), traces, taken
    same = len(set(records.values())) == 1
    if not same and not all_ranks and nproc <= EVERY_RANK_UP_TO:
        traces.update(run_predicted(target, argv, nproc,
                                    [k for k in range(nproc) if k not in traces], **options))
        same = len({record(t, nproc) for t in traces.values()}) == 1
    taken = {k: (0 if same else None) for k in range(nproc) if k not in traces}
    return _report(traces, target, nproc, same), traces, taken


def _roles_note(traces: dict[int, Trace], roles: list[int]) -> str:
    """The note that says which run rank each other rank is taken to be, by role."""
    ran = sorted(traces)
    firsts = sorted(set(roles))
    stand = Counter(role for k, role in enumerate(roles) if k not in traces)
    parts = [f"rank {r} for {stand[r]}" for r in firsts if stand[r]]
    return (f"Every rank ran; each one's record equals that of the first rank of its role "
            f"({plural(len(firsts), 'role')}: ranks whose shard of every parameter has the same "
            "shape).") if len(ran) == len(roles) else (
        f"Ranks {', '.join(map(str, ran))} ran: the first of each of the "
        f"{len(firsts)} roles (ranks whose shard of every parameter has the same shape, as "
        "DTensor lays it out), and the last rank, whose record equals its role's. Each other "
        f"rank is taken to be the first of its role: {', '.join(parts)}.")


def _report(traces: dict[int, Trace], target: str, nproc: int, same: bool,
            roles_note: str | None = None) -> DistributedReport:
    ranks = [rank_report(k, t, nproc) for k, t in sorted(traces.items())]
    kinds = {c.kind for r in ranks for c in r.collectives}
    ran = sorted(traces)
    listed = " and ".join(map(str, ran)) if len(ran) == 2 else ", ".join(map(str, ran))
    notes = [f"{target} was predicted as {plural(nproc, 'rank')} on fake tensors (fake "
             "weights, real data), each rank run in a process of its own on PyTorch's fake "
             "process group: every collective returns at once with its real shapes and dtypes."]
    others = nproc - len(ran)
    if roles_note is not None:
        notes.append(roles_note)
    elif others and same:
        notes.append(f"Ranks {listed} ran and gave identical records; the "
                     f"other {others} are taken to be the same as rank 0: their shards are "
                     "the same size.")
    elif others:
        notes.append(f"Ranks {listed} ran and their records differ; the "
                     f"other {others} were not run (--all-ranks runs every rank).")
    elif len(ran) > 1:
        notes.append(f"Every rank ran; their records are "
                     f"{'identical' if same else 'not all the same'}.")
    if not kinds:
        notes.append("No rank ran a collective: the script made no process group, or used it "
                     "for nothing its run traced.")
    first = traces[ran[0]]
    return DistributedReport(
        model=first.model.name, parameters=first.model.parameters, setting=first.setting,
        parallel=Parallel("fsdp" if kinds & {"all_gather", "reduce_scatter"} else "ddp", nproc),
        backend="fake", mode="predict", ranks=ranks, notes=notes, trace=first)


def predicted_dict(report: DistributedReport, taken: dict[int, int | None],
                   base: Callable[[DistributedReport], dict]) -> dict:
    """The `ampscope.distributed/1` document (`base` writes it): every rank that ran with
    `"ran": true`, every other one as `{"rank", "ran": false, "same_as"}` (the run rank it is
    taken to be; null where it is not known)."""
    data = base(report)
    for r in data["ranks"]:
        r.update(ran=True, same_as=None)
    data["ranks"] += [{"rank": k, "ran": False, "same_as": s} for k, s in sorted(taken.items())]
    data["ranks"].sort(key=lambda r: r["rank"])
    return data
