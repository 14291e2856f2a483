"""How long one op takes on an accelerator: the pieces of the step-time model, each checkable by
hand (tests/test_step_time.py works them out), and one op's time from its record. The model
(tile and wave quantization, split-K, ring collectives and the link they cross, max(compute,
memory, host) + launch, a view's 0 s) and the sources of its figures: docs/performance.md,
"The method"."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ampscope.analysis.flops import matmul_dtype
from ampscope.analysis.summary import itemsize, numel
from ampscope.errors import AmpscopeError
from ampscope.hardware.kernels import (
    SIMT_MODES,
    SIMT_TILE,
    SPLIT_K_MIN,
    TENSOR_TILE,
    KernelParams,
)
from ampscope.hardware.known import Accelerator
from ampscope.records import OpCall
from ampscope.torchcompat.distributed import KINDS as COLLECTIVE_KINDS
from ampscope.torchcompat.distributed import NAMESPACES as COLLECTIVE_NAMESPACES
from ampscope.torchcompat.ops import FOREACH_PREFIX, is_view_op

BOUNDS = ("compute", "memory", "launch", "communication")
# Ops that only allocate: no kernel, no bytes (the allocator's work is host time in the caller).
_ALLOCATIONS = frozenset(("empty", "empty_like", "empty_strided", "new_empty",
                          "new_empty_strided"))


def rate(acc: Accelerator, mode: str) -> float:
    """Peak FLOP/s of `mode` on `acc`; the float32 (CUDA-core) rate where the mode has none
    (a V100 asked for bf16), and the lowest peak it has where it lacks float32 too (an
    accelerator given by `--peak-flops bf16=…` alone)."""
    peak = acc.peak_flops.get(mode) or acc.peak_flops.get("float32")
    if peak:
        return peak
    if not acc.peak_flops:
        raise AmpscopeError(f"{acc.name} has no peak FLOP/s: a step time needs one "
                            "(--peak-flops, or the hardware table)")
    return min(acc.peak_flops.values())


def matmul_seconds(m: int, n: int, k: int, mode: str, acc: Accelerator, params: KernelParams,
                   *, batch: int = 1) -> float:
    """Seconds for `batch` GEMMs of (m×k)·(k×n) in `mode` ("bfloat16", "tf32", "float32", …),
    with tile and wave quantization over the accelerator's SMs; without an SM count, the FLOPs
    at the achievable rate."""
    achievable = rate(acc, mode) * params.gemm_efficiency(mode)
    sms = acc.multiprocessors
    if not sms:
        return 2 * batch * m * n * k / achievable
    tile_m, tile_n = SIMT_TILE if mode in SIMT_MODES else TENSOR_TILE
    tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
    splits = 1
    if tiles < sms:
        splits = max(1, min(sms // tiles, k // SPLIT_K_MIN))
    waves = math.ceil(tiles * splits / sms)
    tile_seconds = 2 * tile_m * tile_n * math.ceil(k / splits) / (achievable / sms)
    return waves * tile_seconds


def memory_seconds(nbytes: int, acc: Accelerator, params: KernelParams) -> float:
    """Seconds to move `nbytes` through memory at the achievable bandwidth (0 where unknown)."""
    if not acc.bandwidth_bytes_per_s:
        return 0.0
    return nbytes / (acc.bandwidth_bytes_per_s * params["bandwidth"])


@dataclass(frozen=True)
class Link:
    """What a collective crosses: NVLink inside a node, the network between nodes."""

    name: str  # "nvlink" or "network"
    bytes_per_s: float  # per GPU, one direction, achievable
    step_seconds: float  # latency a ring step
    base_seconds: float  # latency once a collective


def link_for(ranks: int, params: KernelParams, span: tuple[int, int] | None = None) -> Link:
    """The link a group of `ranks` GPUs crosses: NVLink when its lowest and highest global
    rank (`span`) lie on one node of `gpus_per_node` GPUs (every rank between lies between),
    else the network. Without a span, by its size: NVLink when it fits one node."""
    per_node = params["gpus_per_node"]
    if span is None:
        inside = ranks <= per_node
    else:
        inside = span[0] // per_node == span[1] // per_node
    name = "nvlink" if inside else "network"
    return Link(name, params[f"{name}_bytes_per_s"] * params["link_efficiency"],
                params[f"{name}_step_s"], params["collective_base_s"])


def collective_seconds(kind: str, payload_bytes: int, ranks: int, link: Link) -> float:
    """Seconds of one ring collective of `payload_bytes` (the whole tensor: an all-gather's
    output, a reduce-scatter's input, an all-reduce's buffer) over `ranks` GPUs."""
    if ranks <= 1:
        return 0.0
    n = ranks
    if kind == "all_reduce":
        factor, steps = 2 * (n - 1) / n, 2 * (n - 1)
    elif kind == "broadcast":
        factor, steps = 1.0, n - 1
    else:  # all_gather, reduce_scatter, all_to_all
        factor, steps = (n - 1) / n, n - 1
    return factor * payload_bytes / link.bytes_per_s + link.base_seconds + steps * link.step_seconds


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    try:
        size = itemsize(dtype)
    except (AttributeError, TypeError):  # not a torch dtype name ("?"): count nothing
        return 0
    return numel(shape) * size


def op_bytes(op: OpCall) -> int:
    """Bytes an op's kernel reads and writes: its inputs and outputs. An in-place foreach op
    records no outputs: it writes its first list again (the inputs up to the first repeat of
    the list's shapes)."""
    read = sum(tensor_bytes(m.shape, m.dtype) for m in op.inputs)
    written = sum(tensor_bytes(m.shape, m.dtype) for m in op.outputs)
    if not op.outputs and _name(op).endswith("_") and op.inputs:
        first = _first_list(op)
        written = sum(tensor_bytes(m.shape, m.dtype) for m in op.inputs[:first])
    return read + written


def _first_list(op: OpCall) -> int:
    """Length of the first tensor list of a foreach op: the shortest period of its inputs'
    shapes that divides their number (the whole for one list or a plain op)."""
    shapes = [m.shape for m in op.inputs]
    if not op.op.startswith(f"aten.{FOREACH_PREFIX}"):
        return 1
    for period in range(1, len(shapes) // 2 + 1):
        if len(shapes) % period == 0 and shapes == shapes[:period] * (len(shapes) // period):
            return period
    return len(shapes)


def _name(op: OpCall) -> str:
    """The op's name without namespace and overload: "aten.add_.Tensor" -> "add_"."""
    rest = op.op.partition(".")[2]
    return rest.rpartition(".")[0] or rest


def collective_kind(op: OpCall) -> str | None:
    namespace = op.op.partition(".")[0]
    return COLLECTIVE_KINDS.get(_name(op)) if namespace in COLLECTIVE_NAMESPACES else None


def attention_kind(op: OpCall) -> str | None:
    """"flash", "efficient", "cudnn", "flex" or "math" for an attention op with FLOPs."""
    if "attention" not in op.op or not op.flops:
        return None
    return next((k for k in ("flash", "efficient", "cudnn", "flex") if k in op.op), "math")


def matmul_mode(op: OpCall) -> str:
    """The math mode of an op with FLOPs: its dtype ("float8" for any fp8), "tf32" for a
    float32 matmul that ran on TF32, "bfloat16" for one its backend ran in bf16."""
    dtype = matmul_dtype(op)
    if dtype.startswith("float8"):
        return "float8"
    if dtype == "float32" and op.fp32_precision in ("tf32", "bf16"):
        return "tf32" if op.fp32_precision == "tf32" else "bfloat16"
    return dtype


def gemm_shape(op: OpCall) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a matmul-like op from its output and FLOPs (2·batch·m·n·k): a
    batched matmul's leading output dim is its batch, a convolution's output channels are n,
    any other op's last output dim is n and the rest m."""
    out = op.outputs[0].shape if op.outputs and op.outputs[0].shape else (1, 1)
    name = _name(op)
    batch = 1
    if "bmm" in name and len(out) >= 3:
        batch, m, n = numel(out[:-2]), out[-2], out[-1]
    elif "convolution" in name and len(out) >= 3:
        n = out[1]
        m = numel(out) // max(n, 1)
    else:
        m, n = numel(out[:-1]), out[-1]
    k = max(1, round(op.flops / max(2 * batch * m * n, 1)))
    return batch, max(m, 1), max(n, 1), k


@dataclass(slots=True)
class OpTime:
    """One op's predicted time and what bounds it."""

    index: int
    op: str
    phase: str
    module: str | None
    seconds: float
    bound: str  # one of BOUNDS; "none" for a view (0 s)
    flops: int
    bytes: int
    mode: str | None  # the math mode of its FLOPs, None without
    compute_s: float = 0.0
    memory_s: float = 0.0
    collective: str | None = None  # its kind, for a collective
    ranks: int | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "op": self.op, "phase": self.phase, "module": self.module,
                "seconds": self.seconds, "bound": self.bound, "flops": self.flops,
                "bytes": self.bytes, "mode": self.mode}


def op_time(op: OpCall, acc: Accelerator, params: KernelParams, *,
            world_size: int = 1) -> OpTime:
    """The predicted time of one recorded op on `acc` (docs/performance.md, "One op")."""
    phase = str(op.phase)
    name = _name(op)
    if is_view_op(op.op) or name in _ALLOCATIONS:
        return OpTime(op.index, op.op, phase, op.module, 0.0, "none", op.flops, 0, None)
    nbytes = op_bytes(op)
    kind = collective_kind(op)
    if kind is not None:
        ranks = op.group or world_size
        payload = max(sum(tensor_bytes(m.shape, m.dtype) for m in op.inputs),
                      sum(tensor_bytes(m.shape, m.dtype) for m in op.outputs))
        seconds = collective_seconds(kind, payload, ranks, link_for(ranks, params, op.group_span))
        return OpTime(op.index, op.op, phase, op.module, seconds, "communication", 0, payload,
                      None, collective=kind, ranks=ranks)
    mode = None
    compute = 0.0
    if op.flops:
        mode = matmul_mode(op)
        attention = attention_kind(op)
        if attention is not None:
            compute = op.flops / (_attention_rate(op, mode, acc) * params[f"attention_{attention}"])
        else:
            batch, m, n, k = gemm_shape(op)
            compute = matmul_seconds(m, n, k, mode, acc, params, batch=batch)
    memory = memory_seconds(nbytes, acc, params)
    kernel = max(compute, memory)
    seconds = max(kernel, params["host_s"]) + params["launch_s"]
    if seconds - kernel > kernel:
        bound = "launch"
    else:
        bound = "compute" if compute >= memory else "memory"
    return OpTime(op.index, op.op, phase, op.module, seconds, bound, op.flops, nbytes, mode,
                  compute, memory)


def _attention_rate(op: OpCall, mode: str, acc: Accelerator) -> float:
    """The peak a fused attention kernel's FLOPs are held to. In float32 on an accelerator with
    TF32 (Ampere and newer), PyTorch's memory-efficient kernel runs its matmuls on Tensor Cores
    as three TF32 products (CUTLASS's OpMultiplyAddFastF32, chosen by the kernel's
    `DefaultGemmType` for float on sm80+), whatever the TF32 setting: a third of the TF32 rate.
    Other fused kernels do not take float32; a recorded one is held to the CUDA-core rate."""
    if mode in ("float32", "tf32"):
        if attention_kind(op) == "efficient" and acc.tf32_matmuls and "tf32" in acc.peak_flops:
            return acc.peak_flops["tf32"] / 3
        return rate(acc, "float32")
    return rate(acc, mode)
