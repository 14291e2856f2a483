"""Distributed policies: what a run asked its collectives to carry, and what they carried
(gradient reductions, fp8 layers' all-gathers)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from ampscope.analysis.checks import Hit, rule
from ampscope.analysis.checks.evidence import count, op_name
from ampscope.analysis.fp8 import fp8_modules
from ampscope.analysis.summary import itemsize, numel
from ampscope.records import OpCall, Phase, Trace
from ampscope.torchcompat.distributed import KINDS

_REDUCTIONS = ("all_reduce", "reduce_scatter")


def _kind(op: OpCall) -> str | None:
    return KINDS.get(op_name(op))


def _reduced(op: OpCall) -> str | None:
    """The floating dtype a reduction carried (its first floating input)."""
    return next((m.dtype for m in op.inputs if m.dtype.startswith(("float", "bfloat"))), None)


@rule("AMP101", "reductions-below-reduce-dtype", "warning",
      "gradient reductions of one step in a lower precision than its others")
def reductions_below_reduce_dtype(trace: Trace) -> Iterator[Hit]:
    # Gradients are reduced in backward: FSDP2's reduce-scatter in its policy's reduce_dtype,
    # DDP's all-reduce in its buckets' dtype. Another reduction of the same backward in a
    # narrower dtype (tensor parallelism's all-reduce of activation gradients, which no
    # MixedPrecisionPolicy governs) is the precision the policy asked for, not kept.
    reductions = [(o, d) for o in trace.ops if o.phase == Phase.BACKWARD
                  and _kind(o) in _REDUCTIONS and (d := _reduced(o)) is not None]
    if not reductions:
        return
    widest = max((d for _, d in reductions), key=itemsize)
    narrow = [(o, d) for o, d in reductions if itemsize(d) < itemsize(widest)]
    if not narrow:
        return
    wide = Counter(_kind(o) or "" for o, d in reductions if d == widest)
    low = Counter((_kind(o) or "", d) for o, d in narrow)
    first = narrow[0][0]
    yield Hit(
        f"Some gradient reductions run in {narrow[0][1]} while the step's others run in "
        f"{widest}: {', '.join(f'{count(n, k)} in {d}' for (k, d), n in low.items())}.",
        (", ".join(f"{count(n, k)} in {widest}" for k, n in wide.items())
         + " in the backward pass (the precision asked for: FSDP2's reduce_dtype, DDP's "
           "buckets)",
         f"the first narrower one: {first.op} (op {first.index})"
         + (f" in module {first.module}" if first.module else "")
         + (f" at {first.source}" if first.source else "")),
        f"those sums over ranks add {narrow[0][1]} values: each partial sum rounds to "
        f"{8 if narrow[0][1] == 'bfloat16' else 11} significant bits, and the error grows "
        "with the number of ranks; a MixedPrecisionPolicy's reduce_dtype does not reach "
        "tensor parallelism's collectives",
        "keep the activations that tensor parallelism reduces in float32 around the "
        "parallel layers (e.g. a float32 output_dtype on their FSDP2 unit, or casts in the "
        "module's forward), or accept it and reduce_dtype=bfloat16 everywhere for speed",
        first.source)


_WIDE = ("bfloat16", "float16", "float32")


@rule("AMP102", "fp8-weights-gathered-in-16-bit", "note",
      "fp8 layers whose weights FSDP2 all-gathers in 16 or 32 bits")
def fp8_weights_gathered_wide(trace: Trace) -> Iterator[Hit]:
    # torchao's float8 training casts each weight to float8 for its matmul. Unless the weights
    # are float8 tensors to FSDP2 (enable_fsdp_float8_all_gather), the unit holding them is
    # all-gathered in its param_dtype first and cast after: twice the bytes on the wire.
    fp8 = fp8_modules(trace)
    if not fp8:
        return
    gathers = [(o, d) for o in trace.ops if o.phase == Phase.FORWARD and _kind(o) == "all_gather"
               and (d := _reduced(o)) in _WIDE and o.module is not None
               and any(m == o.module or o.module == "" or m.startswith(o.module + ".")
                       for m in fp8)]
    if not gathers:
        return
    first, dtype = gathers[0]
    size = sum(numel(m.shape) * itemsize(m.dtype) for o, _ in gathers for m in o.outputs[:1])
    yield Hit(
        f"{count(len(fp8), 'layer')} run{'s' if len(fp8) == 1 else ''} its matmuls in fp8, but "
        f"FSDP2 all-gathers {'its' if len(fp8) == 1 else 'their'} weights in {dtype} and they "
        "are cast to float8 after.",
        (f"{count(len(gathers), 'all-gather')} in the forward pass carried {dtype} "
         f"({size:,} B gathered), the first for module {first.module or '(model)'}",),
        "each weight crosses the network in 16 or 32 bits and is cast on every rank: an "
        "all-gather of float8 weights sends half the bytes of bfloat16 (a quarter of float32) "
        "and casts each shard once",
        "Float8LinearConfig(enable_fsdp_float8_all_gather=True) in torchao's "
        "convert_to_float8_training, where the weights' amax all-reduce costs less than the "
        "bytes saved (large weights, many ranks)",
        first.source)
