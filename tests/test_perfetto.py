"""The Perfetto / Chrome trace export: valid Trace Event JSON, module spans nesting as the calls
did, one slice per op carrying its record, and counters that agree with the memory and FLOP
reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

import ampscope
from ampscope.analysis.flops import flop_report
from ampscope.analysis.memory import memory_report
from ampscope.cli import main
from ampscope.records import Trace, module_label
from ampscope.records.perfetto import TIDS

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "trace_event.schema.json").read_text())


@pytest.fixture(scope="module", params=[("gpt2-tiny", False), ("nanochat-tiny", True)],
            ids=["gpt2-tiny", "nanochat-tiny-predicted"])
def step(request) -> Trace:
    model, predict = request.param
    return ampscope.trace(model, setting="fp32+amp-bf16", workload="train", seq=8,
                          predict=predict)


def _slices(doc: dict, cat: str | None = None) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def test_document_is_valid_trace_event_json(step):
    doc = step.to_perfetto()
    Draft202012Validator.check_schema(SCHEMA)
    errors = list(Draft202012Validator(SCHEMA).iter_errors(doc))
    assert not errors, errors[0].message
    json.dumps(doc)  # plain JSON values only


def test_one_slice_per_op_carrying_its_record(step):
    ops = sorted(_slices(step.to_perfetto(), "op"), key=lambda e: e["ts"])
    assert len(ops) == len(step.ops)
    for e, o in zip(ops, step.ops, strict=True):
        assert e["args"]["op"] == o.op and e["tid"] == TIDS[o.phase]
        assert [x.split("[")[0] for x in e["args"]["outputs"]] == [m.dtype for m in o.outputs]
        assert [x.split("[")[0] for x in e["args"]["inputs"]] == [m.dtype for m in o.inputs]
        assert e["args"]["autocast_cast"] == o.autocast_cast
        assert e["args"]["source"] == o.source and e["args"]["flops"] == o.flops
    # The casts autocast inserted say so, and the call they ran under had bf16 autocast on.
    casts = [e for e in ops if e["args"]["autocast_cast"]]
    assert casts and all(e["args"]["autocast"] == "bfloat16" for e in casts)
    assert any(e["args"]["inputs"][0].startswith("float32[") for e in casts)


def test_every_slice_lies_within_its_parent(step):
    """Per track, slices sorted by start (longest first) form a proper tree: a slice either
    starts after the open one ends or ends within it."""
    doc = step.to_perfetto()
    for tid in TIDS.values():
        stack: list[dict] = []
        for e in sorted((e for e in _slices(doc) if e["tid"] == tid),
                        key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"], (e, parent)
                assert parent["cat"] == "module"  # ops have no children
            if e["cat"] == "op":
                # The innermost module span around an op is the op's own module, when that
                # module was called (optimizer ops run in none).
                called = {m.name for m in step.modules}
                module = e["args"]["module"]
                if module in {module_label(n) for n in called}:
                    assert stack and stack[-1]["name"] == module
                else:
                    assert not stack
            stack.append(e)


def test_module_spans_cover_every_called_module(step):
    spans = _slices(step.to_perfetto(), "module")
    calls = {(module_label(m.name), m.phase) for m in step.modules}
    spanned = {(e["name"], p) for e in spans for p, tid in TIDS.items() if e["tid"] == tid}
    assert {c for c in calls if c[1] == "forward"} <= spanned
    types = {module_label(m.name): m.type for m in step.modules}
    assert all(e["args"]["type"] == types[e["name"]] for e in spans)


def _counter_at(doc: dict, name: str, ts: int) -> dict:
    """A counter's values at `ts`: those of its last event at or before it."""
    events = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == name
              and e["ts"] <= ts]
    return max(events, key=lambda e: e["ts"])["args"]


def test_live_bytes_counters_add_up_to_the_memory_peak(step):
    doc = step.to_perfetto()
    report = memory_report(step)
    assert report.peak.op is not None
    at_peak = _counter_at(doc, "live bytes", report.peak.op)
    assert sum(at_peak.values()) == report.peak.bytes > 0
    by_category: dict[str, int] = {}
    for row in report.at_peak:
        by_category[row.category] = by_category.get(row.category, 0) + row.bytes
    assert {c: b for c, b in at_peak.items() if b} == by_category
    # Nowhere is more live than at the peak.
    assert max(sum(e["args"].values()) for e in doc["traceEvents"]
               if e["ph"] == "C" and e["name"] == "live bytes") == report.peak.bytes


def test_flop_counter_ends_at_the_reports_total(step):
    doc = step.to_perfetto()
    last = _counter_at(doc, "FLOPs so far", len(step.ops))
    assert last["flops"] == flop_report(step, tokens=8).total > 0


def test_cli_writes_the_timeline_of_the_traced_step(tmp_path, capsys):
    timeline, saved = tmp_path / "step.perfetto.json", tmp_path / "step.json"
    assert main(["trace", "gpt2-tiny", "--seq", "8", "--perfetto", str(timeline),
                 "--json", str(saved)]) == 0
    assert f"Wrote {timeline}" in capsys.readouterr().err
    written = json.loads(timeline.read_text())
    again = Trace.from_dict(json.loads(saved.read_text()))
    assert written == again.to_perfetto()  # the same document, from the saved trace
    assert len(_slices(written, "op")) == len(again.ops)


def test_the_timeline_is_the_records_own_with_no_view_imported(step, tmp_path):
    """`Trace.to_perfetto` is a method of the record class: a trace read back in a fresh
    interpreter gives the same document without importing any view or analysis."""
    saved = tmp_path / "step.json"
    step.to_json(saved)
    code = ("import json, sys\nfrom pathlib import Path\nfrom ampscope.records import Trace\n"
            f"trace = Trace.from_dict(json.loads(Path({str(saved)!r}).read_text()))\n"
            "print(json.dumps({'document': trace.to_perfetto(), 'imported': sorted(m for m in "
            "sys.modules if m.startswith(('ampscope.render', 'ampscope.analysis')))}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    answer = json.loads(result.stdout)
    assert answer["imported"] == []
    assert answer["document"] == json.loads(json.dumps(step.to_perfetto()))


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    (["trace", "gpt2-tiny", "--perfetto", "/no/such/folder/t.json"], "no folder /no/such/folder"),
    (["trace", "gpt2-tiny", "--perfetto", "-"], "--perfetto writes a file"),
])
def test_bad_perfetto_paths_are_refused_before_the_run(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _trace_processor_shell() -> str | None:
    """A trace_processor_shell binary, if this machine has one: the `perfetto` package would
    download it at first use, which needs network access."""
    return os.environ.get("AMPSCOPE_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")


@pytest.mark.skipif(_trace_processor_shell() is None,
                    reason="no trace_processor_shell (set AMPSCOPE_TRACE_PROCESSOR)")
def test_perfetto_trace_processor_loads_and_queries_it(step, tmp_path):
    tp_module = pytest.importorskip("perfetto.trace_processor")
    path = tmp_path / "step.json"
    step.to_perfetto(path)
    config = tp_module.TraceProcessorConfig(bin_path=_trace_processor_shell())
    with tp_module.TraceProcessor(trace=str(path), config=config) as tp:
        ops = list(tp.query("select count(*) as n from slice where category = 'op'"))
        assert ops[0].n == len(step.ops)
        threads = {r.name for r in tp.query("select name from thread where name is not null")}
        assert {"forward", "backward", "optimizer"} <= threads
        depth = list(tp.query("select max(depth) as d from slice"))
        assert depth[0].d == max(m.depth for m in step.modules) + 1


def test_cli_run_writes_the_timeline_and_table_of_the_scripts_step(tmp_path, capsys):
    """`ampscope run` on the example training script, on a virtual CUDA device."""
    import csv

    import numpy as np

    example = Path(__file__).parent.parent / "examples" / "gpt" / "train.py"
    np.random.default_rng(0).integers(0, 512, 5_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    timeline, table, saved = tmp_path / "t.json", tmp_path / "m.csv", tmp_path / "trace.json"
    assert main(["run", "--device", "cuda", "--steps", "1", "--quiet", "--perfetto", str(timeline),
                 "--csv", str(table), "--json", str(saved), str(example),
                 f"--data_dir={tmp_path}", "--block_size=16"]) == 0
    traced = Trace.from_dict(json.loads(saved.read_text()))
    written = json.loads(timeline.read_text())
    assert len(_slices(written, "op")) == len(traced.ops) > 0
    # All three phases of the step; no evaluation pass ran, so that track has no slice.
    assert {e["tid"] for e in _slices(written, "op")} == {TIDS[p] for p in
                                                          ("forward", "backward", "optimizer")}
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["type"] for r in rows] == [m.type for m in traced.modules]
