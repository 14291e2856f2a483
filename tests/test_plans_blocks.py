"""`fit --gpus N` on a model whose blocks have the same parameters but not the same activations:
its last two blocks keep 16 copies of their hidden state where the first six keep one. The
depth rule, which takes the first blocks for all, would answer the uniform model's plans; the
search sees the blocks differ in the forward and traces each plan at the model's full depth.

The truth is the plan traced whole (`traced_peaks`: rank 0 of N at all 8 blocks), at the
batch the search answers and at the next."""

from __future__ import annotations

import pytest

from ampscope.analysis.plans import places
from ampscope.api.parallel_plans import derived_peaks, plans, traced_peaks, traced_plan
from ampscope.api.preparation import resolved
from ampscope.distributed.block_forward import unlike_blocks, unlike_lead
from ampscope.models import registry
from ampscope.precision import on_device
from tests.helpers import LM_SOURCE

# Each block: LayerNorm and two width × width Linears, whatever its `copies` (a plain
# attribute, not a parameter); `copies` of the up-projection's output go through ReLU, which
# keeps its output for backward: `copies` times the width of activations.
MODEL = LM_SOURCE + '''

class Block(nn.Module):
    def __init__(self, width, copies):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)
        self.copies = copies

    def forward(self, x):
        h = torch.relu(self.up(self.norm(x)).repeat(1, 1, self.copies))
        return x + self.down(h.unflatten(-1, (self.copies, -1)).mean(-2))


def uneven():
    return Model([Block(64, c) for c in [1] * 6 + [16] * 2])


def even():
    return Model([Block(64, 1) for _ in range(8)])


class WideBlock(Block):
    def __init__(self, width):
        super().__init__(width, 1)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def led():
    """A first block unlike the five after it, as a dense layer before mixture-of-experts
    ones."""
    return Model([WideBlock(64)] + [Block(64, 1) for _ in range(5)])
'''

UNEVEN, EVEN = "plans_blocks_model:uneven", "plans_blocks_model:even"
LED = "plans_blocks_model:led"
BUDGET = 64 * 2**20
SEARCH = dict(memory_size="64MiB", setting="bf16", seq=64)


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "plans_blocks_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_blocks_that_run_unlike_are_named(models):
    """Parameters alike (the search's first check passes), forward not: blocks 6 and 7, at the
    repeat that makes their 16 copies."""
    setting = resolved(on_device("bf16", "cuda"))
    lm = registry.resolve(UNEVEN, device="meta", target_device="cuda")
    blocks = list(lm.module.blocks)
    assert all([(n, p.shape) for n, p in b.named_parameters()]
               == [(n, p.shape) for n, p in blocks[0].named_parameters()] for b in blocks)
    unlike = unlike_blocks(lm, setting, 16)
    assert unlike is not None and unlike.blocks == [6, 7]
    assert "aten.repeat: [1, 16, 1024] bfloat16, block 0's [1, 16, 64] bfloat16" in unlike.first
    assert unlike.said().startswith("blocks 6, 7 run unlike block 0")
    even = registry.resolve(EVEN, device="meta", target_device="cuda")
    assert unlike_blocks(even, setting, 16) is None
    # the model is left as it was: its own meta weights
    now = [p for b in lm.module.blocks for p in b.parameters()]
    before = [p for b in blocks for p in b.parameters()]
    assert len(now) == len(before) and all(a is b for a, b in zip(now, before, strict=True))
    assert all(p.is_meta for p in lm.module.parameters())


def test_plans_of_unlike_blocks_equal_the_plans_traced_whole(models):
    uneven = plans(UNEVEN, 2, **SEARCH)
    even = plans(EVEN, 2, **SEARCH)
    assert even.probe_depths == [2, 3] and uneven.probe_depths == [8]
    assert any(n.startswith("Blocks 6, 7 run unlike block 0") and "traced at all 8 blocks" in n
               for n in uneven.notes)
    # The first blocks' rule answers the even model's peaks, not the uneven model's.
    b = 8
    first_blocks = derived_peaks(EVEN, 2, depth=8, batch=b, setting="bf16", seq=64)
    whole = traced_peaks(UNEVEN, 2, depth=8, batch=b, setting="bf16", seq=64)
    assert max(whole.values()) > max(first_blocks.values())
    # The search's own derivation of the uneven model traces it whole: equal to the byte.
    assert derived_peaks(UNEVEN, 2, depth=8, batch=b, setting="bf16", seq=64) == whole
    by_family = {(p.dp, p.tp, p.checkpoint): p for p in even.plans}
    for p in uneven.plans:
        assert p.fits and not p.at_batch_limit
        assert p.batch < by_family[p.dp, p.tp, p.checkpoint].batch  # wider blocks: less room
        # traced whole, so the allocator replay is the whole plan's too: exact
        traced, _, reserved = traced_plan(UNEVEN, 2, checkpoint=p.checkpoint, depth=8,
                                          batch=p.batch, setting="bf16", seq=64)
        assert max(traced.values()) == p.peak_bytes <= reserved == p.reserved_bytes <= BUDGET
        _, _, over = traced_plan(UNEVEN, 2, checkpoint=p.checkpoint, depth=8, batch=p.batch + 1,
                                 setting="bf16", seq=64)
        assert over is not None and over > BUDGET  # the next batch's reserved peak


def test_blocks_the_meta_device_cannot_run_are_compared_on_fake_tensors(models, tmp_path,
                                                                        monkeypatch):
    """Each block multiplies by a tensor it makes on the CPU, which no meta tensor takes: every
    block runs on its fake tensors instead, and the comparison is the same."""
    (tmp_path / "plans_blocks_cpu.py").write_text(MODEL.replace(
        ".repeat(1, 1, self.copies))",
        ".repeat(1, 1, self.copies)) * torch.ones(x.shape[-1] * self.copies, dtype=x.dtype)"))
    from ampscope.distributed import block_forward

    failed: list[str] = []
    meta_call = block_forward.functional_call

    def watched(*args, **kwargs):
        try:
            return meta_call(*args, **kwargs)
        except RuntimeError as e:
            failed.append(str(e))
            raise

    monkeypatch.setattr(block_forward, "functional_call", watched)
    setting = resolved(on_device("bf16", "cuda"))
    for name, expected in (("uneven", [6, 7]), ("even", None)):
        failed.clear()
        lm = registry.resolve(f"plans_blocks_cpu:{name}", device="meta", target_device="cuda")
        unlike = block_forward.unlike_blocks(lm, setting, 16)
        assert len(failed) == 8  # every block: its meta run refused, its fake run listed
        assert (unlike.blocks if unlike is not None else None) == expected


@pytest.mark.parametrize("checkpoint", [False, True])
def test_first_blocks_unlike_the_others_are_kept_in_every_probe(models, checkpoint):
    """Block 0 has four times the others' hidden width: every probe keeps it and adds 2 and 3
    of the others, and the derived plan at all 6 blocks and an unprobed batch equals the plan
    traced whole, to the byte."""
    lm = registry.resolve(LED, device="meta", target_device="cuda")
    assert unlike_lead(lm.name, list(lm.module.blocks), 3) == 1
    led = plans(LED, 2, **SEARCH)
    assert led.probe_depths == [3, 4] and led.depth == 6
    assert any(n.startswith(f"{LED}'s block 0 differs from its other 5 blocks")
               for n in led.notes)
    options = dict(checkpoint=checkpoint, depth=6, batch=7, setting="bf16", seq=64)
    assert derived_peaks(LED, 2, **options) == traced_peaks(LED, 2, **options)


def test_the_first_blocks_kept_in_every_probe_are_placed_outside_the_blocks():
    """The depth rule's places: with one block kept ahead (`lead`), block 1 is the first of the
    three it extends and block 0's ops count as before the blocks in forward and after them in
    backward, where they run last; the root's ops keep their places."""
    modules = ["wte", "blocks.0.up", "blocks.1.up", "blocks.2.up", "blocks.3.up", "head",
               "head", "blocks.3.up", "blocks.2.up", "blocks.1.up", "blocks.0.up", "wte"]
    phases = ["forward"] * 6 + ["backward"] * 6
    assert places(modules, phases, "blocks", 3, lead=1) == [
        "before", "before", "first", "middle", "last", "after",
        "before", "last", "middle", "first", "after", "after"]
    assert places(modules, phases, "blocks", 4) == [
        "before", "first", "middle", "middle", "last", "after",
        "before", "last", "middle", "middle", "first", "after"]
