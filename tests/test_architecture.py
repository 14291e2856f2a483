"""The layering of docs/architecture.md, checked: import-linter's layer contract (pyproject.toml)
and no import cycle between ampscope's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.fast

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


# Names the recorders give one record's row, and lists of rows (records.RowLayout).
_ROW = {"r", "row", "rec", "record"}
_ROWS = {"rows", "op_log"}


def _literal_row_indexing(tree) -> list[int]:
    """Lines that read a row's field by number (`r[7]`, `rows[i][4]`) or unpack a row by
    position (`_, name, *_ = self.rows[i]`)."""

    def named(node, names: set[str]) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        return name in names

    def number(node) -> bool:
        inner = node.operand if isinstance(node, ast.UnaryOp) else node
        return isinstance(inner, ast.Constant) and isinstance(inner.value, int)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and number(node.slice) and (
                named(node.value, _ROW) or
                (isinstance(node.value, ast.Subscript) and named(node.value.value, _ROWS))):
            lines.append(node.lineno)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and \
                isinstance(node.value, ast.Subscript) and named(node.value.value, _ROWS):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_recorders_name_the_fields_of_a_row():
    """A row's fields are read and changed by name (records.OP_ROW.at("caller"), OP_ROW.replace),
    never by position: a field added to a record would silently shift every number."""

    found = []
    for path in sorted((ROOT / "src" / "ampscope" / "runs").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.name}:{line}" for line in _literal_row_indexing(tree)]
    assert not found, found


def test_the_row_check_finds_literal_indexing():
    """The check above, on the forms the recorders used before rows had named fields."""

    code = ("a = r[7]\nb = rows[i][4][0]\nrows[i] = row[:6] + (False,) + row[7:]\n"
            "c = row[2]\n_, name, module, *_ = self.rows[where]\nd = rows[-1]\n")
    assert _literal_row_indexing(ast.parse(code)) == [1, 2, 4, 5]


# Attribute changes outside ampscope.patches that are not replacements of someone else's code,
# each with its reason (file, the assigned target as written).
_NOT_PATCHES = {
    ("precision/apply.py", "p.data"): "puts the user's own tensor back into its parameter",
    ("precision/apply.py", "p.grad"): "puts the user's own gradient back",
    ("precision/apply.py", "module.training"): "puts the user's train/eval flag back",
    ("precision/fp8.py", "setattr"): "puts back what torchao's own one-time patch replaced",
    ("precision/fp8.py", "patch._PATCHED"): "puts back torchao's own flag for that patch",
    ("script/state.py", "sys.stdin"): "puts back the caller's streams after a script",
    ("script/state.py", "sys.stdout"): "puts back the caller's streams after a script",
    ("script/state.py", "sys.stderr"): "puts back the caller's streams after a script",
    ("script/state.py", "sys.excepthook"): "puts back the caller's hook after a script",
    ("models/registry.py", "setattr"): "ties a parameter while the model is built",
    ("script/state.py", "setattr"): "puts back a torch setting a script changed",
    ("render/notebook.py", "cls._repr_html_"): "gives ampscope's own records their notebook view",
    ("integrations/hf.py", "setattr"): "marks a Trainer whose own train() is guarded for life",
    ("integrations/hf.py", "trainer.train"): "that Trainer's own train(), guarded for its life",
}


def _attribute_changes(tree) -> list[tuple[int, str]]:
    """Assignments to an attribute of something other than `self`, and `setattr` calls."""

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and not (
                        isinstance(t.value, ast.Name) and t.value.id in ("self", "cls_self")):
                    found.append((t.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and \
                not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            found.append((node.lineno, "setattr"))
    return found


def test_every_replacement_of_others_code_goes_through_the_patch_registry():
    """torch's functions, nn.Module's methods, the standard library's: replaced only through
    ampscope.patches (undone as made, listed while in force, checked by the state tests). An
    attribute of one of ampscope's own objects (not `self`) is allowed when the name says so:
    a record being filled, a call's outputs."""

    src = ROOT / "src" / "ampscope"
    external = ("torch", "nn", "builtins", "io", "os", "atexit", "sys", "F", "module", "block",
                "b", "owner", "cls", "trainer", "overrides", "patch")
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = str(path.relative_to(src))
        if rel in ("patches.py",) or rel.startswith("torchcompat/"):
            continue
        for line, target in _attribute_changes(ast.parse(path.read_text(encoding="utf-8"))):
            root = target.split(".")[0]
            if target != "setattr" and root not in external:
                continue
            if (rel, target) not in _NOT_PATCHES:
                found.append(f"{rel}:{line} {target}")
    assert not found, found


def test_modules_and_functions_stay_small():
    """A module a reader can hold in mind (at most 500 lines) and functions that fit a screen
    or two (at most 80 lines): split by what the parts do when one grows past it."""

    long_files, long_functions = [], []
    for path in sorted((ROOT / "src" / "ampscope").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT / "src")
        if text.count("\n") > 500:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long_files and not long_functions, long_files + long_functions


def test_every_package_docstring_names_its_files():
    """A package's docstring is its table of contents: every module in it is named there
    (`name.py`), so a reader finds where each thing lives without opening them all."""

    missing = []
    for init in sorted((ROOT / "src" / "ampscope").rglob("__init__.py")):
        package = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        for module in sorted(package.glob("*.py")):
            if module.name != "__init__.py" and module.name not in doc:
                missing.append(f"{package.relative_to(ROOT / 'src')}: {module.name}")
    assert not missing, missing


def test_modules_that_share_a_file_name_name_each_other():
    """Two modules may share a file name only as one concern at different layers (the FLOP
    recorder, report and view: runs/flops.py, analysis/flops.py, render/flops.py), and each
    docstring says where its namesakes are; any other clash is a name to change."""
    package = ROOT / "src" / "ampscope"
    by_name: dict[str, list[Path]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path)
    unnamed = []
    for paths in by_name.values():
        for path in paths if len(paths) > 1 else []:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            for other in paths:
                rel = other.relative_to(package).as_posix()
                if other != path and f"`{rel}`" not in doc:
                    unnamed.append(f"{path.relative_to(package).as_posix()} does not name {rel}")
    assert not unnamed, unnamed
