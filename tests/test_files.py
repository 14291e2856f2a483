"""Output files are written whole or not at all, and unwritable paths are refused before a run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ampscope.cli import main
from ampscope.files import unwritable, write_atomic


def test_a_failed_write_leaves_the_old_file_as_it_was(tmp_path):
    """A file-size limit stops the write half-way (as a full disk would): the old file stays."""
    target = tmp_path / "trace.json"
    target.write_text("old contents\n")
    script = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        from ampscope.files import write_atomic
        try:
            write_atomic({str(target)!r}, "x" * 100_000)
        except OSError as e:
            print("refused", e.errno)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("refused")
    assert target.read_text() == "old contents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no temporary left


def test_a_complete_write_replaces_the_file_and_keeps_its_mode(tmp_path):
    target = tmp_path / "report.html"
    target.write_text("old")
    os.chmod(target, 0o640)
    write_atomic(target, "<p>new</p>")
    assert target.read_text() == "<p>new</p>" and (target.stat().st_mode & 0o777) == 0o640


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_folder_is_unwritable(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert unwritable(folder / "x.json") == f"the folder {folder} is not writable"
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("argv, why", [
    (["trace", "gpt2-tiny", "--seq", "4", "--json", "/no/such/folder/t.json"], "no folder"),
    (["trace", "gpt2-tiny", "--seq", "4", "--json", ""], "no path given"),
    (["memory", "gpt2-tiny", "--seq", "4", "--json", "{tmp}"], "it is a folder"),
    (["report", "gpt2-tiny", "--seq", "4", "-o", "/no/such/folder/r.html"], "no folder"),
])
def test_unwritable_outputs_are_refused_before_the_run(capsys, tmp_path, argv, why):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and why in err and len(err.strip().splitlines()) == 1
    assert "Tracing" not in err  # refused before anything ran
