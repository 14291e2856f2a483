"""The quick subset (`make test-fast`: the tests marked `fast`) keeps a test of every layer.

The subset is collected in a fresh process as `make test-fast` selects it (`-m fast`); each
layer below must keep at least one selected test among its entries, so that unmarking, renaming
or deleting tests cannot silently leave a layer out. An entry is a test file, or a file and the
start of a test's name where a file tests more than one layer. The layers are the packages of
the import-linter contract in pyproject.toml (docs/architecture.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: dict[str, tuple[str, ...]] = {
    "records": ("test_tables.py", "test_capture.py::test_records_", "test_flow.py"),
    "precision": ("test_settings.py", "test_policy.py"),
    "runtime": ("test_virtual_device.py", "test_attention.py", "test_emulation.py",
                "test_predict.py"),
    "models": ("test_models_registry.py", "test_models_reference.py", "test_hf_folders.py"),
    "runs": ("test_capture.py", "test_capture_edges.py", "test_optimizer_step_call.py",
                  "test_modes.py", "test_progress.py", "test_repeats.py"),
    "workloads": ("test_settings.py", "test_inputs.py", "test_sampling_fidelity.py"),
    "analysis": ("test_flow.py", "test_causes.py", "test_diff.py", "test_diagnosis.py",
                 "test_formats.py", "test_diagram.py"),
    "train": ("test_train.py",),
    "distributed": ("test_distributed.py",),
    "render": ("test_render.py", "test_report.py", "test_perfetto.py"),
    "api": ("test_flops.py", "test_memory.py", "test_matrix.py", "test_fit.py",
            "test_watch.py::test_watch_"),
    "script": ("test_run_script.py", "test_script_guest.py",
               "test_state.py::test_state_is_unchanged_when_a_script_fails"),
    "cli": ("test_cli.py", "test_cli_surface.py", "test_bad_input.py"),
    "integrations": ("test_watch.py::test_hf_callback", "test_watch.py::test_lightning_callback",
                     "test_watch.py::test_the_frameworks_are_imported_only_by_their_callbacks"),
    "torchcompat": ("test_torch_private.py",
                    "test_virtual_device.py::test_the_private_details_it_uses_are_found"),
    "tricks": ("test_tricks.py", "test_fake_cache.py", "test_shortcuts.py", "test_foreach.py"),
    "hardware": ("test_hardware.py",),
    "files": ("test_files.py",),
    "schemas": ("test_json_schema.py",),
}


def _selected(files: list[str]) -> set[str]:
    """The node ids (`test_x.py::test_name[param]`) that `-m fast` selects from these files."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fast",
         "-p", "no:cacheprovider", *(f"tests/{f}" for f in files)],
        cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return {line.removeprefix("tests/") for line in result.stdout.splitlines() if "::" in line}


def test_every_layer_listed_is_a_package_of_the_layer_contract():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    names = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    assert set(LAYERS) <= names, set(LAYERS) - names
    # every layer of the chain docs/architecture.md draws is listed
    assert set(LAYERS) >= {"records", "runtime", "precision", "models", "runs", "workloads",
                           "analysis", "train", "distributed", "render", "api", "script",
                           "cli", "integrations", "torchcompat"}


def test_the_fast_subset_has_a_test_of_every_layer():
    files = sorted({entry.partition("::")[0] for entries in LAYERS.values() for entry in entries})
    selected = _selected(files)
    missing = {layer: entries for layer, entries in LAYERS.items()
               if not any(node.startswith(entry if "::" in entry else entry + "::")
                          for node in selected for entry in entries)}
    assert not missing, ("layers without a test marked `fast` (@pytest.mark.fast) in these "
                         f"files: {missing}")
