"""Tensor parallelism for a transformer block, as the PyTorch tutorials split a Llama block.

Attention's q, k and v projections and the MLP's gate and up projections are split by output
features across the tp group (`ColwiseParallel`: each rank computes its own heads and its own
slice of the hidden layer), attention's output and the MLP's down projection by input
features (`RowwiseParallel`: each rank's partial sums, all-reduced). That needs the block's
code to size its heads from its projections' outputs (Hugging Face's Llama-family attention
reshapes with `-1` heads), and the head counts to divide by tp; a block that names its
projections otherwise, or that holds weights over a projection's whole output (a norm over
all heads), is not split.
"""

from __future__ import annotations

from torch import nn

_COLUMNWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def tensor_parallel_plan(model: nn.Module, tp: int) -> tuple[dict | None, str]:
    """The `parallelize_module` plan of each repeated block of `model` for a tp group of `tp`,
    or None and why the blocks cannot be split so."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ampscope.workloads import repeated_blocks

    blocks = repeated_blocks(model)
    if not blocks:
        return None, "the model has no repeated blocks"
    linears = {name: m for name, m in blocks[0].named_modules() if isinstance(m, nn.Linear)}
    plan: dict = {}
    for name in linears:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLUMNWISE:
            plan[name] = ColwiseParallel()
        elif leaf in _ROWWISE:
            plan[name] = RowwiseParallel()
    if {n.rsplit(".", 1)[-1] for n in plan} != set(_COLUMNWISE + _ROWWISE):
        return None, ("its blocks do not name their projections as Llama-family blocks do "
                      f"({', '.join(_COLUMNWISE + _ROWWISE)})")
    attention = next((m for m in blocks[0].modules() if hasattr(m, "head_dim")
                      and any(hasattr(m, p) for p in ("q_proj", "k_proj"))), None)
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int):
        return None, "its attention does not say its head size (head_dim)"
    for name, module in linears.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj", "v_proj") and (module.out_features // head_dim) % tp:
            return None, (f"{name} has {module.out_features // head_dim} heads, which do not "
                          f"divide by {tp}")
        width = module.out_features if leaf in _COLUMNWISE else module.in_features
        if width % tp:
            return None, f"{name}'s {width} features do not divide by {tp}"
    whole = _acts_on_all_features(blocks[0], head_dim)
    if whole is not None:
        return None, whole
    return plan, ""


def _acts_on_all_features(block: nn.Module, head_dim: int) -> str | None:
    """Why a module beside the column-wise projections would see their split outputs whole,
    or None: one with a weight of as many values as a projection has output features (OLMo
    2's q_norm and k_norm normalise over all heads at once; Qwen 3's, over one head's
    `head_dim`, split fine)."""
    for parent_name, parent in block.named_modules():
        children = dict(parent.named_children())
        widths = {child.out_features for leaf, child in children.items()
                  if leaf in _COLUMNWISE and isinstance(child, nn.Linear)}
        for leaf, child in children.items():
            if leaf in _COLUMNWISE + _ROWWISE:
                continue
            for weight, value in child.named_parameters():
                if value.numel() in widths and value.numel() != head_dim:
                    name = ".".join(p for p in (parent_name, leaf, weight) if p)
                    return (f"{name} holds {value.numel()} values, one per output feature of "
                            "a projection tensor parallelism splits: it would need them whole")
    return None
