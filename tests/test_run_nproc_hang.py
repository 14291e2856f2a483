"""`ampscope run --nproc N` stopped by its deadline: the one line names where each rank hung.

The scripts hang for real on gloo: rank 0 all-reduces while rank 1 waits in a barrier (gloo
matches a collective to its peer's by order and kind, so neither ever completes), or rank 1
sleeps and never enters the all-reduce rank 0 waits in. The bytes are derived by hand:
torch.ones(6, dtype=torch.bfloat16) is 6 elements of 2 bytes, 12 B. The script's lines are
found in its own text. That no rank outlives the run is asked of the operating system
(psutil), with the pids each rank wrote itself.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from ampscope import patches
from ampscope.cli import main
from ampscope.runtime.collective_watch import read_state, watched
from ampscope.script.ranks import _where

HEAD = """
import os
import time
from pathlib import Path
import torch
import torch.distributed as dist

Path(__file__).with_name(f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
dist.init_process_group("nccl")
t = torch.ones(6, dtype=torch.bfloat16)
dist.barrier()  # both ranks: their last collective left
"""

MISMATCH = HEAD + """
if os.environ["RANK"] == "0":
    dist.all_reduce(t)
else:
    dist.barrier()
"""

SLEEPER = HEAD + """
if os.environ["RANK"] == "0":
    dist.all_reduce(t)
else:
    time.sleep(120)
"""


def _line(text: str, code: str) -> int:
    """The line number of `code` in the script (the last one that holds it)."""
    return max(i for i, line in enumerate(text.splitlines(), 1) if line.strip() == code)


def _hang(tmp_path: Path, capsys, text: str) -> tuple[int, str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    code = main(["run", "--nproc", "2", "--timeout", "10", str(script)])
    _, err = capsys.readouterr()
    for rank in (0, 1):  # every rank started, and none is left running
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not _alive(pid), f"rank {rank} (pid {pid}) outlived the run"
    return code, err


def _alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and \
            "ampscope.script.child" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def test_ranks_in_mismatched_collectives_are_named(tmp_path, capsys):
    code, err = _hang(tmp_path, capsys, MISMATCH)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    text = MISMATCH
    assert "the 2-rank run of train.py did not finish in 10 s: " in lines[0]
    assert (f"rank 0 waits in all_reduce (bfloat16, 12 B) at "
            f"train.py:{_line(text, 'dist.all_reduce(t)')}; "
            f"rank 1 waits in barrier at train.py:{_line(text, 'dist.barrier()')}.") in lines[0]
    assert lines[0].endswith("check the script, or give --timeout more")  # not cut short


def test_a_rank_outside_any_collective_says_its_last(tmp_path, capsys):
    code, err = _hang(tmp_path, capsys, SLEEPER)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    text = SLEEPER
    barrier = _line(text, "dist.barrier()  # both ranks: their last collective left")
    assert (f"rank 0 waits in all_reduce (bfloat16, 12 B) at "
            f"train.py:{_line(text, 'dist.all_reduce(t)')}; rank 1 was not in a collective "
            f"(last: barrier at train.py:{barrier}).") in lines[0]


@pytest.mark.fast
def test_ranks_in_the_same_state_are_named_together(tmp_path):
    """The states as a rank writes them (runtime/collective_watch.py's format, by hand)."""
    barrier = {"in": True, "kind": "barrier", "line": "train.py:9", "async": False}
    states = {0: {"in": True, "kind": "all_reduce", "dtype": "float32", "bytes": 4096,
                  "line": "train.py:7", "async": False},
              1: barrier, 2: barrier, 3: barrier, 5: barrier, 6: None,
              7: {"in": False, "kind": "all_gather_into_tensor", "dtype": "bfloat16",
                  "bytes": 80, "line": "train.py:12", "async": True}}
    paths = []
    for k in range(8):
        paths.append(str(tmp_path / f"rank{k}.state"))
        if states.get(k):
            Path(paths[k]).write_text(json.dumps(states[k]))
    # Rank 4 ended: it is not among the ranks still running.
    assert _where([0, 1, 2, 3, 5, 6, 7], paths) == (
        "rank 0 waits in all_reduce (float32, 4,096 B) at train.py:7; "
        "ranks 1-3, 5 wait in barrier at train.py:9; "
        "rank 6 was not in a collective (it had entered none); "
        "rank 7 was not in a collective (last: all_gather_into_tensor (bfloat16, 80 B) at "
        "train.py:12, async)")


@pytest.mark.fast
def test_each_call_leaves_its_state_and_the_functions_are_put_back(tmp_path):
    """In this process, on a one-rank gloo group (every collective returns at once): what the
    watch wrote after each call. Bytes by hand: 3 float16 elements are 6 B."""
    original = dist.all_reduce
    path = str(tmp_path / "rank0.state")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3, dtype=torch.float16)
        with watched(path):
            assert read_state(path) is None  # no collective yet
            dist.all_reduce(t)
            here = f"{Path(__file__).name}:{_called_at() - 1}"
            assert read_state(path) == {"in": False, "kind": "all_reduce", "dtype": "float16",
                                        "bytes": 6, "line": here, "async": False}
            dist.all_gather([torch.empty_like(t)], tensor=t)  # one rank: a list of one
            assert (read_state(path)["kind"], read_state(path)["bytes"]) == ("all_gather", 6)
            dist.barrier()  # no tensor: no dtype, no bytes
            assert "bytes" not in read_state(path) and read_state(path)["kind"] == "barrier"
            dist.broadcast(t, 0, async_op=True).wait()  # left at once: async
            assert read_state(path)["async"] is True
            # all_gather_object gathers through all_gather: the script's call is the outer one.
            dist.all_gather_object([None], {"step": 1})
            here = f"{Path(__file__).name}:{_called_at() - 1}"
            assert read_state(path) == {"in": False, "kind": "all_gather_object",
                                        "line": here, "async": False}
        assert dist.all_reduce is original and patches.active() == []
    finally:
        dist.destroy_process_group()


def _called_at() -> int:
    """The line this was called from (the test's own line numbers, not counted by hand)."""
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno
