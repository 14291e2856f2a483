"""Every JSON document a command writes validates against its schema in ampscope/schemas, the
schema declares exactly the fields the command writes, and the schemas constrain: each case
also breaks its document in a few ways that must fail validation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from ampscope import schemas
from ampscope.cli import main

DELETE = object()
EXAMPLES = Path(__file__).parent.parent / "examples"


def _run(capsys, argv: list[str]) -> dict:
    # `run` and `check` take their own options before the script; what follows the script is the script's.
    argv = ([*argv[:1], "--json", "-", *argv[1:]] if argv[0] in ("run", "check")
            else [*argv, "--json", "-"])
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _exact(schema):
    """The schema with every object closed (`additionalProperties: false`) and every declared
    field required, so that a document passes only when the schema lists exactly its fields.
    Objects whose fields depend on a mode (policy's `oneOf`) keep their own `required`; the
    branches of `if`/`then`/`else`/`not` are left as they are."""
    if isinstance(schema, list):
        return [_exact(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("if", "then", "else", "not", "const", "enum") else _exact(v)
           for k, v in schema.items()}
    if schema.get("type") == "object" and "properties" in schema:
        out.setdefault("additionalProperties", False)
        if "oneOf" not in schema:
            out["required"] = list(schema["properties"])
    return out


def _errors(document: dict, schema: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            for e in Draft202012Validator(schema).iter_errors(document)]


def _changed(document: dict, path: tuple, value) -> dict:
    """A copy with the value at `path` replaced, deleted (DELETE) or appended (the index one
    past the end of a list)."""
    broken = copy.deepcopy(document)
    *parents, last = path
    target = broken
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[last]
    elif isinstance(target, list) and last == len(target):
        target.append(value)
    else:
        target[last] = value
    return broken


def _trimmed(document: dict, keep: int = 8) -> dict:
    """The document with every long list cut to `keep` entries (still a valid document):
    breaking a large trace and validating it again stays fast."""
    if isinstance(document, dict):
        return {k: _trimmed(v, keep) for k, v in document.items()}
    if isinstance(document, list):
        return [_trimmed(v, keep) for v in document[:keep]]
    return document


# Commands run before a case's own, to write the files it reads.
_PREPARED = {"check-trace": ["trace", "gpt2-tiny", "-s", "cuda:fp32", "--seq", "8", "--predict",
                             "--json", "{tmp}/cuda-fp32.json"]}

# (id, schema name, argv; "{tmp}" is the test's tmp_path), each with changes that must make
# the document invalid: (path, new value or DELETE).
CASES = [
    ("trace-train-predict", "trace", ["trace", "gpt2-tiny", "--seq", "8", "--predict"], [
        (("ops", 0, "phase"), "sideways"),
        (("findings",), DELETE),
        (("ops", 0, "module"), DELETE),
        (("ops", 0, "out", 0), "torch.int64"),
        (("ops", 0, "flops"), -1),
        (("modules", 0, "phase"), "optimizer"),
        (("findings", 0, "cause"), "vibes"),
        (("setting", "device"), "tpu"),
        (("setting", "name"), "fp32+amp"),
        (("setting", "autocast_dtype"), "float32"),
        (("tensors", "parameters", 0, "shape"), [-1]),
        (("tensors", "inputs", 0, "role"), "output"),
        (("storages", 0, "category"), "cache"),
        (("storages", 0, "nbytes"), "1 KB"),
        (("mode",), "dry-run"),
        (("schema",), "ampscope.trace/2"),
    ]),
    ("trace-run-nanochat", "trace", ["trace", "nanochat-tiny", "--seq", "8"], [
        (("ops", 0, "source"), "nanochat.py"),
        (("calls", 0, "step"), -1),
    ]),
    ("trace-generate", "trace",
     ["trace", "gpt2-tiny", "-w", "generate", "--new-tokens", "2", "--seq", "8", "--predict"], [
        (("tensors", "outputs", 0, "role"), "input"),
    ]),
    ("trace-emulated-cuda", "trace",
     ["trace", "gpt2-tiny", "-w", "forward", "-s", "cuda:fp32+amp-bf16", "--seq", "8",
      "--predict"], [
        (("setting", "emulated"), "yes"),
        (("notes", 0), None),
    ]),
    ("run-virtual-cuda", "trace",
     ["run", "--device", "cuda", "--quiet", str(EXAMPLES / "gpt" / "train.py"),
      "--block_size=16", "--batch_size=2"], [
        (("setting", "emulated"), "yes"),
        (("ops", 0, "phase"), "sideways"),
    ]),
    ("trace-diagnostics", "trace", ["trace", "gpt2-tiny", "-s", "cuda:fp32", "--seq", "8",
                                    "--predict"], [
        (("diagnostics", 0, "severity"), "fatal"),
        (("diagnostics", 0, "id"), "W701"),
        (("diagnostics", 0, "evidence"), "many"),
        (("diagnostics", 0, "fix"), DELETE),
    ]),
    ("check-trace", "check", ["check", "{tmp}/cuda-fp32.json"], [
        (("diagnostics", 0, "severity"), "info"),
        (("failed",), "no"),
        (("mode",), "dry-run"),
    ]),
    ("matrix", "matrix",
     ["matrix", "gpt2-tiny", "--settings", "fp32,fp32+amp-bf16,bf16", "--seq", "8", "--predict"], [
        (("summary", 0, "what"), "loss"),
        (("modules", 0, "cells", 0), {"in": ["float32"]}),
        (("modules", 0, "repeats"), 0),
        (("settings",), []),
    ]),
    ("matrix-predicted", "matrix",
     ["matrix", "gpt2-tiny", "-d", "cuda", "--settings", "fp32,fp32+tf32", "--seq", "8",
      "--predict", "--gpu", "a100"], [
        (("predicted", 0, "seconds"), 0),
        (("predicted", 0, "by_bound", "io"), 1.0),
        (("predicted", 1, "params"), DELETE),
    ]),
    ("report", "matrix",
     ["report", "gpt2-tiny", "--settings", "fp32,fp32+amp-bf16", "--seq", "8", "--predict",
      "-o", "{tmp}/report.html"], [
        (("modules", 0, "differs", 0), "no"),
    ]),
    ("diff-settings", "diff",
     ["diff", "fp32", "fp32+amp-bf16", "--model", "gpt2-tiny", "--seq", "8", "--predict"], [
        (("tensors", 0), {"category": "weight", "name": "w", "a": "float32", "b": None}),
        (("modules", 0, "phase"), "optimizer"),
        (("summary", "identical"), "no"),
        (("summary", "casts_b"), DELETE),
        (("casts", 0, "phase"), "sideways"),
    ]),
    ("diff-predicted", "diff",
     ["diff", "cuda:fp32", "cuda:fp32+amp-bf16", "--model", "gpt2-tiny", "--seq", "8",
      "--predict"], [
        (("timing", "a"), 0),
        (("timing", "by_bound", 0, "name"), ""),
        (("timing", "modules", 0, "b"), DELETE),
    ]),
    ("memory", "memory", ["memory", "gpt2-tiny", "--seq", "8", "--predict"], [
        (("peak", "phase"), "sideways"),
        (("at_peak", 0, "category"), "cache"),
        (("timeline",), DELETE),
        (("rounding",), "rocm"),
        (("device",), "tpu"),
    ]),
    ("memory-cuda", "memory",
     ["memory", "gpt2-tiny", "-s", "cuda:fp32+amp-bf16", "--seq", "8", "--predict"], [
        (("peak", "rounded_bytes"), 1.5),
    ]),
    ("memory-distributed", "distributed",
     ["memory", "gpt2-tiny", "--distributed", "fsdp", "--nproc", "2", "--predict", "-s", "fp32",
      "--mp-policy", "param=bf16,reduce=fp32", "--seq", "8"], [
        (("parallel", "strategy"), "zero3"),
        (("ranks", 0, "collectives", 0, "kind"), "all_sum"),
        (("ranks", 0, "held", "activations"), {"float32": 1}),
        (("ranks",), []),
    ]),
    ("trace-distributed", "distributed",
     ["trace", "gpt2-tiny", "--distributed", "ddp", "--nproc", "2", "--predict", "--seq", "8"], [
        (("parallel", "mp_policy", "reduce_dtype"), "fp32"),
    ]),
    ("flops", "flops", ["flops", "gpt2-tiny", "--seq", "8", "--predict"], [
        (("by_phase", "optimizer"), DELETE),
        (("by_phase", "sampling"), 0),
        (("modules", 0, "repeats"), 0),
        (("total",), 1.5),
    ]),
    ("flops-utilization", "flops",
     ["flops", "gpt2-tiny", "-s", "cuda:fp32+amp-bf16", "--step-time", "0.01", "--seq", "8",
      "--predict"], [
        (("utilization", "seconds"), 0),
        (("predicted", "seconds"), 0),
        (("predicted", "by_phase", "sampling"), 0.1),
        (("predicted", "params", "figures", "bandwidth", "source"), ""),
        (("predicted", "mfu"), DELETE),
    ]),
    ("numerics", "numerics", ["numerics", "gpt2-tiny", "--settings", "bf16", "--seq", "8"], [
        (("reference",), "fp16"),
        (("settings", 0, "modules", 0, "sqnr_db"), "NaN"),
        (("ranges", 0, "formats", "float16", "overflow"), 2.0),
        (("ranges", 0, "kind"), "bias"),
    ]),
    ("numerics-train", "numerics",
     ["numerics", "gpt2-tiny", "--settings", "fp32+amp-bf16", "-w", "train", "--seq", "8"], [
        (("settings", 0, "loss", "cosine"), DELETE),
    ]),
    ("formats", "formats", ["formats", "1e-8", "65504", "nan", "-inf"], [
        (("values", 0, "stored", 0, "status"), "meh"),
        (("values", 0, "stored", 0, "bits"), "0 12"),
        (("formats", 0, "overflow"), "wrap"),
        (("formats", 0, "name"), "float128"),
    ]),
    ("policy", "policy", ["policy"], [
        (("ops", 0, "category"), "sometimes"),
        (("quiz",), {}),
        (("ops", 0, "category"), DELETE),
    ]),
    ("policy-compare", "policy", ["policy", "--compare", "cpu", "cuda"], [
        (("ops", 0, "category"), "lower"),
        (("devices",), ["cpu"]),
    ]),
    ("policy-history", "policy", ["policy", "--device", "cuda", "--history"], [
        (("history", 0, "source"), "a release note"),
        (("history", 0, "in_this_build"), DELETE),
        (("torch",), DELETE),
    ]),
    ("policy-quiz", "policy", ["policy", "--quiz"], [
        (("quiz", "tpu"), {}),
        (("dtype",), "float32"),
    ]),
    ("models", "models", ["models"], [
        (("models", 0, "parameters"), -1),
        (("models",), []),
    ]),
    ("train", "train",
     ["train", "--model", "gpt2-tiny", "--device", "cpu", "--steps", "2", "--batch", "2", "--seq",
      "16", "--tokenizer", "byte", "--eval-every", "1", "--sample-tokens", "2"], [
        (("memory_kind",), "VRAM"),
        (("config", "decay"), "step"),
        (("steps", 0, "step"), 0),
        (("config", "seed"), DELETE),
    ]),
    ("fit", "fit", ["fit", "gpt2-tiny", "--memory", "12MiB", "-s", "cuda:fp32+amp-bf16", "--seq",
                    "32"], [
        (("batch",), 0),
        (("probes",), []),
        (("probes", 0, "fits"), "yes"),
        (("at_limit", 0, "category"), "cache"),
        (("at_limit", 0, "fraction"), 1.5),
        (("variants", 0, "name"), "magic"),
        (("peak_phase",), "sideways"),
        (("optimizer",), "lion"),
    ]),
    ("plans", "plans", ["fit", "gpt2-tiny", "--gpus", "2", "--memory", "64MiB", "-s", "bf16",
                        "--seq", "32"], [
        (("plans",), []),
        (("plans", 0, "batch"), -1),
        (("plans", 0, "phase"), "sideways"),
        (("mp_policy",), {}),
        (("gpus",), 0),
    ]),
    ("bench", "bench",
     ["bench", "--model", "gpt2-tiny", "--device", "cpu", "--ladder", "fp32,fp32+tf32,bf16",
      "--steps", "1", "--warmup", "0", "--batch", "2", "--seq", "16"], [
        (("rungs", 0, "status"), "skipped"),
        (("rungs", 0, "attention"), "sdpa"),
        (("device",), "tpu"),
    ]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_command_output_validates_and_broken_copies_fail(case, capsys, tmp_path):
    id_, name, argv, breaks = case
    if id_ in _PREPARED:  # a command that reads a file another command writes
        assert main([a.replace("{tmp}", str(tmp_path)) for a in _PREPARED[id_]]) == 0
        capsys.readouterr()
    document = _run(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    schema = schemas.load(name)
    assert document["schema"] == schema["$id"] == f"ampscope.{name}/1"
    assert schemas.load(document["schema"]) == schema
    assert _errors(document, schema) == []
    assert _errors(document, _exact(schema)) == [], "the schema and the output disagree on fields"
    small = _trimmed(document)
    assert _errors(small, schema) == []
    for path, value in breaks:
        assert _errors(_changed(small, path, value), schema), f"{path} = {value!r} passed"
    added = _changed(small, ("a_field_added_later",), {"any": "thing"})
    assert _errors(added, schema) == [], "fields may be added: the schema must allow them"


def test_diff_of_trace_files_validates(capsys, tmp_path):
    paths = []
    for setting in ("fp32", "fp32+amp-bf16"):
        path = tmp_path / f"{setting}.json"
        assert main(["trace", "gpt2-tiny", "-s", setting, "--seq", "8", "--predict",
                     "--json", str(path)]) == 0
        assert _errors(json.loads(path.read_text()), schemas.load("trace")) == []
        paths.append(str(path))
    capsys.readouterr()
    document = _run(capsys, ["diff", *paths])
    assert _errors(document, _exact(schemas.load("diff"))) == []
    assert document["summary"]["identical"] is False


@pytest.mark.fast
def test_trace_setting_of_capture_is_as_run():
    """ampscope.capture (and ampscope run) observes its setting: any device, emulated or not,
    no canonical name, and the matmul precision as set (the CLI's settings allow less)."""
    schema = schemas.load("trace")
    observed = {"name": "as-run", "device": "meta", "emulated": False, "param_dtype": None,
                "autocast_dtype": "float16", "matmul_precision": "medium"}
    document = {"schema": "ampscope.trace/1",
                "model": {"name": "Net", "class": "Net", "parameters": 0},
                "setting": observed, "workload": "custom", "modules": [], "ops": [],
                "tensors": {"parameters": [], "buffers": [], "optimizer_state": [], "inputs": []},
                "findings": []}
    assert _errors(document, schema) == []  # the core fields alone are a document
    assert _errors(_changed(document, ("setting", "emulated"), True), schema) == []
    assert _errors(_changed(document, ("setting", "emulated"), "yes"), schema)
    assert _errors(_changed(document, ("setting", "name"), "fp32"), schema)


def test_every_schema_is_valid_and_tested():
    shipped = schemas.names()
    assert shipped == sorted({c[1] for c in CASES})
    for name in shipped:
        schema = schemas.load(name)
        Draft202012Validator.check_schema(schema)
        assert schema["$id"] == f"ampscope.{name}/1"
        assert schema["properties"]["schema"] == {"const": schema["$id"]}
        assert "schema" in schema["required"]


@pytest.mark.fast
def test_shared_definitions_are_the_same_in_every_file():
    seen: dict[str, tuple[str, dict]] = {}
    for name in schemas.names():
        for key, definition in schemas.load(name).get("$defs", {}).items():
            first = seen.setdefault(key, (name, definition))
            assert definition == first[1], f"$defs/{key} differs in {name} and {first[0]}"


def test_load_refuses_an_unknown_schema():
    with pytest.raises(ValueError, match="no schema 'ampscope.trace/2'"):
        schemas.load("ampscope.trace/2")
