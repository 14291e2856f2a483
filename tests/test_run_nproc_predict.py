"""`ampscope run --nproc N --predict`: a torchrun-style script predicted as ranks of an N-rank
job, each rank in a process of its own on PyTorch's fake process group.

The truth is the real run: `ampscope run --nproc 2` (gloo, real tensors, every rank) of the
same script gives each rank's collectives and parameter dtypes; the prediction must match it.
Sizes at N = 64 and 512 are derived by hand: Linear(4, 8) and Linear(8, 2) hold 58 parameters;
FSDP2 shards each parameter on dim 0 in chunks of ceil(rows / N) rows, so at N >= 8 ranks 0
holds one row of each (4 + 1 + 8 + 1 = 14 values) and the last rank none.
"""

from __future__ import annotations

import pytest

from tests.test_run_nproc import DDP, FSDP2, _ampscope, _script, _validated

# The real-run scripts check torchrun's one-machine environment (LOCAL_RANK == RANK, and
# WORLD_SIZE == LOCAL_WORLD_SIZE == "2"): at N = 2 the predicted environment is the same.
ENV = "import os\nassert os.environ['LOCAL_RANK'] == str(int(os.environ['RANK']) % 8)\n"
FREE_FSDP2 = ENV + FSDP2[FSDP2.index("import sys"):]

PARAMS = 4 * 8 + 8 + 8 * 2 + 2


def _facts(document: dict) -> list:
    return [(r["rank"], [(c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                         for c in r["collectives"]], r["held"].get("parameter"))
            for r in document["ranks"] if r.get("ran", True)]


@pytest.mark.parametrize("text", [DDP, FSDP2], ids=["ddp", "fsdp2"])
def test_predicted_two_ranks_equal_the_real_run(text, tmp_path, capsys):
    script = _script(tmp_path, text)
    documents = []
    for extra in ([], ["--predict"]):
        out = tmp_path / f"ranks{len(extra)}.json"
        code, _, err = _ampscope(capsys, "--nproc", "2", *extra, "--device", "cuda",
                                 "--json", str(out), str(script), "cuda")
        assert code == 0, err
        documents.append(_validated(out))
    real, predicted = documents
    assert predicted["mode"] == "predict" and predicted["backend"] == "fake"
    assert _facts(predicted) == _facts(real)
    assert [r["ran"] for r in predicted["ranks"]] == [True, True]


def test_every_rank_of_four_checked(tmp_path, capsys):
    """The claims behind running only some ranks, checked on all four ranks: under DDP
    every rank equals rank 0; under FSDP2 Linear(8, 2)'s two rows go to ranks 0 and 1 only."""
    script = _script(tmp_path, FREE_FSDP2)
    out = tmp_path / "all.json"
    code, _, err = _ampscope(capsys, "--nproc", "4", "--predict", "--all-ranks", "--device",
                             "cuda", "--json", str(out), str(script), "cuda")
    assert code == 0, err
    facts = _facts(_validated(out))
    assert [f[0] for f in facts] == [0, 1, 2, 3]
    # By hand: shards of ceil(8/4) = 2 and ceil(2/4) = 1 rows; float32 bytes 4·(2·4 + 2 +
    # 1·8 + 1) = 76 on ranks 0-1, 4·(2·4 + 2) = 40 on ranks 2-3.
    assert [f[2] for f in facts] == [{"float32": 76}] * 2 + [{"float32": 40}] * 2
    for _, calls, _ in facts:
        # Every rank all-gathers the padded shards, 4 of each: (2·4 + 2)·4 = 40 and
        # (1·8 + 1)·4 = 36 bf16 values, 80 B and 72 B.
        assert [c[3] for c in calls if c[:2] == ("all_gather", "forward")] == [80, 72]
    ddp = _script(tmp_path, ENV + DDP[DDP.index("import sys"):]
                  .replace("device_count() == 2", "device_count() == 4"), "ddp.py")
    out = tmp_path / "ddp.json"
    code, _, err = _ampscope(capsys, "--nproc", "4", "--predict", "--all-ranks", "--device",
                             "cuda", "--json", str(out), str(ddp), "cuda")
    assert code == 0, err
    document = _validated(out)
    facts = _facts(document)
    assert len(facts) == 4 and all(f[1:] == facts[0][1:] for f in facts)
    assert facts[0][1] == [("all_reduce", "backward", "float32", PARAMS * 4)]
    assert "Every rank ran; their records are identical." in document["notes"]


@pytest.mark.parametrize("nproc", [8, 64, 512])
def test_large_jobs_run_one_rank_of_each_role(nproc, tmp_path, capsys):
    """Linear(4, 8) and Linear(8, 2) under FSDP2: by hand, ranks 0-1 hold one row of each
    parameter, ranks 2-7 one row of the first layer's only, every later rank none — three
    roles. Their first ranks run, and the last; every other rank is taken to be the first of
    its role. At 8 ranks every rank also runs (`--all-ranks`), and each equals its role's."""
    script = _script(tmp_path, FREE_FSDP2)
    out = tmp_path / "big.json"
    code, _, err = _ampscope(capsys, "--nproc", str(nproc), "--predict", "--device", "cuda",
                             "--json", str(out), str(script), "cuda")
    assert code == 0, err
    document = _validated(out)
    assert document["parallel"]["world_size"] == nproc and len(document["ranks"]) == nproc
    ran = [r["rank"] for r in document["ranks"] if r["ran"]]
    assert ran == [0, 2, nproc - 1] if nproc == 8 else [0, 2, 8, nproc - 1]
    role = {k: 0 if k < 2 else 2 if k < 8 else 8 for k in range(nproc)}
    assert [r["same_as"] for r in document["ranks"]] == [
        None if r["ran"] else role[r["rank"]] for r in document["ranks"]]
    facts = {f[0]: f[1:] for f in _facts(document)}
    held = {0: 14 * 4, 2: 5 * 4, 8: 0}  # by role
    assert {k: f[1] for k, f in facts.items()} == {k: {"float32": held[role[k]]} for k in facts}
    for calls, _ in facts.values():
        # Every rank all-gathers N padded shards in bf16: (4 + 1)·ceil(8/N)·N·2 and
        # (8 + 1)·ceil(2/N)·N·2 bytes.
        assert [c[3] for c in calls if c[:2] == ("all_gather", "forward")] == [
            5 * -(-8 // nproc) * nproc * 2, 9 * nproc * 2]
        assert {c[2] for c in calls if c[0] == "reduce_scatter"} == {"float32"}
    notes = " ".join(document["notes"])
    assert "taken to be the first of its role: rank 0 for 1, rank 2 for " in notes
    if nproc == 8:
        every = tmp_path / "every.json"
        code, _, err = _ampscope(capsys, "--nproc", "8", "--predict", "--all-ranks", "--device",
                                 "cuda", "--json", str(every), str(script), "cuda")
        assert code == 0, err
        checked = _validated(every)
        facts = {f[0]: f[1:] for f in _facts(checked)}
        assert sorted(facts) == list(range(8))
        assert all(facts[k] == facts[role[k]] for k in facts)
        assert "each one's record equals that of the first rank of its role" in " ".join(
            checked["notes"])


def test_an_unmodified_nccl_script_runs_predicted(tmp_path, capsys):
    script = _script(tmp_path, """
        import os
        import torch
        import torch.distributed as dist
        from torch import nn
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        assert torch.cuda.device_count() == int(os.environ["LOCAL_WORLD_SIZE"]) == 8
        dist.barrier()
        model = nn.Linear(4, 2).cuda()
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp(torch.randn(3, 4, device="cuda")).sum().backward()
        """)
    out = tmp_path / "nccl.json"
    code, text, err = _ampscope(capsys, "--nproc", "16", "--predict", "--device", "cuda",
                                "--json", str(out), str(script))
    assert code == 0, err
    document = _validated(out)
    # DDP all-reduces every gradient, 10 float32 values, the same on every rank: the claim.
    assert [r["same_as"] for r in document["ranks"]] == [None] + [0] * 14 + [None]
    for rank in (r for r in document["ranks"] if r["ran"]):
        assert [(c["kind"], c["dtype"], c["payload_bytes"]) for c in rank["collectives"]] == [
            ("all_reduce", "float32", 10 * 4)]
    assert "the other 14 are taken to be the same as rank 0" in " ".join(document["notes"])
    assert "process group ('nccl') ran on PyTorch's fake process group" in text.replace("\n", " ")


def test_all_ranks_needs_predict(tmp_path, capsys):
    script = _script(tmp_path, "print('never runs')\n")
    code, out, err = _ampscope(capsys, "--nproc", "2", "--all-ranks", str(script))
    assert code == 2 and "never runs" not in out and "--all-ranks only applies" in err
