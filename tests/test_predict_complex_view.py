"""A real complex tensor that views a real base through another view (a rotary cache made as
`view_as_complex(freqs.view(..., 2))`, kept outside the model's buffers) meeting the fake
tensors of a predicted run: PyTorch's converter replays the view as `view_as_complex(base)`
and fails unless the base's own last dimension is 2. The predict mode makes its fake from the
fake of the base; its metadata is checked against the real tensor's own."""

from __future__ import annotations

import pytest
import torch

from ampscope.runtime.predict import fake_mode, quiet_fake_tensor_log
from ampscope.torchcompat.fake import FakeTensor


def _rope_cache() -> tuple[torch.Tensor, torch.Tensor]:
    """A complex view of a view of a real base, and the base."""
    base = torch.randn(8, 8)
    return torch.view_as_complex(base.view(8, 4, 2))[2:, 1:], base


def test_a_complex_view_of_a_real_base_converts():
    cache, _ = _rope_cache()
    real = torch.view_as_real(cache * cache)
    with quiet_fake_tensor_log(), fake_mode():
        product = cache * cache
        pairs = torch.view_as_real(product)
    assert isinstance(product, FakeTensor)
    assert (product.shape, product.stride(), product.dtype) == \
        ((6, 3), (3, 1), torch.complex64) == \
        ((cache * cache).shape, (cache * cache).stride(), (cache * cache).dtype)
    assert (pairs.shape, pairs.stride(), pairs.dtype) == (real.shape, real.stride(), real.dtype)


def test_the_fake_keeps_the_view_of_the_fake_base():
    """The fake views the base's fake storage at the real one's offset and strides."""
    from ampscope.torchcompat.distributed import storage_id
    from ampscope.torchcompat.fake import fake_complex_view

    cache, base = _rope_cache()
    mode = fake_mode()
    with quiet_fake_tensor_log():
        fake = fake_complex_view(mode, cache)
        fake_base = mode.from_tensor(base)  # the mode's own conversion, remembered
    assert fake is not None
    assert (fake.shape, fake.stride(), fake.storage_offset()) == \
        (cache.shape, cache.stride(), cache.storage_offset()) == ((6, 3), (4, 1), 9)
    assert storage_id(fake) == storage_id(fake_base)


@pytest.mark.parametrize("t", [torch.randn(3, 2), torch.randn(3, dtype=torch.complex64)])
def test_other_tensors_are_left_to_the_converter(t):
    from ampscope.torchcompat.fake import fake_complex_view

    assert fake_complex_view(fake_mode(), t) is None
