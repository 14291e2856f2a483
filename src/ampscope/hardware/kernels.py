"""The step-time model's parameters, in one place, every figure with its source.

analysis/step_time.py predicts how long a traced step takes on an accelerator from the
accelerator's figures (known.py: peak FLOP/s per math mode, bandwidth, SM count) and the
figures here: what fraction of those peaks real kernels reach, the GEMM tile shape behind tile
and wave quantization, what a kernel launch and PyTorch's eager dispatch cost, how fast the
fused attention kernels run, and the interconnect a collective crosses.

How they were chosen (never fitted to a whole-model step time), how hardware.toml overrides
them (user.py) and how the GPU check measures them: docs/performance.md ("The parameters and
their sources", "Measured on a GPU"). `params(acc)` returns the figures for one accelerator:
the defaults, then the accelerator's own published ones (`BY_ACCELERATOR`), then the user's.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ampscope.errors import AmpscopeError
from ampscope.hardware.known import Accelerator

_MAMF = ("Stas Bekman, Machine Learning Engineering (ml-engineering), 'Maximum Achievable Matmul "
         "FLOPS comparison table': BF16 matmul, best shape found by mamf-finder.py (A100 SXM "
         "267.9 of 312 TFLOPS = 85.9%; H100 SXM 792.1 of 989 = 80.1%; MI300X 781.9 of 1300 = "
         "60.1%)")
_MAMF_ASSUMED = ("assumption: no kernel-level figure found for this math mode; taken equal to the "
                 "BF16 fraction of the MAMF table (same Tensor Core pipeline and tiling), "
                 + _MAMF.split(",")[0])
_SIMT_ASSUMED = ("assumption: no kernel-level SGEMM figure found; 0.85, the order of the MAMF "
                 "table's Tensor Core fractions, for cuBLAS SGEMM on CUDA cores")
_MMB = ("NVIDIA, Matrix Multiplication Background User's Guide (DU-09799-001), 2.3 'Typical "
        "Tile Dimensions In cuBLAS' and 3.2 'Wave Quantization' (256x128 tiles, one per SM, "
        "108 tiles a wave on an A100)")
_CUTLASS_SIMT = ("CUTLASS's default SGEMM threadblock tile (128x128), as in NVIDIA's "
                 "Matrix Multiplication Background User's Guide's list of cuBLAS tiles")
_BANDWIDTH = ("NVIDIA Developer Forums, 'Trouble to Reach Peak Bandwidth of A100': a read "
              "kernel at 1.80 of 2.04 TB/s, 88% per Nsight Compute, and about 90% the best "
              "kernel of a GTC talk")
_LAUNCH = ("NVIDIA Technical Blog, 'Getting Started with CUDA Graphs' (2019): back-to-back "
           "launches of a 2.9 us kernel take 3.8 us each, about 1 us of launch gap per kernel")
_HOST = ("assumption: 8 us of CPU per eager op, inside the 5-25 us that published breakdowns "
         "of an eager op give (Python, autograd, dispatcher, cudaLaunchKernel); it runs ahead "
         "of the GPU, so it costs time only where it exceeds the op's kernel")
_INDUCTOR_HOST = ("tritonbench's Inductor launch-overhead benchmarks (2026, GB200): "
                  "nop_inductor_per_kernel, one generated kernel launched through Inductor's "
                  "CachingAutotuner, 6.8 us (0 arguments) to 9.1 us (19 arguments); 7 us taken")
_FA2 = ("Tri Dao, FlashAttention-2 (arXiv 2307.08691): 50-73% of the A100's peak forward, "
        "lower backward; 0.6 taken")
_FA1 = ("Tri Dao, FlashAttention-2 (arXiv 2307.08691): FlashAttention(-1)-class kernels reach "
        "25-40% of the A100's peak; the memory-efficient (xformers/CUTLASS) kernel taken in that "
        "class, 0.35")
_CUDNN = "assumption: cuDNN's fused attention taken at FlashAttention-2's fraction (0.6)"
_FLEX = "assumption: FlexAttention's generated kernel taken at FlashAttention-2's fraction (0.6)"
_MATH = ("the math backend is no fused kernel: its matmuls and softmax are traced as separate "
         "ops and costed as such; this fraction applies only to a recorded math op with FLOPs")
_NCCL_LAT = ("NCCL's own tuning model (src/graph/tuning.cc): base latency 8.4 us for Ring/Simple; "
             "per-hop latency 3.4 us over NVLink and 6.6 us over the network (Ring/Simple)")
_NCCL_BW = ("nccl-tests all_reduce_perf bus bandwidth at large sizes: 230-250 GB/s on 8 A100 SXM4 "
            "over NVLink 3 (300 GB/s a direction), about 80%")
_A100_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper: NVLink 3, 12 links, 600 GB/s "
            "total per GPU (300 GB/s each direction); DGX A100: 8x 200 Gb/s HDR InfiniBand, one a GPU")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper: NVLink 4, 18 links, 900 GB/s "
            "total per GPU (450 GB/s each direction); DGX H100: 8x 400 Gb/s NDR, one a GPU")
_B200_DS = ("NVIDIA Blackwell datasheet, HGX B200: NVLink 5, 1.8 TB/s per GPU (900 GB/s each "
            "direction); 400 Gb/s a GPU between nodes taken as for DGX H100")
_DGX = "one HGX/DGX board: 8 GPUs on NVLink, the network beyond (DGX A100, DGX H100 guides)"

# GEMM tiles (rows x columns of the output a threadblock computes): Tensor Core modes and the
# CUDA-core (SIMT) ones. Tile and wave quantization follow from them and the SM count.
TENSOR_TILE = (256, 128)
SIMT_TILE = (128, 128)
SIMT_MODES = ("float32", "float64")
TILE_SOURCES = {"tensor_tile": _MMB, "simt_tile": _CUTLASS_SIMT}
# Split-K: a GEMM with fewer output tiles than SMs splits its K dimension over the idle SMs,
# down to slices of this many elements (cuBLAS's heuristics do so for long-K weight gradients).
SPLIT_K_MIN = 256

DEFAULTS: dict[str, tuple[float, str]] = {
    # Achievable fraction of each math mode's peak on large GEMMs (cuBLAS).
    "gemm_bfloat16": (0.80, _MAMF + "; 0.80, H100's, where an accelerator has no entry"),
    "gemm_float16": (0.80, _MAMF + "; fp16 runs the same Tensor Core rate as bf16"),
    "gemm_float8": (0.80, _MAMF_ASSUMED),
    "gemm_tf32": (0.80, _MAMF_ASSUMED),
    "gemm_float32": (0.85, _SIMT_ASSUMED),
    "gemm_float64": (0.85, _SIMT_ASSUMED),
    # Achievable fraction of the memory bandwidth (a streaming kernel).
    "bandwidth": (0.88, _BANDWIDTH),
    # Per kernel: the GPU's gap between back-to-back kernels; per op: eager host dispatch.
    "launch_s": (1e-6, _LAUNCH),
    "host_s": (8e-6, _HOST),
    # Per fused kernel of compiled code (analysis/fusion.py): the host's launch of it.
    "compiled_host_s": (7e-6, _INDUCTOR_HOST),
    # Fused attention kernels: fraction of the math mode's peak.
    "attention_flash": (0.60, _FA2),
    "attention_efficient": (0.35, _FA1),
    "attention_cudnn": (0.60, _CUDNN),
    "attention_flex": (0.60, _FLEX),
    "attention_math": (0.35, _MATH),
    # Interconnect: per-GPU bandwidth one direction, achievable fraction, latencies, node size.
    "nvlink_bytes_per_s": (300e9, _A100_WP),
    "network_bytes_per_s": (25e9, _A100_WP),
    "link_efficiency": (0.80, _NCCL_BW),
    "collective_base_s": (8.4e-6, _NCCL_LAT),
    "nvlink_step_s": (3.4e-6, _NCCL_LAT),
    "network_step_s": (6.6e-6, _NCCL_LAT),
    "gpus_per_node": (8, _DGX),
}

# Published figures of one accelerator, over the defaults.
BY_ACCELERATOR: dict[str, dict[str, tuple[float, str]]] = {
    "a100": {"gemm_bfloat16": (0.859, _MAMF), "gemm_float16": (0.859, _MAMF),
             "gemm_tf32": (0.859, _MAMF_ASSUMED)},
    "h100": {"gemm_bfloat16": (0.801, _MAMF), "gemm_float16": (0.801, _MAMF),
             "gemm_tf32": (0.801, _MAMF_ASSUMED), "gemm_float8": (0.801, _MAMF_ASSUMED),
             "nvlink_bytes_per_s": (450e9, _H100_WP), "network_bytes_per_s": (50e9, _H100_WP)},
    "mi300x": {"gemm_bfloat16": (0.601, _MAMF), "gemm_float16": (0.601, _MAMF)},
    "b200": {"nvlink_bytes_per_s": (900e9, _B200_DS), "network_bytes_per_s": (50e9, _B200_DS)},
}
# Same GPU, other board or memory: the same compute and NVLink generation.
for _name, _base in (("a100-40gb", "a100"), ("h200", "h100")):
    BY_ACCELERATOR[_name] = BY_ACCELERATOR[_base]
# PCIe boards have no NVLink switch between all GPUs: their peers talk over PCIe.
_PCIE = ("PCIe 4.0 x16: 32 GB/s a direction (PCI-SIG); PCIe 5.0 x16 64 GB/s, for boards "
         "without an NVLink switch")
BY_ACCELERATOR["a100-pcie"] = {**BY_ACCELERATOR["a100"], "nvlink_bytes_per_s": (32e9, _PCIE)}
BY_ACCELERATOR["h100-pcie"] = {**BY_ACCELERATOR["h100"], "nvlink_bytes_per_s": (64e9, _PCIE)}


@dataclass(frozen=True)
class KernelParams:
    """The model's figures for one accelerator: `values[name]` and `sources[name]`."""

    accelerator: str
    values: Mapping[str, float] = field(hash=False)
    sources: Mapping[str, str] = field(hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def gemm_efficiency(self, mode: str) -> float:
        """Achievable fraction of `mode`'s peak ("bfloat16", "tf32", "float32", …)."""
        return self.values.get(f"gemm_{mode}", self.values["gemm_float32"])

    def to_dict(self) -> dict:
        return {"accelerator": self.accelerator,
                "figures": {k: {"value": v, "source": self.sources[k]}
                            for k, v in self.values.items()},
                "tiles": {"tensor": list(TENSOR_TILE), "simt": list(SIMT_TILE),
                          "sources": TILE_SOURCES, "split_k_min": SPLIT_K_MIN}}


def check_overrides(overrides: Mapping[str, object]) -> dict[str, float]:
    """A user's `kernels` table as {name: positive number}; AmpscopeError on an unknown name or
    a value that is no positive number (user.py names the file and entry)."""
    out = {}
    for name, value in overrides.items():
        if name not in DEFAULTS:
            raise AmpscopeError(f"unknown kernels figure {name!r}; known: {', '.join(DEFAULTS)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise AmpscopeError(f"kernels figure {name} must be a positive number, not {value!r}")
        out[name] = float(value)
    return out


def params(acc: Accelerator) -> KernelParams:
    """The figures for `acc`: defaults, its published ones, then the user's (`acc.kernels`)."""
    merged = {**DEFAULTS, **BY_ACCELERATOR.get(acc.name, {})}
    values = {k: v for k, (v, _) in merged.items()}
    sources = {k: s for k, (_, s) in merged.items()}
    for name, value in acc.kernels.items():
        values[name] = value
        sources[name] = acc.sources.get(f"kernels.{name}", "the user's hardware table")
    return KernelParams(acc.name, values, sources)


__all__ = ["BY_ACCELERATOR", "DEFAULTS", "SIMT_MODES", "SIMT_TILE", "SPLIT_K_MIN", "TENSOR_TILE",
           "KernelParams", "check_overrides", "params"]
