"""What `ampscope --version -v` says of torch's private details: each detail is really tried
(none is reported present without a look), and one hidden or broken the way a release could
hide or break it is reported off, with why and with what it turns off, on its line.

Each test hides a detail with monkeypatch (torch as a release without it would be) and forgets
what was detected before and after, so the detection runs again on the changed torch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ampscope import tricks
from ampscope.cli.version import print_environment
from ampscope.torchcompat import autograd, dispatch, distributed, fake, features, policy

pytestmark = pytest.mark.fast

# Every detection the tests here make run again (each is cached once per process).
_DETECTIONS = (dispatch._modes_work, autograd._engine_state_readable,
               policy._registrations_readable, fake._storage_length_found,
               distributed.group_size_readers, distributed.group_rank_reader, tricks._missing)


@pytest.fixture
def detect_again():
    for cache in _DETECTIONS:
        cache.cache_clear()
    yield
    for cache in _DETECTIONS:
        cache.cache_clear()


def _line(capsys, name: str) -> str:
    """The `--version -v` line of the detail or trick `name`."""
    print_environment()
    lines = capsys.readouterr().out.splitlines()
    found = [line for line in lines if line[7:].startswith(f"{name}:")]
    assert len(found) == 1, lines
    return found[0]


def test_every_detail_is_found_on_this_torch_with_what_it_is(detect_again, capsys):
    """On the torch the project is developed on (2.13) every detail is there, and each line
    names it."""
    found = features()
    assert [f.name for f in found if not f.available] == []
    assert all(f.detail for f in found)
    assert _line(capsys, "dispatch registrations") == (
        "  yes  dispatch registrations: the kernels registered per dispatch key (autocast op "
        "lists)")
    # The foreach trick names the private detail it uses (it once said it needed none).
    assert tricks.status(tricks.Trick.FOREACH) == (
        True, "torch._prims_common.compute_required_storage_length")
    assert _line(capsys, "foreach") == (
        "  on   foreach: torch._prims_common.compute_required_storage_length")


def test_a_hidden_registration_reader_turns_policies_off_and_the_line_says_why(
        monkeypatch, detect_again, capsys):
    monkeypatch.delattr(torch._C, "_dispatch_get_registrations_for_dispatch_key")
    assert policy._registrations_readable()[0] is False
    assert _line(capsys, "dispatch registrations") == (
        "  no   dispatch registrations: missing: "
        "torch._C._dispatch_get_registrations_for_dispatch_key (off: autocast policies read "
        "from the build (`ampscope policy`, emulated devices))")


def test_registrations_that_read_empty_are_found_out(monkeypatch, detect_again, capsys):
    # The reader is there but lists nothing (a key renamed): the policies would be empty.
    monkeypatch.setattr(torch._C, "_dispatch_get_registrations_for_dispatch_key",
                        lambda key: [])
    assert "aten::mm is not listed at AutocastCPU" in _line(capsys, "dispatch registrations")


def test_modes_that_do_not_switch_off_turn_the_dispatch_modes_off(
        monkeypatch, detect_again, capsys):
    # `modes_off()` that lets a mode see ops: the exact path would record ampscope's own reads.
    monkeypatch.setattr(dispatch, "modes_off", contextlib.nullcontext)
    assert _line(capsys, "dispatch modes") == (
        "  no   dispatch modes: modes_off() does not hide ops from a dispatch mode "
        "(off: every recording)")


def test_an_engine_that_drops_queued_callbacks_turns_its_state_off(
        monkeypatch, detect_again, capsys):
    monkeypatch.setattr(autograd, "queue_engine_callback", lambda callback: None)
    assert _line(capsys, "autograd engine state") == (
        "  no   autograd engine state: a callback queued on the engine did not run before its "
        "pass ended (off: backward pass phases and autograd nodes in every recording)")


def test_a_hidden_group_reader_is_reported_with_what_it_costs(monkeypatch, detect_again, capsys):
    import torch.distributed as dist

    monkeypatch.delattr(dist.distributed_c10d, "_resolve_process_group")
    assert _line(capsys, "collective group sizes") == (
        "  no   collective group sizes: missing: torch.distributed's "
        "distributed_c10d._resolve_process_group (off: a collective's own group in the wire "
        "bytes (the world size is taken))")


def test_a_hidden_rank_reader_is_reported_with_what_it_costs(monkeypatch, detect_again, capsys):
    import torch.distributed as dist

    assert _line(capsys, "collective group ranks") == (
        "  yes  collective group ranks: torch.distributed.get_process_group_ranks")
    distributed.group_rank_reader.cache_clear()
    monkeypatch.delattr(dist, "get_process_group_ranks")
    assert _line(capsys, "collective group ranks") == (
        "  no   collective group ranks: missing: torch.distributed.get_process_group_ranks "
        "(off: the link a collective crosses by the nodes its ranks are on (by its group's "
        "size))")


def test_a_hidden_storage_length_turns_the_foreach_trick_off_and_both_lines_say_why(
        monkeypatch, detect_again, capsys):
    import torch._prims_common as prims_common

    monkeypatch.delattr(prims_common, "compute_required_storage_length")
    assert not tricks.enabled(tricks.Trick.FOREACH)
    print_environment()
    out = capsys.readouterr().out
    assert ("  no   required storage length: torch._prims_common.compute_required_storage_length "
            "is not on this build (cannot import name 'compute_required_storage_length'"
            in out)
    assert "(off: foreach)" in out
    assert ("  off  foreach: torch._prims_common.compute_required_storage_length is not on this "
            "build" in out)
    # Only that trick: the others keep their own details.
    assert set(tricks.unavailable()) == {tricks.Trick.FOREACH}


def test_a_storage_length_that_counts_otherwise_is_found_by_its_probe(monkeypatch, detect_again):
    import torch._prims_common as prims_common

    # A rule that forgets the offset: the transposed layout at offset 1 needs 7, not 6.
    monkeypatch.setattr(prims_common, "compute_required_storage_length",
                        lambda shape, stride, offset: 0 if 0 in shape else
                        1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)))
    ok, why = fake.status("foreach")
    assert not ok and "counts differently on this build ((6, 6, 0), not (6, 7, 0))" in why


def test_a_trick_name_the_layer_does_not_know_is_an_error():
    with pytest.raises(ValueError, match="no speed trick named 'nope'"):
        fake.status("nope")
