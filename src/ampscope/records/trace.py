"""`Trace`: everything one capture saw, as plain records, and its JSON form.

The JSON core (`ampscope.trace/1`) is a contract other programs read: see docs/json-schema.md.
Fields may be added; the names and meanings of the existing ones do not change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ampscope.files import write_atomic
from ampscope.records.autocast_regions import AutocastRegion
from ampscope.records.diagnostics import Diagnostic
from ampscope.records.perfetto import perfetto_trace
from ampscope.records.setting import SettingRecord
from ampscope.records.table import Table
from ampscope.records.tensors import (
    TARGET_NAMES,
    BufferRecord,
    FunctionCall,
    HeldRecord,
    InputRecord,
    ModuleCall,
    OpCall,
    OptimizerStateRecord,
    ParameterRecord,
    PassKind,
    PassRecord,
    Phase,
    StorageCategory,
    StorageRecord,
    TensorMeta,
)
from ampscope.records.trace_table import KINDS, modules_table, ops_table, tensors_table
from ampscope.records.value_checks import ValueChecks, json_number

SCHEMA = "ampscope.trace/1"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    cls: str
    parameters: int  # counted once per tensor: tied weights once


@dataclass(frozen=True)
class Finding:
    """One fact in plain words, with the kind of cause behind it (see analysis/findings.py)."""

    text: str
    cause: str  # "parameter-dtype", "buffer-dtype", "input-dtype", "output-dtype",
    #             "autocast-policy", "type-promotion", "explicit-cast", "optimizer",
    #             "fp8-training"
    source: str | None = None


@dataclass
class Trace:
    model: ModelInfo
    setting: SettingRecord
    workload: str
    modules: list[ModuleCall] = field(default_factory=list)
    calls: list[FunctionCall] = field(default_factory=list)
    ops: list[OpCall] = field(default_factory=list)
    parameters: list[ParameterRecord] = field(default_factory=list)
    buffers: list[BufferRecord] = field(default_factory=list)
    optimizer_state: list[OptimizerStateRecord] = field(default_factory=list)
    inputs: list[InputRecord] = field(default_factory=list)
    outputs: list[InputRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # What the checks judged (analysis/checks/): errors, warnings and notes, most severe first.
    diagnostics: list[Diagnostic] = field(default_factory=list)
    mode: str = "run"  # "run": tensors held real values; "predict": fake tensors, no memory
    notes: list[str] = field(default_factory=list)  # what the run assumed (emulation, predict)
    storages: list[StorageRecord] = field(default_factory=list)  # memory: runs/memory.py
    held: list[HeldRecord] = field(default_factory=list)  # KV caches, plain tensor attributes
    passes: list[PassRecord] = field(default_factory=list)  # the model's forward passes
    # A rank of a distributed job whose parameters are sharded (DTensors): for every rank of
    # the world, the lowest rank whose shard of each parameter has the same shape (its role;
    # runs/inventory.py). Empty otherwise.
    rank_roles: list[int] = field(default_factory=list)
    # What a real run's values said (recorded when asked: CaptureOptions.values); None: not
    # looked at (not asked, or a predicted run's fake tensors).
    values: ValueChecks | None = None
    # Each torch.autocast region the run entered, in order (records/autocast_regions.py).
    autocast_regions: list[AutocastRegion] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": {"name": self.model.name, "class": self.model.cls,
                      "parameters": self.model.parameters},
            "setting": self.setting.to_dict(),
            "workload": self.workload,
            "mode": self.mode,
            "notes": list(self.notes),
            "modules": [_module(m) for m in self.modules],
            "ops": [_op(o) for o in self.ops],
            "calls": [_call(c) for c in self.calls],
            "tensors": {
                "parameters": [_parameter(p) for p in self.parameters],
                "buffers": [_plain(b) for b in self.buffers],
                "optimizer_state": [_state(s) for s in self.optimizer_state],
                "inputs": [_plain(i) for i in self.inputs],
                "outputs": [_plain(o) for o in self.outputs],
                "held": [_plain(h) for h in self.held],
            },
            "findings": [asdict(f) for f in self.findings],
            "diagnostics": [d.to_dict() for d in self.diagnostics],
            "storages": [_storage(s) for s in self.storages],
            "rank_roles": list(self.rank_roles),
            "passes": [asdict(p) for p in self.passes],
            "values": self.values.to_dict() if self.values is not None else None,
            "autocast_regions": [r.to_dict() for r in self.autocast_regions],
        }

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            write_atomic(path, text + "\n")
        return text

    def to_perfetto(self, path: str | Path | None = None) -> dict:
        """The step as a timeline: a Trace Event JSON document (records/perfetto.py), written
        atomically to `path` when given (open it in ui.perfetto.dev or chrome://tracing)."""
        document = perfetto_trace(model=self.model.name, setting=self.setting.name,
                                  workload=self.workload, mode=self.mode, ops=self.ops,
                                  calls=self.calls, modules=self.modules, storages=self.storages)
        if path is not None:
            write_atomic(path, json.dumps(document, separators=(",", ":")) + "\n")
        return document

    def table(self, kind: str = "ops") -> Table:
        """The records as one table: a row per op ("ops"), per module call ("modules") or per
        named tensor ("tensors"); the columns are listed in docs/api.md."""
        if kind == "ops":
            return ops_table(self.ops, self.calls)
        if kind == "modules":
            return modules_table(self.modules)
        if kind == "tensors":
            return tensors_table(self.parameters, self.buffers, self.optimizer_state,
                                 [*self.inputs, *self.outputs])
        raise ValueError(f"no table {kind!r}: give one of {', '.join(KINDS)}")

    def to_dataframe(self, kind: str = "ops"):
        """`table(kind)` as a pandas DataFrame (pandas is the optional extra `ampscope[pandas]`)."""
        return self.table(kind).to_dataframe()

    @classmethod
    def from_dict(cls, data: dict) -> Trace:
        """Read back what `to_dict` wrote (the JSON carries everything the analyses need)."""
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not an {SCHEMA} document (schema: {data.get('schema')!r})")
        model = data["model"]
        tensors = data["tensors"]
        return cls(
            model=ModelInfo(model["name"], model["class"], model["parameters"]),
            setting=SettingRecord.from_dict(data["setting"]),
            workload=data["workload"],
            modules=[
                ModuleCall(i, m["name"], m["type"], Phase(m["phase"]), m.get("depth", 0),
                           _metas(m["in"], m.get("in_shapes")), _metas(m["out"], m.get("out_shapes")))
                for i, m in enumerate(data["modules"])
            ],
            ops=[
                OpCall(i, o["op"], o.get("module"), Phase(o["phase"]), _metas(o["in"], o.get("in_shapes")),
                       _metas(o["out"], o.get("out_shapes")), o.get("autocast_cast", False),
                       o.get("caller"),
                       o.get("source"), tuple(o.get("in_names") or [None] * len(o["in"])),
                       o.get("grad_fn"), o.get("flops", 0), o.get("flops_causal", o.get("flops", 0)),
                       tuple(o.get("in_data", ())), o.get("fp32_precision"), o.get("group"),
                       tuple(float(x) for x in o.get("scalars", ())), o.get("compiled", False),
                       _tuple(o.get("group_span")))
                for i, o in enumerate(data["ops"])
            ],
            calls=[
                FunctionCall(c.get("index", i), c["func"], c["module"], Phase(c["phase"]),
                             _metas(c["in"], c.get("in_shapes")), _metas(c["out"], c.get("out_shapes")),
                             c.get("source"), c.get("autocast"), c.get("step", 0))
                for i, c in enumerate(data.get("calls", []))
            ],
            parameters=[
                ParameterRecord(p["name"], p["dtype"], tuple(p["shape"]),
                                p.get("requires_grad", True), p.get("grad_dtype"),
                                tuple(p.get("tied_to", ())), _tuple(p.get("local_shape")))
                for p in tensors["parameters"]
            ],
            # Fields beyond the core of docs/json-schema.md are optional on reading.
            buffers=[BufferRecord(b["name"], b["dtype"], tuple(b["shape"]), b.get("persistent", True))
                     for b in tensors.get("buffers", [])],
            optimizer_state=[OptimizerStateRecord(s["param"], s["key"], s["dtype"],
                                                  tuple(s.get("shape", ())),
                                                  _tuple(s.get("local_shape")))
                             for s in tensors.get("optimizer_state", [])],
            inputs=[InputRecord(i["name"], i.get("role") or ("target" if i["name"] in TARGET_NAMES
                                                            else "input"),
                                i["dtype"], tuple(i["shape"]))
                    for i in tensors.get("inputs", [])],
            outputs=[InputRecord(o["name"], o.get("role", "output"), o["dtype"], tuple(o["shape"]))
                     for o in tensors.get("outputs", [])],
            held=[HeldRecord(h["name"], h["where"], h["dtype"], tuple(h["shape"]))
                  for h in tensors.get("held", [])],
            findings=[Finding(f["text"], f["cause"], f.get("source"))
                      for f in data.get("findings", [])],
            diagnostics=[Diagnostic.from_dict(d) for d in data.get("diagnostics", [])],
            mode=data.get("mode", "run"),
            notes=list(data.get("notes", [])),
            storages=[StorageRecord(s.get("id", i), s["nbytes"], s["dtype"], tuple(s.get("shape", ())),
                                    s.get("created"), s.get("freed"),
                                    StorageCategory(s.get("category", "temporary")),
                                    tuple(s.get("names", ())), s.get("module"),
                                    Phase(s["phase"]) if s.get("phase") else None,
                                    s.get("op"), s.get("saved", False))
                      for i, s in enumerate(data.get("storages", []))],
            passes=[PassRecord(PassKind(p["kind"]), p["grad"], p["first_op"], p["end_op"],
                               p["tokens"]) for p in data.get("passes", [])],
            rank_roles=list(data.get("rank_roles", [])),
            values=ValueChecks.from_dict(data["values"]) if data.get("values") else None,
            autocast_regions=[AutocastRegion.from_dict(r, i)
                              for i, r in enumerate(data.get("autocast_regions", []))],
        )


def _dtypes(metas: tuple[TensorMeta, ...]) -> list[str]:
    return [m.dtype for m in metas]


def _shapes(metas: tuple[TensorMeta, ...]) -> list[list[int]]:
    return [list(m.shape) for m in metas]


def _metas(dtypes: list[str], shapes: list[list[int]] | None) -> tuple[TensorMeta, ...]:
    shapes = shapes or [[] for _ in dtypes]
    return tuple(TensorMeta(d, tuple(s)) for d, s in zip(dtypes, shapes, strict=True))


def _module(m: ModuleCall) -> dict:
    return {"name": m.name, "type": m.type, "phase": m.phase, "in": _dtypes(m.inputs),
            "out": _dtypes(m.outputs), "depth": m.depth,
            "in_shapes": _shapes(m.inputs), "out_shapes": _shapes(m.outputs)}


def _op(o: OpCall) -> dict:
    return {"op": o.op, "module": o.module, "phase": o.phase, "in": _dtypes(o.inputs),
            "out": _dtypes(o.outputs), "autocast_cast": o.autocast_cast, "source": o.source,
            "in_shapes": _shapes(o.inputs), "out_shapes": _shapes(o.outputs),
            "in_names": list(o.input_names), "caller": o.caller, "grad_fn": o.grad_fn,
            "flops": o.flops, "flops_causal": o.flops_causal, "in_data": list(o.input_data),
            "fp32_precision": o.fp32_precision, "group": o.group,
            "scalars": [json_number(x) for x in o.scalars],
            "compiled": o.compiled,
            "group_span": _list(o.group_span)}


def _call(c: FunctionCall) -> dict:
    return {"index": c.index, "step": c.step, "func": c.func, "module": c.module, "phase": c.phase, "in": _dtypes(c.inputs),
            "out": _dtypes(c.outputs), "source": c.source, "autocast": c.autocast,
            "in_shapes": _shapes(c.inputs), "out_shapes": _shapes(c.outputs)}


def _parameter(p: ParameterRecord) -> dict:
    return {"name": p.name, "dtype": p.dtype, "shape": list(p.shape),
            "grad_dtype": p.grad_dtype, "requires_grad": p.requires_grad,
            "tied_to": list(p.tied_to), "local_shape": _list(p.local_shape)}


def _state(s: OptimizerStateRecord) -> dict:
    return {"param": s.param, "key": s.key, "dtype": s.dtype, "shape": list(s.shape),
            "local_shape": _list(s.local_shape)}


def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return list(shape) if shape is not None else None


def _tuple(values: list | None) -> tuple | None:
    return tuple(values) if values is not None else None


def _storage(s: StorageRecord) -> dict:
    return {"id": s.id, "nbytes": s.nbytes, "dtype": s.dtype, "shape": list(s.shape),
            "created": s.created, "freed": s.freed, "category": s.category,
            "names": list(s.names), "module": s.module, "phase": s.phase, "op": s.op,
            "saved": s.saved}


def _plain(record) -> dict:
    d = asdict(record)
    if "shape" in d:
        d["shape"] = list(d["shape"])
    return d
