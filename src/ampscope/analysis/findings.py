"""Findings: the short list of dtype facts a person would otherwise write down by hand.

Each finding is derived from the trace's records, for any model (no text keyed to model
names), and carries the kind of cause behind it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import groupby
from typing import cast

from ampscope.analysis.causes import FLOATS, DtypeChange, by_cause, dtype_changes, group
from ampscope.analysis.flow import first_step
from ampscope.analysis.fp8 import collapsed, fp8_findings, fp8_modules
from ampscope.analysis.policy_versions import policy_version_findings
from ampscope.analysis.summary import forward_passes, itemsize, numel
from ampscope.records import EXPLICIT_CASTS, Finding, ModuleCall, OpCall, Trace, module_label


def plural(n: int, noun: str) -> str:
    """"1 cast", "2 casts"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def listed(names: list[str], limit: int = 4) -> str:
    """"a, b, c, d and 3 more": at most `limit` names."""
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
        Finding(f"Buffers {listed(list(dict.fromkeys(names)))} are {dtype}.", "buffer-dtype")
        for dtype, names in groups.items()
    ]


def input_findings(trace: Trace) -> list[Finding]:
    parts = [f"{i.name} {i.dtype}" for i in trace.inputs]
    if not parts:
        return []
    return [Finding(f"Inputs: {', '.join(parts)}.", "input-dtype")]


def explicit_cast_findings(trace: Trace) -> list[Finding]:
    """Casts user code asked for (`.float()`, `.to(bf16)`) that changed a floating dtype."""
    # One finding per cast and source line; the modules it ran in are collapsed across
    # repeated blocks ("model.layers.0–79.input_layernorm"), so 80 layers make one line.
    seen: dict[tuple, list[str]] = {}
    fp8 = fp8_modules(trace)  # the fp8 recipe's own casts: fp8_findings sums them up
    for call in trace.calls:
        if call.phase != "forward" or not call.inputs or not call.outputs or call.module in fp8:
            continue
        if call.func not in EXPLICIT_CASTS:
            continue
        src, dst = call.inputs[0].dtype, call.outputs[0].dtype
        if src != dst and src in FLOATS and dst in FLOATS:
            key = (call.func, src, dst, call.source)
            seen.setdefault(key, []).append(call.module or "")
    findings = []
    for (func, src, dst, source), modules in seen.items():
        named = [m for m in modules if m]
        where = f" in {collapsed(named)}" if named else ""
        count = len(modules)
        times = f" ({count}×)" if count > 1 else ""
        findings.append(Finding(
            f"{src} → {dst} by an explicit {func.removeprefix('Tensor.')}(){where}"
            f" at {source or 'unknown source'}{times}.", "explicit-cast", source))
    return findings


def autocast_cast_findings(trace: Trace, changes: list[DtypeChange]) -> list[Finding]:
    """How many casts autocast inserted, and which parameters it cast on every forward ("the
    weights of every Linear"). A function's own casts (rms_norm computing in float32 and
    casting back) run while autocast is on but are not autocast's: they are left out."""
    own = {c.op_index for c in changes if c.cause != "autocast-policy"}
    casts = [o for o in trace.ops if o.autocast_cast and o.phase == "forward" and o.index not in own]
    if not casts:
        return []
    total = sum(_nbytes(o.outputs[0]) for o in casts if o.outputs)
    targets = Counter(o.outputs[0].dtype for o in casts if o.outputs)
    dtype_text = ", ".join(f"{n} to {d}" for d, n in targets.items())
    passes = forward_passes(trace)
    where = "in the forward pass" if passes == 1 else f"in {passes} forward passes"
    if passes > 1 and len(casts) % passes == 0:
        where += f" ({len(casts) // passes} each)"
    text = (f"Autocast inserted {plural(len(casts), 'cast')} {where} "
            f"({total / 1e6:.2f} MB): {dtype_text}")
    clauses = _parameter_cast_clauses(trace, changes)
    if clauses:
        text += "; among them " + "; ".join(clauses) + " (the parameters themselves keep their dtype)"
    else:
        param_casts = [o for o in casts if o.input_names and o.input_names[0]]
        text += f"; {len(param_casts)} of them cast parameters or buffers"
    return [Finding(text + ".", "autocast-policy")]


def _nbytes(meta) -> int:
    return numel(meta.shape) * itemsize(meta.dtype)


def _parameter_cast_clauses(trace: Trace, changes: list[DtypeChange]) -> list[str]:
    """"the weights of every Linear and the biases of every Linear that has one to bfloat16
    (97 casts, 247.23 MB)", one clause per (module type, from, to)."""
    types = {m.name: m.type for m in trace.modules if m.phase == "forward"}
    owned = {p.name for p in trace.parameters} | {t for p in trace.parameters for t in p.tied_to}
    casts = [c for c in by_cause(changes, "autocast-policy")
             if c.input_names and c.input_names[0] and c.module in types]
    clauses = []
    # (Each of `casts` has a module of `types` and a named first input: filtered above.)
    for (type_, _src, dst), group_ in group(casts, lambda c: (types[cast(str, c.module)],
                                                              c.inputs[0], c.output)).items():
        of_type = {n for n, t in types.items() if t == type_}
        parts = []
        leaves = group(group_, lambda c: cast(str, c.input_names[0]).rsplit(".", 1)[-1])
        for leaf in sorted(leaves, key=lambda leaf: leaf != "weight"):  # weights first
            cast_modules = {c.module for c in leaves[leaf]}
            having = {n for n in of_type if f"{n}.{leaf}" in owned} | cast_modules
            quantity = _quantity(len(cast_modules), len(having), len(of_type), type_)
            parts.append(f"the {leaf}{'es' if leaf.endswith('s') else 's'} of {quantity}")
        size = sum(_nbytes(trace.ops[c.op_index].outputs[0]) for c in group_)
        clauses.append(f"{' and '.join(parts)} to {dst} "
                       f"({plural(len(group_), 'cast')}, {size / 1e6:.2f} MB)")
    return clauses


def _quantity(cast: int, having: int, total: int, type_: str) -> str:
    """"every Linear", "every Linear that has one", "12 of 13 Linears"."""
    if cast == having:
        return f"every {type_}" if having == total else f"every {type_} that has one"
    return f"{cast} of {having} {type_}s"


def autocast_policy_findings(changes: list[DtypeChange], trace: Trace) -> list[Finding]:
    """One finding per user-level function autocast cast for: which dtype, which list.

    Autocast casts for an ATen op, which may be one of several a function runs: on CUDA,
    cross_entropy's log_softmax takes its input's dtype and only its nll_loss is on the float32
    list (on the CPU, cross_entropy itself is). Where the function's other ops ran in another
    dtype (the recorded ops of `trace` tell), the finding names the op the cast was for and
    those others, so that it agrees with the ops listed."""
    by_call = _compute_ops_by_call(trace)
    findings = []
    for (function, out, list_), cs in group(by_cause(changes, "autocast-policy"),
                                            lambda c: (c.function, c.output, c.detail)).items():
        casts = f"{plural(len(cs), 'cast')}{_where(cs)}"
        targets, others = _cast_targets(cs, out, trace, by_call)
        if not others or not targets:
            text = f"{function} runs in {out} under autocast: autocast policy ({list_}; {casts})."
        else:
            ran = "; ".join(f"its {'/'.join(ops)} {'run' if len(ops) > 1 else 'runs'} in {d}"
                            for d, ops in others.items())
            text = (f"{function}'s {'/'.join(targets)} {'run' if len(targets) > 1 else 'runs'} "
                    f"in {out} under autocast: autocast policy ({list_}; {casts}); {ran}.")
        findings.append(Finding(text, "autocast-policy", cs[0].source))
    return findings


# ATen ops that move, view or make data and compute nothing: the dtype they run in is their
# input's (or their argument's), so they do not say what dtype a function computes in. By
# name without leading underscores (`unsafe_view` stands for the private view op too).
_MOVES_DATA = frozenset({
    "view", "unsafe_view", "reshape", "reshape_alias", "t", "transpose", "permute", "expand",
    "squeeze", "unsqueeze", "slice", "select", "as_strided", "alias", "detach", "clone",
    "contiguous", "to_copy", "copy_", "unbind", "split", "split_with_sizes", "narrow",
    "flatten", "unflatten", "lift_fresh", "empty", "empty_like", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "fill_", "zero_", "new_empty", "new_zeros", "new_ones",
})


def op_name(op: OpCall) -> str:
    """"aten.nll_loss_forward.default" -> "nll_loss_forward"."""
    parts = op.op.split(".")
    return parts[1] if len(parts) > 2 else op.op


def _compute_ops_by_call(trace: Trace) -> dict[int, list]:
    """Forward ops that compute something, by the user-level call they ran under."""
    by_call: dict[int, list] = defaultdict(list)
    for o in trace.ops:
        if (o.phase == "forward" and o.caller is not None and not o.autocast_cast
                and op_name(o).lstrip("_") not in _MOVES_DATA):
            by_call[o.caller].append(o)
    return by_call


def _cast_targets(cs: list[DtypeChange], out: str, trace: Trace,
                  by_call: dict[int, list]) -> tuple[list[str], dict[str, list[str]]]:
    """The ops autocast's casts in `cs` were for (the first computing op after each cast, in
    its call), and the call's other computing ops that ran in another dtype, by dtype."""
    targets: dict[str, None] = {}
    others: dict[str, dict[str, None]] = defaultdict(dict)
    for c in cs:
        cast_op = trace.ops[c.op_index]
        computing = by_call.get(cast_op.caller, []) if cast_op.caller is not None else []
        after = next((o for o in computing if o.index > c.op_index), None)
        if after is not None:
            targets[op_name(after)] = None
        for o in computing:
            ran = next((m.dtype for m in o.outputs if m.dtype in FLOATS), None)
            if ran is not None and ran != out:
                others[ran][op_name(o)] = None
    return list(targets), {d: list(names) for d, names in others.items()}


def type_promotion_findings(changes: list[DtypeChange]) -> list[Finding]:
    def key(c: DtypeChange) -> tuple:
        return c.function, tuple(d for d in c.inputs if d in FLOATS), c.output, c.source, c.detail

    findings = []
    for (function, ins, out, source, detail), cs in group(by_cause(changes, "type-promotion"),
                                                          key).items():
        why = f"type promotion, {detail}" if detail else "type promotion"
        findings.append(Finding(
            f"{function} {' + '.join(ins)} → {out}: {why} ({len(cs)}×{_modules(cs)}"
            f"{_where(cs, 1)}).", "type-promotion", source))
    return findings


def tensor_dtype_findings(changes: list[DtypeChange]) -> list[Finding]:
    """Ops whose output dtype a parameter or buffer decides (an embedding lookup)."""
    findings = []
    decided = [c for c in changes if c.cause in ("parameter-dtype", "buffer-dtype")]
    for (function, cause, ins, out, source), cs in group(
            decided, lambda c: (c.function, c.cause, c.inputs, c.output, c.source)).items():
        kind = cause.removesuffix("-dtype")
        activations = [d for d, n in zip(ins, cs[0].input_names, strict=False) if n is None]
        names = collapsed(c.detail for c in cs)
        findings.append(Finding(
            f"{function} turns {'/'.join(dict.fromkeys(activations))} into {out}: {kind} "
            f"{names} is {out}{f' (at {source})' if source else ''}.",
            cause, source))
    return findings


def _modules(cs: list[DtypeChange]) -> str:
    modules = [module_label(c.module) for c in cs]
    return f" in {collapsed(modules)}" if modules else ""


def _where(cs: list[DtypeChange], limit: int = 2) -> str:
    sources = list(dict.fromkeys(c.source for c in cs if c.source))
    if not sources:
        return ""
    more = f" and {plural(len(sources) - limit, 'more place')}" if len(sources) > limit else ""
    return f", at {', '.join(sources[:limit])}{more}"


def activation_findings(trace: Trace, changes: list[DtypeChange]) -> list[Finding]:
    """Where activations enter each floating dtype, from module outputs in dataflow order
    (a module's output exists when it returns: children before their parent)."""
    flow = [(c, d) for c in _post_order(first_step(trace.modules))
            if (d := next((m.dtype for m in c.outputs if m.dtype in FLOATS), None))]
    if not flow:
        return []
    runs = [list(run) for _, run in groupby(flow, key=lambda cd: cd[1])]
    first = runs[1] if len(runs) > 1 else runs[0]
    # The finding's cause: the first change into a new dtype that has one, else the entry.
    found = (_entry_cause(changes, run[0][0], run[0][1]) for run in [*runs[1:], runs[0]])
    cause, source = next((f for f in found if f), None) or _born_cause(trace, runs[0][0][1])
    if len(runs) == 1:
        return [Finding(f"Activations are {runs[0][0][1]} out of every module "
                        f"({plural(len(flow), 'module call')}).", cause, source)]
    if len(runs) <= 3:
        parts = []
        for run in runs:
            (head, d), tail = run[0], run[-1][0]
            span = (f"{d} at {module_label(head.name)}" if head is tail
                    else f"{d} from {module_label(head.name)} through {module_label(tail.name)}")
            parts.append(span)
        return [Finding(f"Activations are {'; then '.join(parts)}.", cause, source)]
    by_type: dict[str, Counter] = defaultdict(Counter)
    for c, d in flow:
        by_type[c.type][d] += 1
    lists: dict[str, list[str]] = defaultdict(list)
    mixed = []
    for type_, counts in by_type.items():
        if len(counts) == 1:
            lists[next(iter(counts))].append(type_)
        else:
            mixed.append(f"{type_} ({', '.join(f'{n} {d}' for d, n in counts.items())})")
    parts = [f"{d} out of {', '.join(ts)}" for d, ts in lists.items()]
    if mixed:
        parts.append(f"either out of {', '.join(mixed)}")
    return [Finding(
        f"Activations are {runs[0][0][1]} out of {module_label(runs[0][0][0].name)}, enter "
        f"{first[0][1]} at {module_label(first[0][0].name)} and go back and forth: "
        f"{'; '.join(parts)}.", cause, source)]


def _post_order(calls: list[ModuleCall]) -> list[ModuleCall]:
    """Calls in the order they return: a call returns after all deeper calls that follow it."""
    out: list[ModuleCall] = []
    open_: list[ModuleCall] = []
    for c in calls:
        while open_ and open_[-1].depth >= c.depth:
            out.append(open_.pop())
        open_.append(c)
    out.extend(reversed(open_))
    return out


def _entry_cause(changes: list[DtypeChange], module: ModuleCall,
                 dtype: str) -> tuple[str, str | None] | None:
    """The cause and source of the first change into `dtype` inside `module`, if any."""
    prefix = f"{module.name}." if module.name else ""
    for c in changes:
        inside = c.module is not None and (c.module == module.name or c.module.startswith(prefix))
        if c.output == dtype and inside and c.cause != "op-defined":
            return c.cause, c.source
    return None


def _born_cause(trace: Trace, dtype: str) -> tuple[str, None]:
    """Activations born in `dtype` with no change into it: the parameters' or inputs' dtype."""
    if any(p.dtype == dtype for p in trace.parameters):
        return "parameter-dtype", None
    return "input-dtype", None


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


def held_state_findings(trace: Trace) -> list[Finding]:
    """What the model holds outside its parameters and buffers (a KV cache, a plain tensor
    attribute), by holder and dtype: "kv_cache: 4 float32 tensors (0.02 MB)"."""
    if not trace.held:
        return []
    groups: dict[tuple[str, str], list[int]] = {}
    for h in trace.held:
        holder = h.name.split(".")[0].split("[")[0] if h.where == "argument" else h.name
        groups.setdefault((holder, h.dtype), []).append(numel(h.shape) * itemsize(h.dtype))
    parts = [f"{holder}: {plural(len(sizes), dtype + ' tensor')} ({sum(sizes) / 1e6:.2f} MB)"
             for (holder, dtype), sizes in groups.items()]
    shown = "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more" if len(parts) > 4 else "")
    return [Finding(f"The model holds {plural(len(trace.held), 'tensor')} outside its parameters "
                    f"and buffers at the end of the run: {shown}.", "buffer-dtype")]


def derive_findings(trace: Trace) -> list[Finding]:
    changes = dtype_changes(trace)
    return [
        *parameter_findings(trace),
        *buffer_findings(trace),
        *held_state_findings(trace),
        *input_findings(trace),
        *activation_findings(trace, changes),
        *tensor_dtype_findings(changes),
        *explicit_cast_findings(trace),
        *autocast_cast_findings(trace, changes),
        *autocast_policy_findings(changes, trace),
        *policy_version_findings(trace),
        *fp8_findings(trace),
        *type_promotion_findings(changes),
        *output_findings(trace),
        *gradient_findings(trace),
        *optimizer_findings(trace),
    ]
