"""Private PyTorch details live in ampscope.torchcompat only: read from the source (AST).

"Private" is any module path component or attribute under `torch` that starts with `_`: an
import from such a module, an attribute chain from a name bound to torch (`torch._C._x`,
`torch.ops.aten._to_copy`, `aten._to_copy` with `aten = torch.ops.aten`), or an
underscored attribute read from any object (`mode._cache_key`, `getattr(t, "_x")`) that is
neither ampscope's own nor on the short allowlist of the layer's docstring.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import torch

import ampscope

pytestmark = pytest.mark.fast

SRC = Path(ampscope.__file__).parent
LAYER = SRC / "torchcompat"
# torchcompat/__init__.py gives the reason for each: the standard library's and other
# libraries' privates (not torch's).
ALLOWED_ATTRIBUTES = frozenset({
    "_getframe", "_exit",  # sys, os
    "_attn_implementation",  # transformers' model config
    "_PATCHED",  # torchao's inductor patch flag
})


def _sources(outside_layer: bool) -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py"))
            if (LAYER not in p.parents) == outside_layer]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names() -> set[str]:
    """Names ampscope defines itself: functions, classes, module names, `self.x` attributes,
    `__slots__` entries (outside the layer)."""
    own: set[str] = set()
    for path in _sources(outside_layer=True):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
                own.update(c.value for c in ast.walk(node.value)
                           if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return own


def private_uses(source: str, own: set[str]) -> list[tuple[int, str]]:
    """Each private torch use in `source`: (line, what)."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    op_namespaces: set[str] = set()  # `aten = torch.ops.aten`: its attributes are torch's too
    found: list[tuple[int, str]] = []
    known = own | ALLOWED_ATTRIBUTES
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(map(_private, parts)):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "torch":
            private_module = any(map(_private, node.module.split(".")))
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if private_module or _private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Assign) and _is_op_namespace(node.value):
            op_namespaces.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            from_torch = isinstance(root, ast.Name) and root.id in torch_names | op_namespaces
            if from_torch or node.attr not in known:
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)
              and node.args[1].value not in known):
            found.append((node.lineno, ast.unparse(node)))
    found += _private_names_in_strings(tree)
    return sorted(found)


# A private torch module path written out ("torch.utils._pytree", a logger's name).
_PRIVATE_PATH = re.compile(r"\btorch(\.[A-Za-z0-9_]+)*\._[A-Za-z]")


@functools.cache
def _private_aten_names() -> tuple[str, ...]:
    """Every registered ATen op whose name starts with an underscore ("_to_copy")."""
    return tuple(sorted({n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
                         if n.startswith("aten::_")}))


def _names_private_op(text: str) -> bool:
    """Whether a string names an underscored ATen op, or begins the name of one
    ("aten._to_copy.default", "aten::_fused_rms_norm", "_scaled_dot_product_", "_foreach_")."""
    name = text.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    return len(name) >= 5 and name.startswith("_") and \
        any(op.startswith(name) for op in _private_aten_names())


def _private_names_in_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """String literals (not docstrings) that name a private torch module or ATen op: a detail
    reached by name is reached all the same."""
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docstrings and \
                (_PRIVATE_PATH.search(node.value) or _names_private_op(node.value)):
            found.append((node.lineno, repr(node.value)))
    return found


def _root(node: ast.Attribute) -> ast.expr:
    """What an attribute chain starts from (`torch` in `torch._C._x`)."""
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        current = current.value
    return current


def _is_op_namespace(value: ast.expr) -> bool:
    return (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Attribute)
            and value.value.attr == "ops" and isinstance(value.value.value, ast.Name)
            and value.value.value.id == "torch")


def test_no_private_torch_outside_the_layer():
    own = _own_names()
    uses = [f"{path.relative_to(SRC)}:{line}: {what}"
            for path in _sources(outside_layer=True)
            for line, what in private_uses(path.read_text(), own)]
    assert uses == [], f"{len(uses)} private torch uses outside ampscope/torchcompat:\n" + \
        "\n".join(uses)


def test_the_check_finds_each_kind_of_use():
    source = '''
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import _push_mode
aten = torch.ops.aten
torch._C._get_dispatch_mode(0)
mode._cache_key(1)
getattr(mode, "_output_from_cache_entry")
aten._to_copy.default
torch.ops.aten._unsafe_view.default
self._mine
module._parameters
op._schema
logging.getLogger("torch._subclasses.fake_tensor")
registry["aten::_fused_rms_norm"] = kernel
name.startswith("_foreach_")
"""A docstring may name torch._C."""
'''
    found = [what for _, what in private_uses(source, own={"_mine"})]
    assert found == [
        "import torch._dynamo",
        "from torch._subclasses.fake_tensor import FakeTensor",
        "from torch.overrides import _push_mode",
        "torch._C",
        "torch._C._get_dispatch_mode",
        "mode._cache_key",
        "getattr(mode, '_output_from_cache_entry')",
        "aten._to_copy",
        "torch.ops.aten._unsafe_view",
        "module._parameters",
        "op._schema",
        "'torch._subclasses.fake_tensor'",
        "'aten::_fused_rms_norm'",
        "'_foreach_'",
    ]


def test_the_layer_imports_nothing_of_ampscope_above_it():
    for path in _sources(outside_layer=False):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("ampscope"):
                assert node.module.startswith("ampscope.torchcompat"), (path, node.module)
