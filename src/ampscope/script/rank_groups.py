"""The ranks of `run --nproc N` (script/ranks.py, script/predicted_ranks.py), each in a process
group of its own, ended with everything they started, as torchrun ends its workers.

- **One session per rank.** Each rank is started in a new session (`start_new_session`), so
  its process group holds the rank and whatever it starts: a helper subprocess, DataLoader
  workers, a shell command. Ending the group ends them all, also those left behind by a rank
  that already exited (a group outlives its leader while any member lives, and its id is not
  reused meanwhile). A terminal's Ctrl-C no longer reaches the ranks directly: ampscope
  receives it and passes it on (`end_groups`).
- **SIGTERM and SIGHUP.** Sent to ampscope during the job (a scheduler's cancel, a closed
  terminal), they are handled as torchrun handles them (docs/cli.md, "Exit codes": 143 and
  129). Without this, the signal's default action ended ampscope at once, with no word, leaving
  every rank running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

# What ends a job from outside. SIGINT is Python's KeyboardInterrupt, handled as it unwinds.
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                       if hasattr(signal, name))
GRACE = 3.0  # seconds a rank's group has to end on the signal passed on, before it is killed


class Terminated(SystemExit):
    """ampscope was sent SIGTERM or SIGHUP during a multi-rank run. A SystemExit, with the
    status a shell expects of a process ended by that signal (128 + its number), so that it
    passes every `except Exception:` on its way out and the process exits with that status."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)


class Signals:
    """While active: SIGTERM and SIGHUP raise `Terminated` in the main thread, once; a signal
    received while the job is being ended (`raising` off) is kept and raised afterwards."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raising = True

    def _handler(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if self.raising:
            self.raising = False
            raise Terminated(signum)

    @contextlib.contextmanager
    def active(self, what: str) -> Iterator[Signals]:
        """Handle the ending signals for the body (only in the main thread, the only one
        Python lets set handlers); on leaving, put the caller's handlers back, say on stderr
        what the signal ended (`what`: "the 4 ranks"), and exit by it."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handler) for s in ENDING_SIGNALS}
        try:
            yield self
        except Terminated:
            raise
        except BaseException:
            if self.received is None:
                raise
            # A signal kept while a failure ended the job: the process still ends by it.
            raise Terminated(self.received) from None
        finally:
            self.raising = False
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.received is not None:
                print(f"ampscope: received {signal.Signals(self.received).name}: ended {what} "
                      "and the processes they started", file=sys.stderr, flush=True)
        if self.received is not None:  # kept while the job was ended: raised now
            raise Terminated(self.received)

    def hold(self) -> None:
        """From now on a signal is kept, not raised: the job is being ended."""
        self.raising = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A signal received in the body is kept, and raised as it ends (ranks being started:
        one started but not yet listed would be left behind)."""
        self.raising = False
        try:
            yield
        finally:
            self.raising = self.received is None
        if self.received is not None:
            raise Terminated(self.received)


def end_groups(processes: Sequence[subprocess.Popen], signum: int | None) -> None:
    """End the process group of each rank in `processes` (started by `spawn(session=True)`):
    with `signum` (the signal ampscope received), that signal first and SIGKILL to what is
    left after GRACE seconds; without, SIGKILL at once (a failed rank's peers, a job past its
    deadline, which may wait in a collective that never completes). Every rank is reaped."""
    if signum is not None:
        _signal_groups(processes, signum)
        until = time.monotonic() + GRACE
        while any(p.poll() is None for p in processes) and time.monotonic() < until:
            time.sleep(0.02)
    # Also the groups of ranks that exited: what they started may still run there.
    _signal_groups(processes, signal.SIGKILL)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def _signal_groups(processes: Sequence[subprocess.Popen], signum: int) -> None:
    for process in processes:  # only the groups of the ranks started here, by their id
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
