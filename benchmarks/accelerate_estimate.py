"""accelerate's memory estimate for one transformers config, with nothing of ampscope imported:
what `bench_memory.py` times as accelerate's side, in its process and as a fresh one.

    python benchmarks/accelerate_estimate.py '["LlamaConfig", {"hidden_size": 4096, ...}]'

The steps of accelerate's `estimate-memory` command after it has the config (the command
itself reads the config from the hub): the model built under `init_empty_weights()`, then
`calculate_maximum_sizes` (the weights' total and the largest layer) and
`estimate_training_usage` for bf16, whose largest component the command prints as the peak.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from accelerate import init_empty_weights
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import calculate_maximum_sizes


def estimate(config_class: str, kwargs: dict) -> tuple[int, int, int]:
    """(weights' total bytes, largest layer's bytes, training estimate) for bf16."""
    config = getattr(transformers, config_class)(**kwargs)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total, largest = calculate_maximum_sizes(model)
    training = max(estimate_training_usage(total, "bfloat16").values())
    return total // 2, largest[0] // 2, training


if __name__ == "__main__":
    config_class, kwargs = json.loads(sys.argv[1])
    print(*estimate(config_class, kwargs))
