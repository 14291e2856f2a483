"""`fit --gpus N`: which parallel plans of a model fit N GPUs, with the most tokens per step.

Each plan family — FSDP2 over dp = N / tp ranks, tensor parallelism over tp, activation
checkpointing or not — is traced as rank 0 of N on fake tensors and PyTorch's fake process
group, as `trace --distributed fsdp --predict` traces one: the model built on the meta
device, FSDP2 on every repeated block and the root, the same train step, at the few depths and
micro-batches analysis/plans.py derives every plan from (its docstring: the rules, the check
that the blocks run alike, the step time). The probes run in worker processes forked from this
one (`_Search`), each with a fake process group of its own; with a GPU (`gpu`) the plans rank
by predicted tokens/s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from ampscope import hardware, workloads
from ampscope.analysis.plans import (
    PROBE_BATCHES,
    PROBE_DEPTHS,
    Plan,
    PlansReport,
    PlanTime,
    Probe,
    Rule,
    could_win,
    derived_time,
    largest_batch,
    matmul_flops,
    places,
    probe_time,
    ranked,
)
from ampscope.analysis.step_time import step_time
from ampscope.api.fit import memory_budget
from ampscope.api.preparation import resolved
from ampscope.distributed.block_forward import Unlike, unlike_blocks, unlike_lead
from ampscope.distributed.fake_world import fake_world, mesh_2d
from ampscope.distributed.parallel import Parallel, parse_mp_policy
from ampscope.distributed.probe_depth import blocks_of, full_depth, truncate
from ampscope.distributed.report import DistributedReport
from ampscope.distributed.tensor_parallel import tensor_parallel_plan
from ampscope.errors import AmpscopeError, first_line
from ampscope.hardware.cuda_allocator import AllocatorConfig, config_for
from ampscope.hardware.known import Accelerator
from ampscope.models import registry
from ampscope.models.base import LoadedModel
from ampscope.precision import Setting, on_device
from ampscope.render.plans import plan_line
from ampscope.render.style import format_bytes
from ampscope.runs.environment import exact_retry
from ampscope.runtime.user_frames import user_line
from ampscope.torchcompat.distributed import no_fake_collectives

# The largest micro-batch the search answers (the rule is exact past it, but no probe ran
# near it: say so rather than offer a batch of millions).
BATCH_LIMIT = 4096
# The most GPUs a search takes: its fake process group and device mesh hold one entry per
# rank, and no job trains on more (the largest are tens of thousands).
MAX_GPUS = 65536
# Worker processes for the plan families (each holds a model's probes: a few hundred MiB).
MAX_WORKERS = 4


def plans(model: str, gpus: int, *, gpu: str | None = None, memory_size: str | None = None,
          setting: str | Setting = "bf16", mp_policy: str | None = None, seq: int = 2048,
          optimizer: str = "adamw", on_probe: Callable[[str], None] | None = None
          ) -> PlansReport:
    """Every plan of `model` on `gpus` GPUs: FSDP2 over the GPUs (times tensor parallelism of
    2, 4 or 8 where the model's blocks split so), with and without activation checkpointing,
    each at its largest micro-batch whose derived per-rank peak fits; best first: by predicted
    tokens/s on `gpu` (by tokens per step with only `memory_size`)."""
    started = time.monotonic()
    check_arguments(gpus, seq)
    why = no_fake_collectives("fit --gpus")
    if why is not None:
        raise AmpscopeError(why)
    budget, accelerator, _ = memory_budget(gpu, memory_size)
    if isinstance(setting, str) and ":" not in setting:
        setting = on_device(setting, "cuda")
    base = resolved(setting)
    parallel = Parallel("fsdp", gpus, **parse_mp_policy(mp_policy))
    probe_lm = registry.resolve(model, device="meta", target_device=base.device)
    blocks = workloads.repeated_blocks(probe_lm.module)
    depth = len(blocks)
    if depth == 0:
        raise AmpscopeError(f"{probe_lm.name} has no repeated blocks (no ModuleList) to shard")
    # The first blocks may differ from the rest (dense layers before MoE ones): every probe
    # keeps them, and the depth rule extends the rest, `alike` of them.
    lead = unlike_lead(probe_lm.name, blocks, PROBE_DEPTHS[-1])
    alike_blocks = depth - lead
    if seq > probe_lm.max_seq_len:
        raise AmpscopeError(f"seq {seq} exceeds {probe_lm.name}'s context length "
                            f"{probe_lm.max_seq_len}")
    splittable, notes = _offered(probe_lm, gpus, lead, alike_blocks)
    # The probes' model: the first blocks of the one built here, copied for each probe (a
    # probe shards and changes its copy in place). Its blocks are kept for the check.
    truncate(probe_lm.module, lead + min(alike_blocks, PROBE_DEPTHS[-1]))
    families = [(tp, checkpoint) for tp in splittable for checkpoint in (False, True)]
    unlike: list[Unlike] = []

    def alike() -> bool:  # run while the workers trace: the first blocks stand for all?
        with full_depth(probe_lm.module, blocks):
            found = exact_retry(lambda: unlike_blocks(probe_lm, base, seq, lead),
                                what="the blocks' forward is compared")
        unlike.extend([found] if found is not None else [])
        return found is None

    acc = hardware.by_name(gpu) if gpu is not None else None
    allocator = config_for(base.device)  # PYTORCH_CUDA_ALLOC_CONF's options (None off cuda)
    notes += allocator.notes if allocator is not None else ()
    search_args = (probe_lm, base, parallel, gpus, alike_blocks, seq, optimizer, budget, acc,
                   allocator)
    with _Search(*search_args, lead=lead) as search:
        # (A model of at most PROBE_DEPTHS[-1] blocks is traced whole anyway.)
        found = search.run(families, on_probe,
                           check=alike if alike_blocks > PROBE_DEPTHS[-1] else None)
    notes += search.notes
    if found is None:
        # No rule takes the first blocks for unlike ones: the micro-batch rule alone (exact).
        said = unlike[0].said()
        (on_probe or (lambda _: None))(f"  {said}: each plan is traced at all {depth} blocks")
        notes.append(f"{said[0].upper()}{said[1:]}: each plan was traced at all {depth} "
                     "blocks, not derived from its first blocks.")
        with full_depth(probe_lm.module, blocks), \
                _Search(*search_args, whole=True, lead=lead) as search:
            found = search.run(families, on_probe)
        assert found is not None  # (no check: always plans)
        notes += search.notes
    if not any(p.fits for p in found):
        raise AmpscopeError(_no_fit(probe_lm.name, gpus, budget, accelerator, base, seq, found))
    return PlansReport(
        model=probe_lm.name, depth=depth, gpus=gpus,
        accelerator=accelerator, memory_bytes=budget,
        setting=base.name, mp_policy=parallel.policy_dict(), seq=seq,
        optimizer=optimizer, plans=ranked(found), seconds=time.monotonic() - started,
        notes=notes, batch_limit=BATCH_LIMIT,
        probe_depths=sorted(lead + d for d in search.depths))


def _offered(lm: LoadedModel, gpus: int, lead: int, alike_blocks: int
             ) -> tuple[list[int], list[str]]:
    """The tensor-parallel degrees the search offers (1 always), and its notes on the model's
    blocks: the degrees they cannot be split by, and why; the first blocks every probe keeps."""
    notes: list[str] = []
    # A tensor-parallel group spans at most one machine of eight, as NVLink does.
    tps = [t for t in (1, 2, 4, 8) if gpus % t == 0]
    splittable = [t for t in tps if t == 1 or tensor_parallel_plan(lm.module, t)[0]]
    refused = [t for t in tps if t not in splittable]
    if refused:  # why the smallest degree is refused (a larger one may fail sooner)
        why = tensor_parallel_plan(lm.module, refused[0])[1]
        notes.append(f"Tensor parallelism of {', '.join(map(str, refused))} is not offered: "
                     f"{why}")
    if lead:
        first = "block 0 differs" if lead == 1 else f"blocks 0-{lead - 1} differ"
        notes.append(f"{lm.name}'s {first} from its other {alike_blocks} blocks (modules or "
                     f"parameters): every plan's probes keep {'it' if lead == 1 else 'them'}, "
                     "and the rules extend the others.")
    return splittable, notes


def check_arguments(gpus: int, seq: int) -> None:
    """The numbers a search takes, refused in one line before anything runs."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise AmpscopeError(f"--gpus must be a whole number from 1 to {MAX_GPUS:,} (the GPUs "
                            f"of one job), not {gpus}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise AmpscopeError(f"--seq must be at least 1 token, not {seq}")


def _no_fit(name: str, gpus: int, budget: int, accelerator: str | None, setting: Setting,
            seq: int, found: list[Plan]) -> str:
    """One line: no plan fits even micro-batch 1, the nearest one, and what would buy room."""
    nearest = min(found, key=lambda p: p.peak_bytes)
    return (f"{name} does not fit on {gpus:,} GPUs of {format_bytes(budget)} "
            f"({accelerator or '--memory'}) under {setting.name} at seq {seq:,} in any plan, "
            f"even at micro-batch {nearest.searched_from}: the smallest peak per rank is "
            f"{format_bytes(nearest.peak_bytes)} ({nearest.name}"
            + (f", {format_bytes(nearest.reserved_bytes)} reserved"
               if nearest.reserved_bytes is not None else "") + "); more GPUs, a shorter --seq "
            "or a larger GPU would buy room")


Family = tuple[int, bool]  # (tp, checkpointing)
PlanFigures = tuple[dict[str, int], PlanTime | None, int | None]  # peaks, time, reserved peak


class _Search:
    """The probes of one search and the plans they give, traced in processes forked from this
    one (starting with torch imported and the model built), one a core; here without fork."""

    def __init__(self, lm: LoadedModel, setting: Setting, parallel: Parallel, gpus: int, depth: int,
                 seq: int, optimizer: str, budget: int, acc: Accelerator | None = None,
                 allocator: AllocatorConfig | None = None, *, whole: bool = False,
                 lead: int = 0) -> None:
        # `depth`: the model's blocks after its first `lead`, which every probe keeps.
        self.lm, self.setting, self.gpus, self.depth, self.lead = lm, setting, gpus, depth, lead
        self.seq, self.optimizer, self.budget, self.acc = seq, optimizer, budget, acc
        self.allocator, self.parallel = allocator, parallel
        # Deepest first: its ops include every op of the shallower probe, whose shapes the
        # caches then know. `whole`: the model's own depth only (its blocks are unlike).
        self.depths = PROBE_DEPTHS[::-1] if depth > PROBE_DEPTHS[-1] and not whole else (depth,)
        self.workers = 1
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._held: tuple[int, contextlib.ExitStack, dict] | None = None  # (pid, group, meshes)
        self.notes: list[str] = []  # the tensor-parallel degrees whose ranks failed, and why

    def __enter__(self) -> _Search:
        _SEARCH[:] = [self]
        workers = min(os.cpu_count() or 1, MAX_WORKERS)
        if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
            self.workers = workers
            self._pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        if self._held is not None and self._held[0] == os.getpid():
            self._held[1].close()  # (a worker's ends with the worker)
        _SEARCH.clear()

    def run(self, families: list[Family], on_probe: Callable[[str], None] | None,
            check: Callable[[], bool] | None = None) -> list[Plan] | None:
        """Each family's plan (`family_plan`), and at micro-batch 1 (traced on its own: its
        storages do not pair with larger batches') only where that could change the answer
        (analysis/plans.py: `could_win`); None when `check` (`_map`'s `meanwhile`) answers
        False."""
        say = on_probe or (lambda _: None)
        rows = self._map(_families_job, self._groups(families), meanwhile=check)
        if rows is None:
            return None
        found = [row for group in rows for row in group]
        failed = {f: why for f, why, _, _ in found if isinstance(why, str)}
        for tp in sorted({f[0] for f in failed}):
            which = [f for f in failed if f[0] == tp]
            how = "" if len(which) > 1 else f" with{'' if which[0][1] else 'out'} checkpointing"
            self.notes.append(f"Tensor parallelism of {tp}{how} is not offered: its rank failed "
                              f"under it: {failed[which[0]]}")
        found = [row for row in found if not isinstance(row[1], str)]
        families = [f for f in families if f not in failed]
        plans: dict[Family, Plan] = {family: plan for family, plan, _, _ in found}
        ceiling = {family: rate for family, _, _, rate in found}
        say(f"  {sum(n for _, _, n, _ in found)} ranks traced at micro-batches 2 and 3")
        again = [f for f in families if not plans[f].fits and could_win(
            self.gpus // f[0] * self.seq, ceiling[f], list(plans.values()))]
        # One job per family where there are as many as workers: its shallower probe runs
        # on the ops and shapes its deeper one left in the worker's caches (a tenth to a
        # third of a probe); else one per probe, on as many workers.
        jobs = [[(f, d, 1) for d in self.depths] for f in again]
        if len(again) < self.workers:
            jobs = [[job] for family in jobs for job in family]
        third = self._map(_probes_job, jobs)
        assert third is not None  # (no `meanwhile` to stop it)
        probes = [probe for job in third for probe in job]
        n = len(self.depths)
        for k, f in enumerate(again):
            plans[f] = self.plan(f, probes[k * n:(k + 1) * n], 1)
        for f in families:
            say(plan_line(plans[f]))
        return [plans[f] for f in families]

    def _groups(self, families: list[Family]) -> list[list[Family]]:
        """The jobs for the workers. The families of one tensor-parallel degree run the same
        ops on the same shapes (checkpointing adds recomputation; a larger micro-batch changes
        only the activations'), so one worker takes them all: the caches the first probe fills
        (FakeTensorMode's, DTensor's sharding propagation, ampscope's own) answer most of the
        others' ops, which a cold probe takes twice as long to run. One job per family where
        there are fewer degrees than workers. Tensor-parallel jobs first: DTensor's sharding
        propagation on every op makes them the longest, and the FSDP-only job fills in."""
        by_tp: dict[int, list[Family]] = {}
        for f in sorted(families, key=lambda f: (f[0] == 1, f[0])):
            by_tp.setdefault(f[0], []).append(f)
        groups = list(by_tp.values())
        return groups if len(groups) >= self.workers else [[f] for f in families]

    def _map(self, job: Callable, args: list, meanwhile: Callable[[], bool] | None = None
             ) -> list | None:
        """`job` of each of `args`, in the workers (or here, after `meanwhile`); `meanwhile`
        here, once, while the workers run them: None when it answers False (the jobs are of
        no use; those begun end with the pool)."""
        pending = None
        if self._pool is not None:
            try:
                pending = self._pool.map(job, args)  # submitted: the workers start
            except Exception:  # noqa: BLE001 - a pool that cannot start: the jobs run here
                self._pool.shutdown(cancel_futures=True)
                self._pool = None
        if meanwhile is not None and not meanwhile():
            return None
        if self._pool is not None and pending is not None:
            try:
                return list(pending)
            except Exception:  # noqa: BLE001 - any pool failure: the jobs run here instead
                # A forked worker that cannot run a probe (autograd refuses to run backward
                # in a process forked after its threads started, as in a long-lived caller):
                # this process runs them, and raises what they raise.
                self._pool.shutdown(cancel_futures=True)
                self._pool = None
        return [job(a) for a in args]

    def family_plan(self, family: Family) -> tuple[Family, Plan | str, int, float | None]:
        """The family's plan from its probes at micro-batch 2, and 3 where 2 fits; with the
        number of ranks traced, and, where it does not fit and its probes were timed, its
        tokens/s at micro-batch 2 (no smaller batch runs faster: `run`). A tensor-parallel
        family whose rank the model's code cannot run split (Llama 4's text model changes a
        DTensor's local view in place) gives why instead: the others still answer."""
        low, high = PROBE_BATCHES
        try:
            probes = [self.probe(family, d, low) for d in self.depths]
        except Exception as e:  # whatever the model's code raises split: said, as the CLI says it
            if family[0] == 1:
                raise
            line = user_line(e)  # the model's line that raised
            at = f" at {line}" if line else ""
            return family, f"{type(e).__name__}{at}: {first_line(e)}", 0, None
        plan = self.plan(family, probes, low)
        rate = None
        if plan.fits:
            probes += [self.probe(family, d, high) for d in self.depths]
            plan = self.plan(family, probes, low)
        elif self.acc is not None:
            seconds = derived_time(probes, self.depth, low).seconds
            rate = self.gpus // family[0] * low * self.seq / seconds if seconds > 0 else None
        return family, plan, len(probes), rate

    def probe(self, family: Family, depth: int, batch: int) -> Probe:
        """Rank 0 of the family traced at `depth` blocks and micro-batch `batch`."""
        tp, checkpoint = family
        return _probe(self.lm, self.setting, self.parallel, self.mesh(tp), depth, batch,
                      self.seq, self.optimizer, checkpoint, self.acc, self.lead)

    def mesh(self, tp: int):
        """The (dp, tp) mesh on this process's fake process group, both kept for all its
        probes: DTensor's sharding cache matches meshes by their ranks, so a fresh group per
        probe must empty it (`fake_world`); kept, it answers a later probe's ops exactly."""
        if self._held is None or self._held[0] != os.getpid():
            self._held = (os.getpid(), contextlib.ExitStack(), {})
            self._held[1].enter_context(fake_world(self.gpus))
        meshes = self._held[2]
        if tp not in meshes:
            meshes[tp] = mesh_2d(self.gpus // tp, tp)
        return meshes[tp]

    def plan(self, family: Family, probes: list[Probe], start: int) -> Plan:
        """The family's largest micro-batch from `start` (every batch from its probes' two,
        or `start` alone when they have one)."""
        (tp, checkpoint), dp = family, self.gpus // family[0]
        cuda = self.setting.device == "cuda"
        rule = Rule(probes, rounded=cuda, allocator=self.allocator)
        limit = BATCH_LIMIT if len({p.batch for p in probes}) > 1 else start
        batch = largest_batch(rule, self.depth, self.budget, start, limit, reserved=cuda)
        fits = batch >= start
        at = batch if fits else start  # the figures' batch: the nearest when none fits
        peak, phase = rule.peak(self.depth, at)
        plan = Plan(dp, tp, checkpoint, batch if fits else 0,
                    dp * batch * self.seq if fits else 0, peak, phase, start,
                    at_batch_limit=fits and batch == BATCH_LIMIT,
                    reserved_bytes=rule.reserved(self.depth, at) if cuda else None)
        if fits and self.acc is not None:
            plan = derived_time(probes, self.depth, batch).of(plan, self.acc,
                                                              self.setting.matmul_precision)
        return plan


# The search while it runs: forked workers find it here (the model is not sent to them).
_SEARCH: list[_Search] = []


def _families_job(families: list[Family]) -> list[tuple[Family, Plan | str, int, float | None]]:
    return [_SEARCH[0].family_plan(f) for f in families]


def _probes_job(jobs: list[tuple[Family, int, int]]) -> list[Probe]:
    return [_SEARCH[0].probe(*job) for job in jobs]


def _probe(model: LoadedModel, setting: Setting, parallel: Parallel, mesh, depth: int, batch: int,
           seq: int, optimizer: str, checkpoint: bool, acc: Accelerator | None = None,
           lead: int = 0) -> Probe:
    """Rank 0's traced step of the model's first `lead` + `depth` blocks at micro-batch
    `batch` on the (dp, tp) `mesh` (`mesh_2d`); on `acc`, its step timed here (what the rules
    need of it, not its ops, goes back)."""
    from ampscope.distributed.step import rank_step

    dp, tp = mesh.shape

    def parallelize(module: nn.Module) -> None:  # each block split over the tp group
        from torch.distributed.tensor.parallel import parallelize_module

        plan = tensor_parallel_plan(module, tp)[0]
        assert plan is not None  # (only splittable plans are probed)
        for block in workloads.repeated_blocks(module):
            parallelize_module(block, mesh["tp"], plan)

    def attempt() -> tuple[LoadedModel, DistributedReport | None]:
        # A fresh copy each time: a speed trick's failure (never the user's) leaves the first
        # sharded in part.
        lm = dataclasses.replace(model, module=copy.deepcopy(model.module))
        truncate(lm.module, lead + depth)
        data = lm.make_batch(batch, seq, "train", torch.Generator().manual_seed(0))
        return lm, rank_step(lm, parallel, setting, data, optimizer=optimizer, predict=True,
                             mesh=mesh["dp"], checkpoint=checkpoint,
                             prepare=parallelize if tp > 1 else None, gpu=acc)

    lm, report = exact_retry(attempt, what="the rank is traced")
    assert report is not None and report.trace is not None
    trace = report.trace
    phases = [str(o.phase) for o in trace.ops]
    time = None if acc is None else probe_time(
        step_time(trace, acc, world_size=dp * tp), matmul_flops(trace))
    return Probe(depth, batch, trace.storages, phases,
                 places([o.module for o in trace.ops], phases, blocks_of(lm.module)[0], depth,
                        lead),
                 time)


def traced_peaks(model: str, gpus: int, **options) -> dict[str, int]:
    """Each phase's peak of the plan traced whole (`traced_plan`)."""
    return traced_plan(model, gpus, **options)[0]


def derived_peaks(model: str, gpus: int, **options) -> dict[str, int]:
    """Each phase's peak derived by the search's rules (`derived_plan`)."""
    return derived_plan(model, gpus, **options)[0]


def traced_plan(model: str, gpus: int, **options) -> PlanFigures:
    """`derived_plan`'s figures, traced at `depth` blocks itself: what they must equal."""
    return derived_plan(model, gpus, whole=True, **options)


def derived_plan(model: str, gpus: int, *, tp: int = 1, checkpoint: bool = False, depth: int,
                 batch: int, setting: str = "bf16", mp_policy: str | None = None, seq: int = 64,
                 optimizer: str = "adamw", gpu: str | None = None, whole: bool = False
                 ) -> PlanFigures:
    """The figures of the plan at `depth` blocks (the model's own: the whole model) and
    micro-batch `batch`, derived by `fit --gpus`'s rules from its probes (`whole`: traced as
    it is); the step time on `gpu` only, the allocator's reserved peak on CUDA only."""
    base = resolved(on_device(setting, "cuda") if ":" not in setting else setting)
    lm = registry.resolve(model, device="meta", target_device=base.device)
    parallel = Parallel("fsdp", gpus, **parse_mp_policy(mp_policy))
    acc = hardware.by_name(gpu) if gpu is not None else None
    blocks = workloads.repeated_blocks(lm.module)
    lead = unlike_lead(lm.name, blocks, PROBE_DEPTHS[-1])
    full, depth = len(blocks) - lead, depth - lead  # (the blocks after the first `lead`)
    # As the search: the first blocks for all where every block runs alike, else all of them.
    alike = not whole and full > PROBE_DEPTHS[-1] and unlike_blocks(lm, base, seq, lead) is None
    depths = PROBE_DEPTHS if alike else (depth if whole else full,)
    batches = PROBE_BATCHES if batch >= PROBE_BATCHES[0] and not whole else (batch,)
    with fake_world(gpus):
        mesh = mesh_2d(gpus // tp, tp)
        probes = [_probe(lm, base, parallel, mesh, d, b, seq, optimizer, checkpoint, acc, lead)
                  for d in depths for b in batches]
    time = derived_time(probes, depth, batch) if acc is not None else None
    rule = Rule(probes, rounded=base.device == "cuda")
    return (rule.phase_peaks(depth, batch), time,
            rule.reserved(depth, batch) if base.device == "cuda" else None)
