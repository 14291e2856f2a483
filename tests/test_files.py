"""Output files are written whole or not at all, and unwritable paths are refused before a run."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import safetensors.torch
import torch
from torch import nn

from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.files import unwritable, write_atomic
from ampscope.train import checkpoint

pytestmark = pytest.mark.fast


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


# --- train checkpoints: --out and --resume ------------------------------------------------


def tiny_checkpoint(path):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return checkpoint.save(path, model=model, optimizer=optimizer, scaler=None, step=1,
                           loader={"position": 0, "epoch": 0}, config={}, history={})


def test_an_out_folder_that_cannot_be_made_is_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, why in ((afile, "it is a file, not a folder"),
                     (afile / "sub", f"{afile} is a file, not a folder")):
        assert main(["train", "--steps", "1", "--out", str(out)]) == 2
        stdout, err = capsys.readouterr()
        assert stdout == "" and len(err.strip().splitlines()) == 1
        assert f"cannot write into --out {str(out)!r}: {why}; give another folder" in err


def test_a_failed_checkpoint_write_is_one_sentence_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "step-000001"
    tiny_checkpoint(path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(AmpscopeError, match=f"cannot write the checkpoint {path}: No space left "
                                            "on device; free some space or give another --out"):
        tiny_checkpoint(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # no .tmp left


@pytest.mark.parametrize("damage", ["header", "missing"])
def test_a_damaged_checkpoint_is_one_line_on_resume(tmp_path, capsys, damage):
    path = tiny_checkpoint(tmp_path / "step-000001")
    if damage == "header":
        (path / "trainer.safetensors").write_bytes(b"\xff" * 8 + b"junk")
    else:
        (path / "model.safetensors").unlink()
        model = nn.Linear(2, 2)
        with pytest.raises(AmpscopeError) as raised:
            checkpoint.restore(checkpoint.read(path), model=model,
                               optimizer=torch.optim.AdamW(model.parameters()), scaler=None)
        assert str(raised.value).startswith(f"cannot read the checkpoint {path} (")
        return
    assert main(["train", "--resume", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert (f"cannot read the checkpoint {path} (Error while deserializing header" in err
            and "resume from another step-NNNNNN folder" in err), err


# --- targets that are not regular files: followed or written in place, never replaced ------


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


def test_a_link_to_a_link_writes_the_last_target(tmp_path):
    target = tmp_path / "real.json"
    (tmp_path / "a").symlink_to(target)  # dangling until written, as `echo > a` creates it
    (tmp_path / "b").symlink_to(tmp_path / "a")
    write_atomic(tmp_path / "b", "new")
    assert target.read_text() == "new" and (tmp_path / "b").is_symlink()


def test_a_fifo_is_written_in_place_for_its_reader(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(fifo, '{"a": 1}\n')
    reader.join(timeout=10)
    assert got == [b'{"a": 1}\n']
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert unwritable(fifo) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_character_device_is_written_in_place_not_replaced(tmp_path):
    null = tmp_path / "null"
    real = os.stat(os.devnull)
    os.mknod(null, stat.S_IFCHR | 0o666, real.st_rdev)  # a copy of /dev/null
    write_atomic(null, "discarded")
    assert stat.S_ISCHR(os.stat(null).st_mode) and os.stat(null).st_rdev == real.st_rdev
    assert [p.name for p in tmp_path.iterdir()] == ["null"]  # no temporary file left


def test_dev_null_is_writable_though_its_folder_is_not_ours(monkeypatch):
    # /dev is not writable to a user; writing to /dev/null is what they asked.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: (str(p) != "/dev" and
                                                         real_access(p, mode)))
    assert unwritable(os.devnull) is None


def test_json_to_dev_stdout_reaches_the_pipe_and_the_link_stays():
    result = subprocess.run([sys.executable, "-m", "ampscope", "models", "--json", "/dev/stdout"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.lstrip().startswith(("{", "["))
    assert os.path.islink("/dev/stdout") and stat.S_ISCHR(os.stat(os.devnull).st_mode)
