"""The CLI's start-up (cli/startup.py): a command's heavy imports run with the garbage collector
paused, and only the console script, which owns its process, freezes them."""

from __future__ import annotations

import subprocess
import sys

from ampscope.cli import startup


def _python(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


_COUNT_COLLECTIONS = """
import argparse, gc, sys
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
from ampscope.cli import startup
collections.clear()
"""


def test_a_hugging_face_model_command_imports_torch_and_transformers_without_collecting():
    out = _python(_COUNT_COLLECTIONS + """
startup.preload(argparse.Namespace(command="memory", model="llama-3-8b"), freeze=False)
print(len(collections), gc.isenabled(), gc.get_freeze_count(),
      'torch' in sys.modules, 'transformers' in sys.modules)
""")
    assert out == ["0", "True", "0", "True", "True"]


def test_a_built_in_model_does_not_import_transformers_and_freezing_is_asked_for():
    out = _python(_COUNT_COLLECTIONS + """
startup.preload(argparse.Namespace(command="trace", model="gpt2-tiny"), freeze=True)
print(len(collections), gc.isenabled(), gc.get_freeze_count() > 100_000,
      'torch' in sys.modules, 'transformers' in sys.modules)
""")
    assert out == ["0", "True", "True", "True", "False"]


def test_a_caller_that_disabled_the_collector_finds_it_disabled():
    out = _python(_COUNT_COLLECTIONS + """
gc.disable()
startup.preload(argparse.Namespace(command="flops", model="gpt2-tiny"), freeze=False)
print(gc.isenabled())
""")
    assert out == ["False"]


def test_commands_that_need_no_torch_import_nothing():
    out = _python(_COUNT_COLLECTIONS + """
for command in ("models", "formats", "diff", None):
    startup.preload(argparse.Namespace(command=command, model="llama-3-8b"), freeze=True)
print('torch' in sys.modules, gc.get_freeze_count())
""")
    assert out == ["False", "0"]


def test_main_called_from_python_freezes_nothing():
    """Tests and notebooks call `main`: the caller's objects are not made permanent."""
    out = _python("""
import gc
from ampscope.cli import main
code = main(["flops", "gpt2-tiny", "--seq", "8"])
print(code, gc.isenabled(), gc.get_freeze_count())
""")
    assert out[-3:] == ["0", "True", "0"]


def test_a_model_the_catalog_does_not_know_imports_no_transformers():
    assert startup._needs_transformers("llama-3-8b")
    assert startup._needs_transformers("hf:./my-config")
    assert not startup._needs_transformers("gpt2")
    assert not startup._needs_transformers("mymodels:build")
