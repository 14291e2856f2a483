"""Shared fixtures: tiny reference models, built once per test session."""

from __future__ import annotations

import pytest
import torch

from ampscope.models import gpt2, nanochat


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpt2_tiny():
    torch.manual_seed(0)
    return gpt2.load("gpt2-tiny")


@pytest.fixture
def nanochat_tiny():
    torch.manual_seed(0)
    return nanochat.load("nanochat-tiny")
