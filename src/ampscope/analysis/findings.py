"""Findings: the short list of dtype facts a person would otherwise write down by hand.

Each finding is derived from the trace's records, for any model (no text keyed to model
names), and carries the kind of cause behind it.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ampscope.analysis.summary import itemsize, numel
from ampscope.records import EXPLICIT_CASTS
from ampscope.trace import Finding, Trace

_FLOATS = ("float64", "float32", "bfloat16", "float16")


def plural(n: int, noun: str) -> str:
    """"1 cast", "2 casts"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def parameter_findings(trace: Trace) -> list[Finding]:
    if not trace.parameters:
        return []
    by_dtype = Counter(p.dtype for p in trace.parameters)
    main, _ = by_dtype.most_common(1)[0]
    others = [p.name for p in trace.parameters if p.dtype != main]
    n = len(trace.parameters)
    text = f"All {n} parameters are {main}" if n > 1 else f"The only parameter is {main}"
    if others:
        odd = ", ".join(f"{p.name} ({p.dtype})" for p in trace.parameters if p.dtype != main)
        text = f"{text}, except {odd}" if len(others) <= 4 else (
            f"{by_dtype[main]} of {len(trace.parameters)} parameters are {main}; the others: "
            + ", ".join(f"{n} {d}" for d, n in by_dtype.items() if d != main))
    findings = [Finding(text + ".", "parameter-dtype")]
    tied = [(p.name, p.tied_to) for p in trace.parameters if p.tied_to]
    for name, others_ in tied:
        findings.append(Finding(f"{name} is tied to {', '.join(others_)}: one tensor, counted once.",
                                "parameter-dtype"))
    return findings


def buffer_findings(trace: Trace) -> list[Finding]:
    groups: dict[str, list[str]] = defaultdict(list)
    for b in trace.buffers:
        groups[b.dtype].append(b.name.rsplit(".", 1)[-1])
    return [
        Finding(f"Buffers {_names(list(dict.fromkeys(names)))} are {dtype}.", "buffer-dtype")
        for dtype, names in groups.items()
    ]


def input_findings(trace: Trace) -> list[Finding]:
    parts = [f"{i.name} {i.dtype}" for i in trace.inputs]
    if not parts:
        return []
    return [Finding(f"Inputs: {', '.join(parts)}.", "input-dtype")]


def explicit_cast_findings(trace: Trace) -> list[Finding]:
    """Casts user code asked for (`.float()`, `.to(bf16)`) that changed a floating dtype."""
    seen: dict[tuple, int] = {}
    for call in trace.calls:
        if call.phase != "forward" or not call.inputs or not call.outputs:
            continue
        if call.func not in EXPLICIT_CASTS:
            continue
        src, dst = call.inputs[0].dtype, call.outputs[0].dtype
        if src != dst and src in _FLOATS and dst in _FLOATS:
            key = (call.func, src, dst, call.module, call.source)
            seen[key] = seen.get(key, 0) + 1
    findings = []
    for (func, src, dst, module, source), count in seen.items():
        where = f" in {module}" if module else ""
        times = f" ({count}×)" if count > 1 else ""
        findings.append(Finding(
            f"{src} → {dst} by an explicit {func.removeprefix('Tensor.')}(){where}"
            f" at {source or 'unknown source'}{times}.", "explicit-cast", source))
    return findings


def autocast_cast_findings(trace: Trace) -> list[Finding]:
    casts = [o for o in trace.ops if o.autocast_cast and o.phase == "forward"]
    if not casts:
        return []
    total = sum(numel(o.outputs[0].shape) * itemsize(o.outputs[0].dtype) for o in casts if o.outputs)
    param_casts = [o for o in casts if o.input_names and o.input_names[0]]
    targets = Counter(o.outputs[0].dtype for o in casts if o.outputs)
    dtype_text = ", ".join(f"{n} to {d}" for d, n in targets.items())
    text = (f"Autocast inserted {plural(len(casts), 'cast')} in the forward pass ({total / 1e6:.2f} MB): "
            f"{dtype_text}; {len(param_casts)} of them cast parameters or buffers.")
    return [Finding(text, "autocast-policy")]


def output_findings(trace: Trace) -> list[Finding]:
    verb = {"loss": "is", "logits": "are"}
    return [Finding(f"The {o.name} {verb[o.name]} {o.dtype}.", "output-dtype")
            for o in trace.outputs if o.name in verb]


def gradient_findings(trace: Trace) -> list[Finding]:
    with_grad = [p for p in trace.parameters if p.grad_dtype is not None]
    if not with_grad:
        return []
    differ = [p for p in with_grad if p.grad_dtype != p.dtype]
    if not differ:
        return [Finding(f"Gradients have their parameters' dtypes ({plural(len(with_grad), 'gradient')}).",
                        "parameter-dtype")]
    listed = ", ".join(f"{p.name} {p.dtype}→{p.grad_dtype}" for p in differ[:4])
    return [Finding(f"{plural(len(differ), 'gradient')} differ from their parameter's dtype: {listed}.",
                    "parameter-dtype")]


def optimizer_findings(trace: Trace) -> list[Finding]:
    keys: dict[str, Counter] = defaultdict(Counter)
    for s in trace.optimizer_state:
        keys[s.key][s.dtype] += 1
    if not keys:
        return []
    parts = [f"{key} {'/'.join(dtypes)}" for key, dtypes in keys.items()]
    return [Finding(f"Optimizer state: {', '.join(parts)}.", "optimizer")]


def derive_findings(trace: Trace) -> list[Finding]:
    return [
        *parameter_findings(trace),
        *buffer_findings(trace),
        *input_findings(trace),
        *explicit_cast_findings(trace),
        *autocast_cast_findings(trace),
        *output_findings(trace),
        *gradient_findings(trace),
        *optimizer_findings(trace),
    ]
