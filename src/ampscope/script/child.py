"""`run_script` in a child process: the script gets a process of its own, as under `python`.

Why a process of its own, spawned, and where its output goes: docs/api.md ("Where it runs";
imports that register operators once per process stay there too). The child runs the script
with `in_process=True` and writes the trace (or the one-line error) as JSON to a file the
parent reads back as a `Trace`; its output reaches a caller that redirected its streams (a
notebook) through pipes, copied into the caller's current streams as it comes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO

from ampscope.errors import AmpscopeError, DtypeMismatchError
from ampscope.files import write_atomic
from ampscope.records import Trace
from ampscope.script.ending import script_status, with_status

# The folder that holds the ampscope package: put first on the child's path, so the child runs
# this ampscope whatever its caller's path holds.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_in_child(target: str, argv: list[str], **options) -> Trace:
    """The trace of `run_script(target, argv, **options, in_process=True)` in a spawned child
    (with `exact=True`, inside `ampscope.exact_path()`)."""
    request = {"target": target, "argv": argv, **options}
    with tempfile.TemporaryDirectory(prefix="ampscope-run-") as folder:
        result = os.path.join(folder, "result.json")
        process, copiers = spawn(request, result)
        try:
            code = process.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C: let it end, then say so
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise
        finally:
            for copier in copiers:
                copier.join(timeout=10)
        return answer(result, code, target)


def spawn(request: dict, result: str, env: dict[str, str] | None = None, *,
          session: bool = False) -> tuple[subprocess.Popen, list[threading.Thread]]:
    """Start a child that runs `request` and writes its answer to `result`, with `env` added
    to this process's environment; its output goes where the caller's goes (the threads that
    copy it, already started, when it is piped). `session`: in a session of its own, whose
    process group the caller ends with all it started (a rank: script/rank_groups.py)."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT, *([full["PYTHONPATH"]] if full.get("PYTHONPATH") else [])])
    pipes = {name: _own_descriptor(stream, fd)
             for name, stream, fd in (("stdout", sys.stdout, 1), ("stderr", sys.stderr, 2))}
    process = subprocess.Popen(
        [sys.executable, "-m", "ampscope.script.child", json.dumps(request), result],
        env=full, stdout=None if pipes["stdout"] else subprocess.PIPE,
        stderr=None if pipes["stderr"] else subprocess.PIPE, start_new_session=session)
    copiers = [threading.Thread(target=_copy, args=(pipe, name), daemon=True)
               for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))
               if pipe is not None]
    for copier in copiers:
        copier.start()
    return process, copiers


def _own_descriptor(stream: IO[str], fd: int) -> bool:
    """Whether `stream` writes to this process's own descriptor `fd` (then the child writes
    there too, directly: a terminal stays a terminal for its progress bars)."""
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


def _copy(pipe: IO[bytes], name: str) -> None:
    """The child's output, into the caller's current stream as it comes."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536):
        stream = getattr(sys, name)
        stream.write(decoder.decode(chunk))
        stream.flush()
    getattr(sys, name).write(decoder.decode(b"", final=True))


def answer(path: str, code: int, target: str) -> Trace:
    """The trace the child wrote, or its error raised here."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, ValueError):
        payload = None
    if payload is None:
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and
               -code in signal.valid_signals() else f"ended with status {code}")
        raise AmpscopeError(f"the process running {target} {how} before it reported a trace")
    status = payload.get("status")  # the script's own exit status (script/ending.py)
    if "trace" in payload:
        trace = Trace.from_dict(payload["trace"])
        return with_status(trace, status) if status is not None else trace
    if payload.get("interrupted"):
        raise KeyboardInterrupt
    error = payload["error"]
    failure: Exception
    if "diagnosis" in error:
        from ampscope.analysis.diagnosis import Diagnosis

        failure = DtypeMismatchError(Diagnosis(error["diagnosis"]["summary"],
                                               tuple(error["diagnosis"]["lines"])))
    elif error["type"] == "AmpscopeError":
        failure = AmpscopeError(error["message"])
    else:
        failure = RuntimeError(f"{error['type']} while running {target}: {error['message']}")
    raise with_status(failure, status) if status is not None else failure


def main(argv: list[str]) -> int:
    """The child: run the script here, write what came of it."""
    import contextlib

    from ampscope.script import run_script
    from ampscope.tricks import exact_path

    request, result = json.loads(argv[0]), argv[1]
    exact = request.pop("exact", False)
    groups = watching = None
    if request.pop("rank", False):
        # A rank of `ampscope run --nproc` (script/ranks.py): its process groups run on gloo,
        # or on the fake process group when predicted (script/predicted_ranks.py).
        from ampscope.runtime.process_group import FakeGroups, GlooGroups

        groups = FakeGroups() if request.get("predict", False) else GlooGroups()
    if watch := request.pop("watch", None):
        # A real rank's state file: the collective it is in, read by the parent at the deadline.
        from ampscope.runtime.collective_watch import watched

        watching = watched(watch)
    # `python -m ampscope.script.child` put the caller's working folder first on this
    # process's path, where `python SCRIPT` puts none (the script's folder is put there by the
    # run, and `-m TARGET`'s working folder too): the script sees the path it would see.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
        del sys.path[0]
    payload: dict
    carrier: object = None  # the trace or error that may carry the script's exit status
    try:
        with exact_path() if exact else contextlib.nullcontext(), \
                groups.active() if groups is not None else contextlib.nullcontext(), \
                watching or contextlib.nullcontext():
            carrier = trace = run_script(request.pop("target"), request.pop("argv"), **request,
                                         in_process=True)
        if groups is not None:
            trace.notes = groups.notes() + trace.notes
        payload = {"trace": trace.to_dict()}
    except DtypeMismatchError as e:
        carrier = e
        payload = {"error": {"type": "DtypeMismatchError", "message": str(e), "diagnosis": {
            "summary": e.diagnosis.summary, "lines": list(e.diagnosis.lines)}}}
    except AmpscopeError as e:
        carrier = e
        payload = {"error": {"type": "AmpscopeError", "message": str(e),
                             "traceback": _traceback(e)}}
    except KeyboardInterrupt:
        payload = {"interrupted": True}
    except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
        payload = {"error": {"type": type(e).__name__, "message": str(e),
                             "traceback": _traceback(e)}}
    if (status := script_status(carrier)) is not None:
        payload["status"] = status  # read back by `answer`
    write_atomic(result, json.dumps(payload))
    return 0


def _traceback(e: BaseException) -> str:
    """The traceback of what the script raised (the cause of ampscope's one-line error), for
    `--debug` in the process that reads the answer."""
    import traceback

    return "".join(traceback.format_exception(e.__cause__ or e))


def traceback_of(path: str) -> str | None:
    """The traceback a child wrote with its error, if it wrote one."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("error", {}).get("traceback")
    except (OSError, ValueError, AttributeError):
        return None


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the trace is written: skip freeing its records one by one
