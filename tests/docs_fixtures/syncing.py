import torch

from ampscope.models.gpt2 import GPT, PRESETS


class Syncing(GPT):
    def forward(self, idx, targets=None):
        torch.cuda.synchronize()
        return super().forward(idx, targets)


def build():
    """gpt2-tiny with a call an emulated device cannot answer (docs/cli.md#errors)."""
    return Syncing(PRESETS["gpt2-tiny"])
