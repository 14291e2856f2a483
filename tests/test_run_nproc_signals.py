"""`ampscope run --nproc N` ended from outside, or by a rank: nothing it started is left.

Each rank of the script below starts a helper process of its own (as a script starts a data
server, or DataLoader starts workers) and writes its pid and the helper's to files; then it
sleeps, raises, or hangs. ampscope is run as the console script runs it, in a process of its
own, and sent SIGTERM or SIGHUP as a scheduler or a closed terminal sends them. That no process
survives is asked of the operating system (psutil) with the pids the processes wrote
themselves; the temporary folder is looked for under the TMPDIR given to ampscope.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch.distributed as dist

    rank = os.environ["RANK"]
    here = Path(__file__).parent
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (here / f"helper{rank}").write_text(str(helper.pid))
    (here / f"rank{rank}").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    how = sys.argv[1]
    if how == "raise" and rank == "1":
        raise RuntimeError("rank 1 gave up")
    time.sleep(120)
""")


def _as_from_a_terminal() -> None:
    """In the child before it runs ampscope: SIGINT at its default action and not blocked, as
    a shell starts a foreground command. A process inherits both across exec, and a process
    started with SIGINT ignored never gets Python's KeyboardInterrupt: without this, the test
    would depend on what earlier tests in the same worker left behind."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start(tmp_path: Path, how: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    # Output to files, not pipes: a process left behind would hold a pipe open.
    err = tmp_path / "stderr.txt"
    with open(tmp_path / "stdout.txt", "wb") as out, open(err, "wb") as error:
        process = subprocess.Popen(
            [sys.executable, "-m", "ampscope", "run", "--nproc", "2", *extra, str(script), how],
            env=env, stdout=out, stderr=error, cwd=tmp_path, preexec_fn=_as_from_a_terminal)
    return process, err


def _pids(tmp_path: Path, timeout: float = 60.0) -> list[int]:
    """The pids of both ranks and their helpers, once all four are written."""
    names = ["rank0", "rank1", "helper0", "helper1"]
    until = time.monotonic() + timeout
    while not all((tmp_path / n).exists() and (tmp_path / n).read_text() for n in names):
        assert time.monotonic() < until, "the ranks did not start"
        time.sleep(0.05)
    return [int((tmp_path / n).read_text()) for n in names]


def _alive(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still running (a zombie not yet reaped is not), after up to `timeout` s for a
    killed process to go."""
    until = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > until:
            return alive
        time.sleep(0.05)


def _end(pids: list[int]) -> None:
    for pid in pids:  # only what this test's run started, should a test fail
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _running(tmp_path: Path, how: str, *extra: str):
    """ampscope started on the script, once both ranks and their helpers have written their
    pids: (the process, its stderr file, those pids). Whatever is still running after the
    test is killed, so that a failed test leaves nothing either."""
    process, err = _start(tmp_path, how, *extra)
    pids: list[int] = []
    try:
        pids = _pids(tmp_path)
        yield process, err, pids
    finally:
        if process.poll() is None:
            process.kill()
        _end(pids)


def _exit_code(process: subprocess.Popen, err: Path, pids: list[int], timeout: float) -> int:
    """ampscope's exit status; if it has not ended within `timeout` s, a failure that says
    what it wrote and how it and the processes of the run stood (their state and, for
    ampscope, whether SIGINT was ignored or blocked), for a hang that is hard to reproduce."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        states = []
        for pid in [process.pid, *pids]:
            try:
                proc = psutil.Process(pid)
                states.append(f"{pid} {proc.name()} {proc.status()}")
            except psutil.NoSuchProcess:
                states.append(f"{pid} gone")
        masks = [line.strip() for line in Path(f"/proc/{process.pid}/status").read_text()
                 .splitlines() if line.startswith(("SigBlk", "SigIgn"))]
        raise AssertionError(f"ampscope did not end within {timeout} s; processes: "
                             f"{states}; ampscope's {masks}; its stderr: {err.read_text()!r}") from None


def _nothing_left(tmp_path: Path, pids: list[int]) -> None:
    assert _alive(pids) == []
    assert list((tmp_path / "tmp").iterdir()) == []  # no ampscope-ranks-* folder left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_ends_every_rank_and_what_they_started(tmp_path, sig):
    with _running(tmp_path, "sleep") as (process, err, pids):
        time.sleep(0.5)  # in the sleep, past the group's start-up
        process.send_signal(sig)
        code = _exit_code(process, err, pids, 30)
        assert code == 128 + sig, err.read_text()
        assert err.read_text().strip().splitlines() == [
            f"ampscope: received {sig.name}: ended the 2 ranks and the processes they started"]
        _nothing_left(tmp_path, pids)


def test_ctrl_c_reaches_the_ranks_in_their_own_groups(tmp_path):
    # The ranks' sessions are their own: a terminal's Ctrl-C reaches ampscope alone, which
    # passes it on, and exits as it always did on Ctrl-C.
    with _running(tmp_path, "sleep") as (process, err, pids):
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        code = _exit_code(process, err, pids, 30)
        assert code == 130, err.read_text()
        assert err.read_text().strip().splitlines()[-1] == "ampscope: interrupted"
        _nothing_left(tmp_path, pids)


def test_a_failed_rank_ends_what_every_rank_started(tmp_path):
    with _running(tmp_path, "raise") as (process, err, pids):
        code = _exit_code(process, err, pids, 60)
        lines = err.read_text().strip().splitlines()
        assert code == 2
        assert lines[-1].startswith("ampscope: error: rank 1 of 2 failed: ") and \
            "rank 1 gave up" in lines[-1], lines
        _nothing_left(tmp_path, pids)


def test_the_deadline_ends_what_every_rank_started(tmp_path):
    # Long enough for both ranks to start on a busy 2-core machine, and write their pids.
    with _running(tmp_path, "sleep", "--timeout", "15") as (process, err, pids):
        code = _exit_code(process, err, pids, 60)
        assert code == 2
        assert "did not finish in 15 s" in err.read_text()
        _nothing_left(tmp_path, pids)
