"""The type check: mypy over src/ampscope, as [tool.mypy] in pyproject.toml configures it
(its strictness), passes.

The mypy of this environment (the dev extra pins it) runs from the repository root. Its cache is
the repository's .mypy_cache (git-ignored), as for a `mypy` typed there: a cold run takes about
a minute, a run after it checks only what changed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MYPY = Path(sys.executable).parent / "mypy"


@pytest.mark.slow
def test_the_source_type_checks():
    assert MYPY.is_file(), (f"mypy is not installed in this environment ({MYPY} is missing); "
                            "install the dev extra: pip install -e .[dev]")
    result = subprocess.run([str(MYPY), "--config-file", "pyproject.toml",
                             "--cache-dir", ".mypy_cache"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "Success" in result.stdout, output[-6000:]
