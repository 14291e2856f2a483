"""examples/distributed/train.py, a torchrun script with FSDP2 × tensor parallelism, under
`ampscope run --nproc 4` (a 2 × 2 mesh: dp × tp), real gloo ranks on the CPU.

Every figure is derived by hand from the script's shapes (width 64, 4·64 MLP, vocabulary 256,
2 blocks, batch 2 × 32 tokens, tp = 2, dp = 2):

- tensor parallelism splits each block's q, k, v, o, up and down across tp: a rank's block
  holds 3·(32·64) + 64·32 + 128·64 + 64·128 + 2·64 (its two RMSNorm weights, replicated) =
  24,704 elements; the embedding, final norm and head are not split: 256·64 + 64 + 256·64 =
  32,832;
- FSDP2 gathers each block (and the root's own parameters) over dp in bfloat16 (2 bytes an
  element) before its forward and again before its backward (it reshards after forward), and
  reduce-scatters their gradients in float32 (4 bytes);
- tensor parallelism all-reduces the activations its row-wise layers produce (attn.o and down,
  2 a block) in the forward, and the input gradients of its column-wise layers (q, k, v and up,
  4 a block) in the backward: each a (2, 32, 64) bfloat16 tensor, 8,192 bytes;
- each rank keeps its dp shard of its tp share: (2·24,704 + 32,832) / 2 = 41,120 float32
  elements of parameters and as many of gradients, and AdamW's two moments of them plus a
  float32 step for each of the 19 parameters.

On "cuda" the ranks run on the virtual device (`torch.cuda.set_device`, a "cuda" mesh).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ampscope.cli import main

EXAMPLE = Path(__file__).parent.parent / "examples" / "distributed" / "train.py"
BLOCK, ROOT = 24_704, 32_832


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_by_tensor_parallel_on_four_ranks(device, tmp_path, capsys):
    out = tmp_path / "ranks.json"
    code = main(["run", "--nproc", "4", "--device", device, "--quiet", "--json", str(out),
                 str(EXAMPLE), "--tp=2", "--steps=1"])
    assert code == 0, capsys.readouterr().err
    document = json.loads(out.read_text())
    assert document["parallel"]["strategy"] == "fsdp"
    assert len(document["ranks"]) == 4
    for rank in document["ranks"]:
        calls = Counter((c["kind"], c["phase"], c["dtype"], c["payload_bytes"])
                        for c in rank["collectives"])
        assert calls == {
            ("all_gather", "forward", "bfloat16", 2 * BLOCK): 2,
            ("all_gather", "forward", "bfloat16", 2 * ROOT): 1,
            ("all_gather", "backward", "bfloat16", 2 * BLOCK): 2,
            ("reduce_scatter", "backward", "float32", 4 * BLOCK): 2,
            ("reduce_scatter", "backward", "float32", 4 * ROOT): 1,
            ("all_reduce", "forward", "bfloat16", 2 * 32 * 64 * 2): 4,
            ("all_reduce", "backward", "bfloat16", 2 * 32 * 64 * 2): 8,
        }
        # What a rank sends, by the ring factors of its group's size: 2 for every collective
        # of a 2 × 2 mesh (dp for FSDP2's, tp for the all-reduces), not the world's 4.
        for c in rank["collectives"]:
            sent = c["payload_bytes"] if c["kind"] == "all_reduce" else c["payload_bytes"] // 2
            assert c["wire_bytes"] == sent, c
        shard = (2 * BLOCK + ROOT) // 2
        assert rank["held"] == {"parameter": {"float32": 4 * shard},
                                "gradient": {"float32": 4 * shard},
                                "optimizer_state": {"float32": 2 * 4 * shard + 19 * 4}}


def test_activation_checkpointing_recomputes_each_block_in_the_backward_pass():
    """`--checkpoint_blocks=True` wraps each block in `torch.utils.checkpoint` (non-reentrant):
    the backward pass runs each block's forward again before its own backward, so each of the
    2 blocks' attention runs twice a step, once in the forward phase and once in the backward
    (by hand: 2 forward + 2 recomputed). FSDP2's collectives are the same as without it: the
    recomputation uses the parameters gathered for the block's backward."""
    from ampscope.distributed.report import collectives
    from ampscope.script.ranks import run_ranks

    runs = {flag: run_ranks(str(EXAMPLE), ["--steps=1", f"--checkpoint_blocks={flag}"], 2,
                            device="cuda")
            for flag in (False, True)}
    for flag, traces in runs.items():
        for trace in traces:
            attention = [o.phase for o in trace.ops if "attention" in o.op and o.flops
                         and "backward" not in o.op]
            assert attention == ["forward"] * 2 + (["backward"] * 2 if flag else [])

    def calls(trace):
        return sorted((c.kind, c.phase, c.dtype, c.payload_bytes)
                      for c in collectives(trace.ops, 2) if c.phase != "optimizer")

    assert calls(runs[True][0]) == calls(runs[False][0])


def test_a_tensor_parallel_rank_counts_the_flops_of_its_own_shards():
    """Each rank's matmuls are recorded on the shards it computes on (a DTensor's op is the
    rank's op on its local tensors), so its FLOPs are its own. By hand, per rank at tp = 2 and
    64 tokens (batch 2 × 32): a block's q, k, v each 2·64·64·32, o 2·64·32·64, up 2·64·64·128,
    down 2·64·128·64 = 3,145,728; the head, not split, 2·64·64·256 = 2,097,152."""
    from ampscope.script.predicted_ranks import predict_ranks

    _, traces, _ = predict_ranks(str(EXAMPLE), ["--tp=2", "--steps=1"], 4, device="cuda")
    for trace in traces.values():
        forward = [o for o in trace.ops if o.phase == "forward"
                   and o.op in ("aten.mm.default", "aten.addmm.default")]
        by_module = {o.module: o for o in forward}
        assert [tuple(m.shape) for m in by_module["blocks.0.attn.q"].inputs] == [(64, 64),
                                                                                  (64, 32)]
        assert sum(o.flops for o in forward) == 2 * 3_145_728 + 2_097_152


def test_a_tensor_parallel_all_reduce_is_counted_over_its_own_group():
    """At 8 ranks, dp 4 × tp 2: each collective's record keeps its process group's size, and
    its wire bytes follow it — an all-reduce over tp sends 2·(2−1)/2 of its payload, FSDP2's
    gathers over dp (4−1)/4 of theirs — where the world's 8 would say 2·7/8 and 7/8."""
    from ampscope.distributed.report import collectives
    from ampscope.script.predicted_ranks import predict_ranks

    _, traces, _ = predict_ranks(str(EXAMPLE), ["--tp=2", "--steps=1"], 8, device="cuda")
    trace = traces[0]
    groups = Counter((o.op.split(".")[1], o.group) for o in trace.ops if o.group is not None)
    # (The 12 scatters are tensor parallelism's, as parallelize_module shards the weights.)
    assert groups == {("all_reduce", 2): 12, ("scatter_", 2): 12, ("_allgather_base_", 4): 5,
                      ("_reduce_scatter_base_", 4): 3}
    for c in collectives(trace.ops, 8):
        factor = (2, 2) if c.kind == "all_reduce" else (3, 4)
        assert c.wire_bytes == c.payload_bytes * factor[0] // factor[1], c
