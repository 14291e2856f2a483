"""The layering of docs/architecture.md, checked: import-linter's layer contract (pyproject.toml)
and no import cycle between ampscope's modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).parent.parent


def test_layer_contract_is_kept():
    # lint-imports reads [tool.importlinter] from pyproject.toml in the working directory.
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_no_import_cycles():
    graph = grimp.build_graph("ampscope", cache_dir=None)
    # A package's __init__ re-exporting its own modules is not a cycle between layers: look at
    # modules only, imports of a package by its own members excluded.
    cycles = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if module.startswith(imported + ".") or imported.startswith(module + "."):
                continue
            if graph.chain_exists(importer=imported, imported=module):
                chain = graph.find_shortest_chain(importer=imported, imported=module)
                cycles.add(" -> ".join((module, *chain)))
    assert not cycles, "\n".join(sorted(cycles))
