"""How every layer words a byte count and an op's name (src/ampscope/wording.py): the figures
worked out by hand, and a module any layer may import, so it imports no other."""

from __future__ import annotations

import pytest

from ampscope.wording import format_bytes, short_op
from tests.helpers import modules_after

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("n, words", [
    (None, "—"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),  # 1536 = 1.5 · 1024
    (10 * 2**30, "10 GiB"), (-(2**29), "-512 MiB"), (2**40, "1,024 GiB"),
    (12_345_678, "11.8 MiB"),  # 12,345,678 / 1,048,576 = 11.77…
])
def test_byte_counts_in_binary_units_to_three_digits(n, words):
    assert format_bytes(n) == words


def test_op_names_without_the_aten_namespace_and_default_overload():
    assert short_op("aten.addmm.default") == "addmm"
    assert short_op("aten.add.Tensor") == "add.Tensor"
    assert short_op("c10d.allreduce_.default") == "c10d.allreduce_"


def test_it_imports_nothing_of_ampscope_nor_torch():
    assert modules_after("import ampscope.wording", "ampscope", "torch") == [
        "ampscope", "ampscope.wording"]
