"""tools/compat.py's comparison logic, on small documents: the normaliser, the list-aware diff,
release ranges and the allowlist. The harness itself (fresh environments, one per torch build)
runs by hand (`make compat-matrix`) and in CI (`make compat-ci`); see docs/compatibility.md."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("ampscope_compat_tool",
                                                  ROOT / "tools" / "compat.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


compat = _load()


def paths(differences):
    return [d.path for d in differences]


# --- normalising


@pytest.mark.fast
def test_normalise_drops_volatile_keys_at_any_depth_and_keeps_the_answer():
    doc = {"setting": {"name": "bf16", "torch": "2.13.0+cpu"},
           "settings": [{"name": "fp32", "torch": "2.9.1+cu128", "elapsed_seconds": 1.5}],
           "peak": {"bytes": 1024, "wall_s": 0.25}, "created": 3}
    assert compat.normalise(doc) == {"setting": {"name": "bf16"},
                                     "settings": [{"name": "fp32"}],
                                     "peak": {"bytes": 1024}, "created": 3}


def test_normalise_replaces_versions_and_absolute_folders_in_strings():
    note = ("autocast followed the cuda policy read from this PyTorch build (2.15.0+cu132); "
            "PyTorch 2.15 picks on an H100 (sm90, CUDA 13.2, cuDNN 9.26.0.51); "
            "loaded /tmp/tmp-compat-2.9.1-x/venv/lib/model.py, see docs/how-it-works.md")
    assert compat.normalise(note, "2.15.0+cu132") == (
        "autocast followed the cuda policy read from this PyTorch build (<version>); "
        "PyTorch <version> picks on an H100 (sm90, CUDA <version>, cuDNN <version>); "
        "loaded <dir>/model.py, see docs/how-it-works.md")
    # numbers that are not versions stay: sizes, counts, ratios, source lines
    assert compat.normalise("8,030,261,248 params × 2 B; 9.0; gpt2.py:124") == (
        "8,030,261,248 params × 2 B; 9.0; gpt2.py:124")


def test_normalise_rounds_floats_and_leaves_ints_and_infinities():
    got = compat.normalise({"cosine": 0.9999999999999893, "sqnr": 136.51865918172305,
                            "bytes": 80302614424, "ratio": float("inf"), "flag": True})
    assert got == {"cosine": 1.0, "sqnr": 136.519, "bytes": 80302614424,
                   "ratio": float("inf"), "flag": True}
    assert json.dumps(got["sqnr"]) == "136.519"


def test_normalise_output_for_a_command_without_json():
    text = "traced in 1.25 s   \nPyTorch 2.13.0+cpu, 3 ops\n"
    assert compat.normalise_output(text, "2.13.0+cpu") == ["traced in <time>",
                                                           "PyTorch <version>, 3 ops"]


# --- comparing


def test_compare_equal_documents_and_float_tolerance():
    doc = {"a": [1, 2.0, {"b": "x"}], "c": None}
    assert compat.compare(doc, json.loads(json.dumps(doc))) == []
    assert compat.compare({"v": 1.0}, {"v": 1.0 + 1e-6}) == []  # within REL_TOL
    assert paths(compat.compare({"v": 1.0}, {"v": 1.01})) == ["/v"]
    assert paths(compat.compare({"n": 3}, {"n": 4})) == ["/n"]  # ints compare exactly
    assert paths(compat.compare({"b": True}, {"b": 1})) == ["/b"]
    assert compat.compare({"x": float("nan")}, {"x": float("nan")}) == []


def test_numerics_at_float32_rounding_are_noise_and_larger_errors_are_not():
    """fp32 against its float64 reference differs by the CPU's kernels (measured: rel_l2
    3.41e-07 on one machine, 2.59e-07 on another); a bf16 run's error is an answer."""
    golden = {"rel_l2": 3.40757e-07, "max_abs": 2.95996e-08, "sqnr_db": 129.351, "cosine": 1.0}
    actual = {"rel_l2": 2.58615e-07, "max_abs": 1.17836e-08, "sqnr_db": 131.747, "cosine": 1.0}
    assert compat.compare(golden, actual) == []
    bf16 = {"rel_l2": 3.1e-03, "max_abs": 2.0e-02, "sqnr_db": 50.2}
    assert paths(compat.compare(bf16, {**bf16, "rel_l2": 4.0e-03})) == ["/rel_l2"]
    # one side at rounding, the other not: a real change
    assert paths(compat.compare(golden, {**golden, "rel_l2": 2e-3})) == ["/rel_l2"]


def test_compare_reports_missing_added_and_changed_with_labelled_paths():
    golden = {"ops": [{"op": "aten.mm", "out": ["bfloat16"]}], "gone": 1}
    actual = {"ops": [{"op": "aten.mm", "out": ["float32"]}], "new": 2}
    diffs = compat.compare(golden, actual, "03-trace")
    assert [(d.path, d.kind) for d in diffs] == [
        ("03-trace/ops/0:aten.mm/out/0", "changed"),
        ("03-trace/gone", "missing"),
        ("03-trace/new", "added")]
    assert str(diffs[0]) == '03-trace/ops/0:aten.mm/out/0: "bfloat16" -> "float32"'


@pytest.mark.fast
def test_compare_aligns_lists_so_one_inserted_op_is_one_difference():
    golden = [{"op": f"aten.op{i}", "out": ["float32"]} for i in range(50)]
    actual = golden[:10] + [{"op": "aten._unsafe_view", "out": ["float32"]}] + golden[10:]
    diffs = compat.compare(golden, actual, "t")
    assert [(d.path, d.kind) for d in diffs] == [("t/10:aten._unsafe_view", "added")]
    removed = compat.compare(golden, golden[:20] + golden[21:], "t")
    assert [(d.path, d.kind) for d in removed] == [("t/20:aten.op20", "missing")]


def test_element_labels():
    assert compat.element_label(3, {"name": "fp32", "op": "aten.add"}) == "3:aten.add"
    assert compat.element_label(4, {"category": "parameter"}) == "4:parameter"
    assert compat.element_label(5, [1, 2]) == "5"
    assert compat.element_label(6, {"text": "x" * 100}) == "6:" + "x" * 60


# --- release ranges and the allowlist


@pytest.mark.parametrize(("version", "spec", "inside"), [
    ("2.9.1+cu128", ">=2.9,<2.12", True),
    ("2.11.0", ">=2.9,<2.12", True),
    ("2.12.1", ">=2.9,<2.12", False),
    ("2.12.1+cu130", "==2.12", True),
    ("2.13.0+cpu", ">=2.14", False),
    ("2.15.0", ">=2.14", True),
    ("2.15.0", "<=2.14", False),
    ("2.14.1", "<=2.14", True),
    ("2.14.1", "!=2.14.0", True),
])
def test_in_range(version, spec, inside):
    assert compat.in_range(version, spec) is inside


def test_in_range_rejects_what_it_cannot_read():
    with pytest.raises(ValueError):
        compat.in_range("2.13.0", "~=2.13")
    with pytest.raises(ValueError):
        compat.in_range("nightly", ">=2.9")


@pytest.mark.fast
def test_allowlist_allows_only_its_releases_wheels_and_paths():
    entries = [
        compat.Allowed(torch=">=2.9,<2.12", path="*/ops/*:aten*rms_norm*/category",
                       reason="rms_norm's CUDA autocast category changed in 2.12", wheel="cuda"),
        compat.Allowed(torch=">=2.15", path="09-policy/ops/*", reason="2.15's CPU policy"),
    ]
    diffs = [compat.Difference("03-trace/ops/7:aten.rms_norm.default/category", "changed",
                               "fp32", "lower"),
             compat.Difference("09-policy/ops/32:cholesky", "missing", golden={"op": "x"}),
             compat.Difference("05-memory/peak/bytes", "changed", 1, 2)]
    bad, allowed = compat.split_allowed(diffs, entries, "2.11.0+cu130", cuda=True)
    assert paths(bad) == ["09-policy/ops/32:cholesky", "05-memory/peak/bytes"]
    assert [(d.path, a.reason) for d, a in allowed] == [
        ("03-trace/ops/7:aten.rms_norm.default/category",
         "rms_norm's CUDA autocast category changed in 2.12")]
    # the same release's CPU wheel: the cuda-only entry does not apply
    bad, _ = compat.split_allowed(diffs, entries, "2.11.0", cuda=False)
    assert len(bad) == 3
    # 2.15: the policy entry applies, the 2.9-2.11 one does not
    bad, allowed = compat.split_allowed(diffs, entries, "2.15.0+cu132", cuda=True)
    assert paths(bad) == ["03-trace/ops/7:aten.rms_norm.default/category",
                          "05-memory/peak/bytes"]
    assert len(allowed) == 1


def test_allowlist_file_loads_and_every_entry_has_a_reason(tmp_path):
    for entry in compat.load_allowlist():  # the repository's own file
        assert entry.reason.strip() and entry.path.strip()
    bad = tmp_path / "allowlist.json"
    bad.write_text(json.dumps({"entries": [{"torch": ">=2.9", "path": "*"}]}))
    with pytest.raises(ValueError, match="reason"):
        compat.load_allowlist(bad)
    bad.write_text(json.dumps({"entries": [{"torch": "2.9+", "path": "*", "reason": "r"}]}))
    with pytest.raises(ValueError):
        compat.load_allowlist(bad)


def test_goldens_exist_for_every_command_and_hold_normalised_output():
    for command in compat.COMMANDS:
        golden = json.loads(compat.golden_path(command).read_text(encoding="utf-8"))
        assert golden["command"] == command.line
        assert compat.normalise(golden["output"]) == golden["output"]  # nothing volatile left


def test_json_goes_after_the_subcommand():
    run = next(c for c in compat.COMMANDS if c.argv[0] == "run")
    assert run.argv_with_json(Path("o.json"))[:3] == ["run", "--json", "o.json"]
    assert run.argv_with_json(Path("o.json"))[-2:] == ["examples/gpt/train.py",
                                                        "--batch_size=4"]


def test_dump_golden_round_trips():
    doc = {"command": "ampscope policy", "output": {"ops": [{"op": "mm", "category": "lower"}],
                                                    "n": 1.5, "empty": []}}
    text = compat.dump_golden(doc)
    assert json.loads(text) == doc
    assert '   {"op": "mm", "category": "lower"}' in text.splitlines()


def test_first_error_line():
    p = compat.Proc(1, "", "Traceback (most recent call last):\n  File x\n"
                           "AttributeError: module 'torch' has no attribute 'y'\n", 1.0)
    assert compat.first_error_line(p) == "AttributeError: module 'torch' has no attribute 'y'"
    p = compat.Proc(2, "", "warming up\nampscope: error: unknown model 'x'\nmore\n", 1.0)
    assert compat.first_error_line(p) == "ampscope: error: unknown model 'x'"


def test_sweep_removes_only_old_leftover_environments(tmp_path):
    import os
    import time

    old, new, other = (tmp_path / "tmp-compat-2.9.1-a", tmp_path / "tmp-compat-2.15.0-b",
                       tmp_path / "tmp-other")
    for d in (old, new, other):
        (d / "venv").mkdir(parents=True)
    stale = time.time() - 7 * 3600
    for d in (old, other):
        os.utime(d, (stale, stale))
    compat.sweep(tmp_path)
    assert not old.exists() and new.exists() and other.exists()
