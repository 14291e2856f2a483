from ampscope.models.gpt2 import GPT, PRESETS


class Broken(GPT):
    def forward(self, idx, targets=None):
        raise RuntimeError("shape mismatch in my attention\nsecond line")


def build():
    """A model that raises while it runs (docs/cli.md#errors)."""
    return Broken(PRESETS["gpt2-tiny"])


def fails():
    """A factory that raises (docs/models.md)."""
    raise ValueError("checkpoint not found")
