"""Run one step on N real processes (`launch`) or predict rank 0 of N (`predict`).

Why `launch` spawns its ranks with `torch.multiprocessing` rather than `torchrun`, and how
`predict` runs rank 0 of any N in this process on PyTorch's fake process group:
docs/distributed.md ("Launching: why `torch.multiprocessing` and not `torchrun`", "Predicting
at scale").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ampscope import hardware
from ampscope.distributed.parallel import Parallel
from ampscope.distributed.report import DistributedReport, RankReport
from ampscope.errors import AmpscopeError
from ampscope.hardware import Accelerator
from ampscope.hardware.cuda_allocator import config_for
from ampscope.precision import Setting, parse_setting, resolve_device
from ampscope.records import SettingRecord, Trace
from ampscope.workloads import RunOptions

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0  # seconds for the whole job, start-up included


def _setting(setting: str | Setting) -> Setting:
    return resolve_device(parse_setting(setting) if isinstance(setting, str) else setting)


def free_port() -> int:
    """A TCP port of this machine free now, for a job's ranks to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, job: dict, port: int, result: str) -> None:
    """One rank: join the group, run the step, rank 0 writes the report. Always leaves the
    group, so a failing rank cannot leave the others waiting past the group's timeout."""
    from ampscope.distributed.step import rank_step
    from ampscope.models import registry

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world_size"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job["world_size"]))
    setting = _setting(job["setting"])
    backend = "nccl" if setting.run_device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method="env://", rank=rank,
                            world_size=job["world_size"],
                            timeout=timedelta(seconds=job["timeout"]))
    try:
        lm = registry.resolve(job["model"], device=setting.run_device, seed=job["seed"])
        # Every rank draws its own batch, as a DistributedSampler gives each its own data.
        generator = torch.Generator().manual_seed(job["seed"] + rank)
        batch = lm.make_batch(job["batch"], job["seq"], "train", generator,
                              device=setting.run_device)
        report = rank_step(lm, Parallel.from_dict(job["parallel"]), setting, batch,
                           optimizer=job["optimizer"])
        if report is not None:
            assert report.trace is not None
            Path(result).write_text(json.dumps({"report": report.to_dict(),
                                                "trace": report.trace.to_dict()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(model: str, parallel: Parallel, *, setting: str | Setting = "fp32", batch: int = 1,
           seq: int = 64, optimizer: str = "adamw", seed: int = 0,
           timeout: float = DEFAULT_TIMEOUT) -> DistributedReport:
    """Run one train step of a named model on `parallel.world_size` processes (gloo on CPU,
    NCCL on CUDA) and return every rank's collectives and bytes held."""
    import torch.multiprocessing as mp

    options = RunOptions("train", batch, seq, optimizer, seed=seed)
    s = _setting(setting)
    config_for(s.device)  # an unreadable PYTORCH_CUDA_ALLOC_CONF stops a cuda run before it runs
    if s.emulated:
        raise AmpscopeError(f"a real distributed run needs a real device; {s.name} is emulated "
                            "here: predict it instead (--predict)")
    backend = "nccl" if s.run_device == "cuda" else "gloo"
    if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
        raise AmpscopeError(f"this PyTorch build has no {backend} backend")
    if backend == "nccl" and torch.cuda.device_count() < parallel.world_size:
        raise AmpscopeError(f"{parallel.world_size} NCCL ranks need as many GPUs; this machine "
                            f"has {torch.cuda.device_count()}")
    job = {"model": model, "parallel": parallel.to_dict(), "setting": s.name,
           "world_size": parallel.world_size, "batch": options.batch, "seq": options.seq,
           "optimizer": options.optimizer, "seed": options.seed, "timeout": timeout}
    with tempfile.TemporaryDirectory(prefix="ampscope-dist-") as tmp:
        result = Path(tmp, "rank0.json")
        context = mp.start_processes(_worker, args=(job, free_port(), str(result)),
                                     nprocs=parallel.world_size, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AmpscopeError(f"the {parallel.world_size}-process run did not finish "
                                        f"in {timeout:.0f} s")
        except mp.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1]
            raise AmpscopeError(f"a rank failed: {last}") from e
        except mp.ProcessExitedException as e:
            # A rank that died before running any of ampscope's code: with the spawn start
            # method it re-imports the caller's main script, which must not launch again.
            raise AmpscopeError(
                f"a rank exited before starting ({e}); launch() starts processes with spawn, "
                "so a script that calls it must do so under `if __name__ == \"__main__\":`"
            ) from e
        finally:
            for process in context.processes:  # only the ones started here, by pid
                if process.is_alive():
                    process.kill()
                    process.join(5)
        written = json.loads(result.read_text())
    data = written["report"]  # rank 0's report and trace, as its to_dict()s wrote them
    return DistributedReport(
        model=data["model"]["name"], parameters=data["model"]["parameters"],
        setting=SettingRecord.from_dict(data["setting"]), parallel=Parallel.from_dict(data["parallel"]),
        backend=data["backend"], mode=data["mode"], notes=data["notes"],
        ranks=[RankReport.from_dict(r) for r in data["ranks"]],
        trace=Trace.from_dict(written["trace"]))


def predict(model: str, parallel: Parallel, *, setting: str | Setting = "fp32", batch: int = 1,
            seq: int = 64, optimizer: str = "adamw", seed: int = 0,
            gpu: str | Accelerator | None = None) -> DistributedReport:
    """Predict rank 0 of `parallel.world_size` on fake tensors and a fake process group: what
    it holds after one train step and every collective it issues, for any model size. `gpu`
    (a name of `hardware.table()` or its entry, `--gpu`) is the GPU an emulated cuda rank's
    virtual device is, whose capability picks its kernels (default: an H100)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ampscope.distributed.step import rank_step
    from ampscope.models import registry
    from ampscope.runs.environment import exact_retry
    from ampscope.torchcompat.distributed import fake_store, no_fake_collectives

    options = RunOptions("train", batch, seq, optimizer, seed=seed)
    if dist.is_initialized():
        raise AmpscopeError("a process group is already initialised here; predict from a "
                            "process of its own")
    why = no_fake_collectives("--distributed with --predict")
    if why is not None:
        raise AmpscopeError(why)
    if isinstance(gpu, str):
        gpu = hardware.by_name(gpu)  # an unknown name is refused before anything runs
    s = _setting(setting)
    config_for(s.device)  # an unreadable PYTORCH_CUDA_ALLOC_CONF stops a cuda run before it runs
    lm = registry.resolve(model, device="meta", seed=seed, target_device=s.device)
    if seq > lm.max_seq_len:
        raise AmpscopeError(f"seq {seq} exceeds {lm.name}'s context length {lm.max_seq_len}")
    data = lm.make_batch(options.batch, options.seq, "train", torch.Generator().manual_seed(seed))
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=parallel.world_size)
    try:
        # The mesh is made outside the fake mode: DeviceMesh reads real values when it is built.
        mesh = init_device_mesh("cpu", (parallel.world_size,)) if parallel.strategy == "fsdp" \
            else None
        built = [lm]

        def attempt() -> DistributedReport | None:
            # After a speed trick's failure (never the user's) the rank runs again, exactly,
            # on a fresh model: the first is sharded in part.
            model_now = built.pop() if built else registry.resolve(
                model, device="meta", seed=seed, target_device=s.device)
            return rank_step(model_now, parallel, s, data, optimizer=optimizer, predict=True,
                             mesh=mesh, gpu=gpu)

        report = exact_retry(attempt, what="the rank is traced")
    finally:
        dist.destroy_process_group()
    assert report is not None
    report.notes.append(
        f"Predicted for rank 0 of {parallel.world_size} on fake tensors and PyTorch's fake "
        "process group; a rank whose shard is padded holds at most this much.")
    return report
