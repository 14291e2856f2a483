"""What ampscope predicts for each item gpu_check measures, through ampscope's public API only.

- matmuls: the step-time model's GEMM kernel, max(`op_time.matmul_seconds` (tile and wave
  quantization at the achievable rate), `op_time.memory_seconds` of its operands and result),
  as `op_time` costs a matmul's kernel, without the launch gap and host time (`op_time` adds
  those to an op inside a step; one call timed alone after warm-up has no host time hidden or
  added, and its launch latency is microseconds against milliseconds);
- bandwidth: `op_time.memory_seconds` of the bytes moved;
- attention: `step_time` of the same module traced (predicted, fake tensors) in the same
  setting: its forward phase, and forward + backward (the optimizer left out), with the
  attention ops the trace recorded, so that a kernel chosen differently shows;
- training steps: `step_time` of the predicted trace of the same step (model, setting on the
  same device type, batch, sequence), its allocated peak (`ampscope.memory`: live storage, and
  with CUDA's block rounding) and, on a cuda setting, the allocator replay's reserved peak (the
  same report, under this process's PYTORCH_CUDA_ALLOC_CONF);
- every item: the accelerator table's peak and the measurement as a fraction of it.

A prediction that cannot be made (no accelerator to predict for, a trace that fails) is left
out (None), with a line saying so: never a figure made up here. `ratio` is always measured / predicted.
"""

from __future__ import annotations

import warnings

import torch

import ampscope
from ampscope import hardware
from ampscope.analysis.op_time import matmul_seconds, memory_seconds
from ampscope.analysis.step_time import step_time
from ampscope.hardware import Accelerator
from ampscope.hardware.kernels import params
from gpu_check.measure import AttentionStep
from gpu_check.timing import Box, first_line, log

# mode -> (the dtype the step-time model and the table name it by, matmul precision, itemsize)
MATMUL_FIGURE = {"fp32": ("float32", "highest", 4), "tf32": ("tf32", "high", 4),
                 "bf16": ("bfloat16", "highest", 2), "fp16": ("float16", "highest", 2)}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted; None when either is unknown (or the prediction is zero)."""
    if measured is None or not predicted:
        return None
    return measured / predicted


def accelerator(device_info: dict, gpu: str | None) -> tuple[Accelerator | None, str]:
    """The accelerator predictions are made for, and how it was chosen: `--gpu NAME`, else the
    entry of the table that the device's name matches."""
    if gpu:
        return hardware.by_name(gpu), f"--gpu {gpu}"
    found = hardware.lookup(device_info["name"]) if device_info["device_type"] == "cuda" else None
    how = (f"matched {device_info['name']!r}" if found else
           f"no entry of ampscope's table matches {device_info['name']!r}")
    return found, how


def against_peaks(results: dict, acc: Accelerator) -> None:
    """Add the table's peak and the fraction of it to each matmul, attention and bandwidth row."""
    for row in results["matmuls"]:
        dtype, precision, _ = MATMUL_FIGURE[row["mode"]]
        peak = hardware.peak_flops(acc, "float32" if dtype == "tf32" else dtype, precision)
        row["peak_tflops"] = peak / 1e12 if peak else None
        row["of_peak"] = ratio(row.get("tflops"), row["peak_tflops"])
    for row in results["attention"]:
        peak = hardware.peak_flops(acc, "bfloat16" if row["dtype"] == "bf16" else "float32")
        row["peak_tflops"] = peak / 1e12 if peak else None
        row["of_peak"] = ratio(row.get("tflops"), row["peak_tflops"])
    for row in results["bandwidth"]:
        row["peak_bytes_per_s"] = acc.bandwidth_bytes_per_s
        row["of_peak"] = ratio(row.get("bytes_per_s"), acc.bandwidth_bytes_per_s)


def kernel_times(results: dict, acc: Accelerator) -> None:
    """The matmuls' and the copies' predicted seconds (module docstring)."""
    figures = params(acc)
    for row in results["matmuls"]:
        mode, _, itemsize = MATMUL_FIGURE[row["mode"]]
        m, k, n = row["m"], row["k"], row["n"]
        compute = matmul_seconds(m, n, k, mode, acc, figures)
        memory = memory_seconds((m * k + k * n + m * n) * itemsize, acc, figures)
        row["predicted"] = {"seconds": max(compute, memory), "compute_seconds": compute,
                            "memory_seconds": memory}
        row["ratio"] = {"seconds": ratio(row.get("seconds"), row["predicted"]["seconds"])}
    for row in results["bandwidth"]:
        row["predicted"] = {"seconds": memory_seconds(row["bytes"], acc, figures)}
        row["ratio"] = {"seconds": ratio(row.get("seconds"), row["predicted"]["seconds"])}


def attention_times(rows: list[dict], device_type: str, acc: Accelerator, box: Box) -> None:
    """Each measured attention row's predicted seconds, from its module traced (module
    docstring)."""
    x = torch.zeros(())
    for row in rows:
        if row.get("seconds") is None:
            continue
        if box.over():
            row["predicted"] = {"seconds": None, "skipped": "time box spent"}
            continue
        train = row["direction"] != "forward"
        dtype = torch.bfloat16 if row["dtype"] == "bf16" else torch.float32
        # Made on the device measured (a user's module is), traced on fake copies of it.
        step = AttentionStep(row["name"], tuple(row["shape"]), dtype, torch.device(device_type),
                             loss=train)
        try:
            trace = ampscope.trace(step, {"x": x.to(device_type)},
                                   setting=f"{device_type}:{row['dtype']}",
                                   workload="train" if train else "forward", predict=True)
        except Exception as e:  # noqa: BLE001 - one row's failed trace is that row's n/a
            row["predicted"] = {"seconds": None, "error": first_line(e)}
            log(f"attention {row['name']} {row['dtype']} {row['direction']}: not predicted: "
                f"{first_line(e)}")
            continue
        timed = step_time(trace, acc)
        seconds = timed.by_phase["forward"] + (timed.by_phase["backward"] if train else 0.0)
        row["predicted"] = {"seconds": seconds,
                            "ops": sorted({o.op for o in trace.ops if "attention" in o.op})}
        row["ratio"] = {"seconds": ratio(row["seconds"], seconds)}


def training_steps(rows: list[dict], device_type: str, acc: Accelerator | None,
                   box: Box) -> None:
    """Each measured step's predictions, from one predicted trace of the same step (its time
    only with an accelerator; its reserved peak only on a cuda setting: the CPU has no caching
    allocator)."""
    for row in rows:
        row["predicted"] = {"allocated": None, "allocated_rounded": None, "reserved": None,
                            "seconds": None}
        if row.get("seconds") is None:
            continue
        if box.over():
            row["predicted"]["skipped"] = "time box spent"
            continue
        predicted = row["predicted"]
        try:
            trace = ampscope.trace(row["model"], setting=f"{device_type}:{row['setting']}",
                                   workload="train", batch=row["batch"], seq=row["seq"],
                                   predict=True)
        except Exception as e:  # noqa: BLE001 - one step's failed trace is that row's n/a
            predicted["error"] = first_line(e)
            log(f"step {row['setting']}: not predicted: {first_line(e)}")
            continue
        # On a cuda setting the report replays the caching allocator with this process's
        # PYTORCH_CUDA_ALLOC_CONF, the options the measured steps ran under.
        report = ampscope.memory(trace)
        peak = report.peak
        predicted["allocated"] = peak.bytes
        predicted["allocated_rounded"] = peak.rounded_bytes
        if report.reserved is not None:
            predicted["reserved"] = report.reserved.reserved_peak
        if acc is not None:
            timed = step_time(trace, acc)
            predicted |= {"seconds": timed.seconds, "by_bound": timed.by_bound,
                          "by_phase": timed.by_phase, "mfu": timed.mfu}
        first = row["first_step_peak"]
        row["ratio"] = {
            "allocated": ratio(first["allocated"], predicted["allocated_rounded"]
                               or predicted["allocated"]),
            "reserved": ratio(first["reserved"], predicted["reserved"]),
            "seconds": ratio(row["seconds"], predicted["seconds"]),
        }
        log(f"predicted {row['setting']}: allocated peak {peak.bytes / 2**20:,.1f} MiB"
            + (f", {predicted['seconds'] * 1e3:.1f} ms" if predicted["seconds"] else ""))


def predictions(results: dict, gpu: str | None, box: Box) -> None:
    """Fill in every prediction this ampscope makes; `results["not_predicted"]` lists the rest."""
    acc, how = accelerator(results["device"], gpu)
    results["accelerator"] = {"name": acc.name if acc else None, "title": acc.title if acc else None,
                              "chosen": how}
    if acc is not None:  # the table's facts the model uses, to hold against the device's own
        results["accelerator"] |= {"multiprocessors": acc.multiprocessors,
                                   "bandwidth_bytes_per_s": acc.bandwidth_bytes_per_s}
    log(f"accelerator for the predictions: {acc.title if acc else 'none'} ({how})")
    missing = []
    if acc is None:
        missing.append(f"time: {how} (give one with --gpu NAME); the predicted time columns "
                       "and the table's peaks are left out")
    else:
        against_peaks(results, acc)
        kernel_times(results, acc)
        with warnings.catch_warnings():  # SDPA's per-backend warnings, as when measured
            warnings.simplefilter("ignore", UserWarning)
            attention_times(results["attention"], results["device"]["device_type"], acc, box)
    training_steps(results["steps"], results["device"]["device_type"], acc, box)
    for line in missing:
        log(f"not predicted: {line}")
    results["not_predicted"] = missing
