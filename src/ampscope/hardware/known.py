"""Peak FLOP/s, memory and bandwidth of the accelerators people train on, every figure sourced.

Hardware facts are data: one table, `KNOWN`, read top to bottom. A device that is not
in it, or a figure an entry lacks, is unknown, and callers show "n/a"; nothing here is estimated
or extrapolated from a neighbouring product.

Conventions, so that every entry means the same thing:

- **Dense peaks.** Vendors print most Tensor Core figures "with sparsity" (2:4 structured
  sparsity doubles them). A training step never runs sparse, so such figures are halved here;
  where a document prints the dense figure (A100, A10, V100, T4, MI300X, the L40S dense
  column, the architecture whitepapers) it is taken as printed.
- **The rate a PyTorch matmul gets.** `bfloat16` and `float16` are Tensor Core rates with float32
  accumulation, which is what cuBLAS uses for PyTorch's half-precision matmuls; GeForce cards run
  that at half their float16-accumulate rate, and their whitepapers print both. `float32` is the
  non-tensor (CUDA core) rate; `tf32` is the Tensor Core rate that float32 matmuls get when
  `torch.set_float32_matmul_precision("high")` allows TF32 (see `peak_flops`). `float64` is the
  FP64 Tensor Core rate where there is one (A100, H100: DGEMM runs on it). `float8` is the FP8
  Tensor Core rate (float32 accumulation on GeForce).
- **Units.** FLOP/s, bytes, bytes/s. Memory that vendors print as "GB" is binary: an H200 NVL
  sold as "141 GB" shows 143,771 MiB in nvidia-smi, more than 141·10⁹ bytes, so capacities are
  stored in GiB. Bandwidths ("TB/s") are decimal.
- **Patterns** are regular expressions searched case-insensitively in
  `torch.cuda.get_device_name()`. `KNOWN` is in match order, specific before general ("NVIDIA H100
  PCIe" must meet the PCIe entry before the plain H100 one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ampscope.errors import AmpscopeError

DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
MATMUL_PRECISIONS = ("highest", "high", "medium")
GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: dense peak FLOP/s per dtype, memory, bandwidth, and where each comes from.

    `peak_flops` maps a name of `DTYPES` to FLOP/s; a dtype that is missing is unknown or
    unsupported (V100 and T4 have no bfloat16). `sources` maps each figure (a dtype, "memory",
    "bandwidth", "multiprocessors", "capability") to the document it was read from. `tf32_matmuls` says whether PyTorch runs
    float32 matmuls on TF32 Tensor Cores here when the matmul precision is "high" or "medium".
    """

    name: str  # short name for by_name() and `--gpu`: "h100", "a100-40gb"
    title: str  # the product, as the vendor names it
    patterns: tuple[str, ...]
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bytes: int | None  # None: unknown (only figures given on a command line lack it)
    bandwidth_bytes_per_s: float | None  # None: unknown (a user's entry may leave it out)
    sources: Mapping[str, str] = field(hash=False)
    tf32_matmuls: bool = False
    multiprocessors: int | None = None  # streaming multiprocessors (SMs); None: not recorded
    # CUDA compute capability (major, minor); None: no CUDA device (MI300X) or not recorded (a
    # user's entry without one). What the virtual cuda device reports (runtime/virtual_device.py).
    capability: tuple[int, int] | None = None
    # The user's overrides of the step-time model's figures (hardware/kernels.py), by name.
    kernels: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Read-only views: the table is shared by every caller.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))


def _cite(*pairs: tuple[str, str]) -> dict[str, str]:
    """{figure: source} from (figures, source) pairs, figures a space-separated list."""
    return {figure: source for figures, source in pairs for figure in figures.split()}


_ALL = "float64 float32 tf32 bfloat16 float16 float8 memory bandwidth"

_H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet, "
                   "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H100_WHITEPAPER = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3, "
                    "https://nvdam.widen.net/s/95bdhpsgrs/"
                    "nvidia_h100_tensor_core_gpu_architecture_whitepaper_v1.03")
_H200_PAGE = "NVIDIA H200 product page, https://www.nvidia.com/en-us/data-center/h200/"
_BLACKWELL_DATASHEET = ("NVIDIA Blackwell datasheet, HGX B200 column, "
                        "https://resources.nvidia.com/en-us-blackwell-architecture/datasheet")
_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/"
                   "en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A100_WHITEPAPER = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper, Table 1 (A100: 108 SMs), "
                    "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/"
                    "nvidia-ampere-architecture-whitepaper.pdf")
_A10_DATASHEET = ("NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/"
                  "en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf")
_L4_PAGE = "NVIDIA L4 product page, https://www.nvidia.com/en-us/data-center/l4/"
_L40S_PAGE = "NVIDIA L40S product page, https://www.nvidia.com/en-us/data-center/l40s/"
_ADA_WHITEPAPER = ("NVIDIA Ada GPU Architecture whitepaper, Appendix A, https://images.nvidia.com/"
                   "aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_GA102_WHITEPAPER = ("NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A, "
                     "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-"
                     "whitepaper-v2.pdf")
_V100_DATASHEET = ("NVIDIA V100 Tensor Core GPU datasheet, https://images.nvidia.com/content/"
                   "technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf")
_T4_DATASHEET = ("NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
                 "Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf")
_T4_PAGE = "NVIDIA T4 product page, https://www.nvidia.com/en-us/data-center/tesla-t4/"
# Compute capabilities: NVIDIA's table of CUDA GPUs by product (V100 7.0, T4 7.5, A100 8.0,
# A10 and RTX 3090 8.6, L4, L40S and RTX 4090 8.9, H100 and H200 9.0, B200 10.0).
_CUDA_GPUS = "NVIDIA CUDA GPUs, compute capability table, https://developer.nvidia.com/cuda-gpus"
_MI300X_DATASHEET = ("AMD Instinct MI300X data sheet, https://www.amd.com/content/dam/amd/en/"
                     "documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf")

# Hopper. Datasheet, with sparsity: TF32 989, BF16/FP16 1,979, FP8 3,958 (the whitepaper's dense
# figures: 494.7, 989.4, 1978.9); FP64 Tensor Core and FP32 67, dense.
H100 = Accelerator(
    name="h100",
    title="NVIDIA H100 SXM5 80GB",
    patterns=(r"\bh100\b",),  # "NVIDIA H100 80GB HBM3"; after the PCIe and NVL entries
    peak_flops={"float64": 67e12, "float32": 67e12, "tf32": 495e12, "bfloat16": 989e12,
                "float16": 989e12, "float8": 1979e12},
    memory_bytes=80 * GiB,
    bandwidth_bytes_per_s=3.35e12,
    sources=_cite((_ALL, _H100_DATASHEET), ("multiprocessors", _H100_WHITEPAPER),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    multiprocessors=132,  # the whitepaper's Table 3: H100 SXM5, 132 SMs
    capability=(9, 0),
)
# The 2022 datasheet's PCIe column, with sparsity: TF32 756, BF16/FP16 1,513, FP8 3,026; the
# whitepaper prints BF16 756 dense.
H100_PCIE = Accelerator(
    name="h100-pcie",
    title="NVIDIA H100 PCIe 80GB",
    patterns=(r"\bh100\b.*\bpcie\b",),
    peak_flops={"float64": 51e12, "float32": 51e12, "tf32": 378e12, "bfloat16": 756e12,
                "float16": 756e12, "float8": 1513e12},
    memory_bytes=80 * GiB,
    bandwidth_bytes_per_s=2.0e12,
    sources=_cite((_ALL, _H100_DATASHEET), ("bfloat16 float16", _H100_WHITEPAPER),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(9, 0),
)
# The datasheet's NVL column, per GPU, with sparsity: TF32 835, BF16/FP16 1,671, FP8 3,341.
H100_NVL = Accelerator(
    name="h100-nvl",
    title="NVIDIA H100 NVL 94GB",
    patterns=(r"\bh100\b.*\bnvl\b",),
    peak_flops={"float64": 60e12, "float32": 60e12, "tf32": 417.5e12, "bfloat16": 835.5e12,
                "float16": 835.5e12, "float8": 1670.5e12},
    memory_bytes=94 * GiB,
    bandwidth_bytes_per_s=3.9e12,
    sources=_cite((_ALL, _H100_DATASHEET), ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(9, 0),
)
# The H100's GH100 compute with HBM3e. The H200 NVL, a PCIe card with a lower power limit, is
# rated lower; its figures could not be confirmed, so its name must not fall through to here.
H200 = replace(
    H100,
    name="h200",
    title="NVIDIA H200 SXM 141GB",
    patterns=(r"\bh200\b(?!.*\bnvl\b)",),
    memory_bytes=141 * GiB,
    bandwidth_bytes_per_s=4.8e12,
    sources=_cite((_ALL, _H200_PAGE), ("capability", _CUDA_GPUS)),  # (9.0, the H100's)
    multiprocessors=None,  # the product page gives no SM count
)

# Blackwell, one GPU of an HGX B200 board. With sparsity: TF32 2.2 PF, BF16/FP16 4.5 PF,
# FP8 9 PF; FP64 (also its Tensor Core) 37 TF and FP32 75 TF, dense. Launch material said
# 192 GB / 8 TB/s; the shipping HGX B200 has 180 GB at 7.7 TB/s.
B200 = Accelerator(
    name="b200",
    title="NVIDIA B200 180GB (HGX B200)",
    patterns=(r"\bb200\b",),  # "NVIDIA B200"; not "NVIDIA GB200", whose GPUs are rated higher
    peak_flops={"float64": 37e12, "float32": 75e12, "tf32": 1100e12, "bfloat16": 2250e12,
                "float16": 2250e12, "float8": 4500e12},
    memory_bytes=180 * GiB,
    bandwidth_bytes_per_s=7.7e12,
    sources=_cite((_ALL, _BLACKWELL_DATASHEET), ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(10, 0),
)

# Ampere. The A100 datasheet prints dense figures (sparse ones starred) and the same compute
# for SXM and PCIe boards; memory and bandwidth differ by board.
A100 = Accelerator(
    name="a100",
    title="NVIDIA A100 SXM4 80GB",
    patterns=(r"\ba100\b",),  # "NVIDIA A100-SXM4-80GB"; after the 40GB and PCIe entries
    peak_flops={"float64": 19.5e12, "float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12,
                "float16": 312e12},
    memory_bytes=80 * GiB,
    bandwidth_bytes_per_s=2.039e12,
    sources=_cite(("float64 float32 tf32 bfloat16 float16 memory bandwidth", _A100_DATASHEET),
                  ("multiprocessors", _A100_WHITEPAPER), ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    multiprocessors=108,  # every A100 board: the GA100 with 108 of its 128 SMs enabled
    capability=(8, 0),
)
A100_40GB = replace(  # SXM4 and PCIe boards: same memory, same 1,555 GB/s
    A100, name="a100-40gb", title="NVIDIA A100 40GB (SXM4 or PCIe)",
    patterns=(r"\ba100\b.*\b40\s*gb\b",), memory_bytes=40 * GiB, bandwidth_bytes_per_s=1.555e12)
A100_PCIE = replace(
    A100, name="a100-pcie", title="NVIDIA A100 80GB PCIe",
    patterns=(r"\ba100\b.*\bpcie\b",), bandwidth_bytes_per_s=1.935e12)
A10 = Accelerator(
    name="a10",
    title="NVIDIA A10 24GB",
    # "NVIDIA A10"; not AWS's A10G, whose tensor rates differ from the A10 datasheet.
    patterns=(r"\ba10\b",),
    peak_flops={"float32": 31.2e12, "tf32": 62.5e12, "bfloat16": 125e12, "float16": 125e12},
    memory_bytes=24 * GiB,
    bandwidth_bytes_per_s=600e9,
    sources=_cite(("float32 tf32 bfloat16 float16 memory bandwidth", _A10_DATASHEET),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(8, 6),
)
# GeForce GA102. Table 9 prints BF16/FP16 with FP32 accumulate 71 (142 with sparsity); the
# card's dense TF32 rate could not be confirmed, so float32 matmuls under TF32 show n/a.
RTX_3090 = Accelerator(
    name="rtx3090",
    title="NVIDIA GeForce RTX 3090",
    patterns=(r"\brtx 3090$",),  # not the 3090 Ti
    peak_flops={"float32": 35.6e12, "bfloat16": 71e12, "float16": 71e12},
    memory_bytes=24 * GiB,
    bandwidth_bytes_per_s=936e9,
    sources=_cite(("float32 bfloat16 float16 memory bandwidth", _GA102_WHITEPAPER),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(8, 6),
)

# Ada. L4 page, with sparsity: TF32 120, BF16/FP16 242, FP8 485. The L40S page prints dense
# figures next to the sparse ones (BF16 362.05 | 733*).
L4 = Accelerator(
    name="l4",
    title="NVIDIA L4 24GB",
    patterns=(r"\bl4\b",),
    peak_flops={"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12,
                "float8": 242.5e12},
    memory_bytes=24 * GiB,
    bandwidth_bytes_per_s=300e9,
    sources=_cite(("float32 tf32 bfloat16 float16 float8 memory bandwidth", _L4_PAGE),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(8, 9),
)
L40S = Accelerator(
    name="l40s",
    title="NVIDIA L40S 48GB",
    patterns=(r"\bl40s\b",),  # not the L40, a different part
    peak_flops={"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362.05e12, "float16": 362.05e12,
                "float8": 733e12},
    memory_bytes=48 * GiB,
    bandwidth_bytes_per_s=864e9,
    sources=_cite(("float32 tf32 bfloat16 float16 float8 memory bandwidth", _L40S_PAGE),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(8, 9),
)
# GeForce AD102, whitepaper v2.02 Table 2, dense/sparse: BF16 and FP16 with FP32 accumulate
# 165.2/330.4, FP8 with FP32 accumulate 330.3/660.6, TF32 82.6/165.2.
RTX_4090 = Accelerator(
    name="rtx4090",
    title="NVIDIA GeForce RTX 4090",
    patterns=(r"\brtx 4090$",),  # not the 4090 D or the laptop 4090, other chips
    peak_flops={"float32": 82.6e12, "tf32": 82.6e12, "bfloat16": 165.2e12, "float16": 165.2e12,
                "float8": 330.3e12},
    memory_bytes=24 * GiB,
    bandwidth_bytes_per_s=1008e9,
    sources=_cite(("float32 tf32 bfloat16 float16 float8 memory bandwidth", _ADA_WHITEPAPER),
                  ("capability", _CUDA_GPUS)),
    tf32_matmuls=True,
    capability=(8, 9),
)

# Volta: no bfloat16, no TF32. "Tensor Performance" is float16 with float32 accumulate. These
# boards all have 900 GB/s; device names carry the form factor and the memory.
V100 = Accelerator(
    name="v100",
    title="NVIDIA V100 SXM2 32GB",
    patterns=(r"\bv100-sxm2\b",),  # "Tesla V100-SXM2-32GB"
    peak_flops={"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12},
    memory_bytes=32 * GiB,
    bandwidth_bytes_per_s=900e9,
    sources=_cite(("float64 float32 float16 memory bandwidth", _V100_DATASHEET),
                  ("capability", _CUDA_GPUS)),
    capability=(7, 0),
)
V100_16GB = replace(V100, name="v100-16gb", title="NVIDIA V100 SXM2 16GB",
                    patterns=(r"\bv100-sxm2-16gb\b",), memory_bytes=16 * GiB)
V100_PCIE = replace(V100, name="v100-pcie", title="NVIDIA V100 PCIe 32GB",
                    patterns=(r"\bv100-pcie\b",),  # not "V100S-PCIE", a faster part
                    peak_flops={"float64": 7e12, "float32": 14e12, "float16": 112e12})
V100_PCIE_16GB = replace(V100_PCIE, name="v100-pcie-16gb", title="NVIDIA V100 PCIe 16GB",
                         patterns=(r"\bv100-pcie-16gb\b",), memory_bytes=16 * GiB)

# Turing: no bfloat16, no TF32; "Mixed-Precision (FP16/FP32)" is the float16 Tensor Core rate.
# The datasheet says 300 GB/s, the product page 320+ GB/s (256 bits at 10 Gb/s is 320 GB/s).
T4 = Accelerator(
    name="t4",
    title="NVIDIA T4 16GB",
    patterns=(r"\bt4\b",),  # "Tesla T4"
    peak_flops={"float32": 8.1e12, "float16": 65e12},
    memory_bytes=16 * GiB,
    bandwidth_bytes_per_s=320e9,
    sources=_cite(("float32 float16 memory", _T4_DATASHEET), ("bandwidth", _T4_PAGE),
                  ("capability", _CUDA_GPUS)),
    capability=(7, 5),
)

# CDNA 3, dense figures as printed (sparse ones separately). The matrix cores have an XF32
# (TF32) rate, but PyTorch on ROCm uses it only with HIPBLASLT_ALLOW_TF32=1 in the environment,
# so float32 matmuls are held to the float32 rate.
MI300X = Accelerator(
    name="mi300x",
    title="AMD Instinct MI300X 192GB",
    patterns=(r"\bmi300x\b",),
    peak_flops={"float64": 163.4e12, "float32": 163.4e12, "tf32": 653.7e12,
                "bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12},
    memory_bytes=192 * GiB,
    bandwidth_bytes_per_s=5.3e12,
    sources=_cite((_ALL, _MI300X_DATASHEET)),
    # No CUDA compute capability: ROCm's torch.cuda reports the gfx942's (9, 4), whose kernel
    # choices (SDPA on ROCm) ampscope does not model, so the virtual cuda device is no MI300X.
)

KNOWN: tuple[Accelerator, ...] = (
    H100_NVL, H100_PCIE, H100, H200, B200,
    A100_40GB, A100_PCIE, A100, A10, RTX_3090,
    L40S, L4, RTX_4090,
    V100_16GB, V100, V100_PCIE_16GB, V100_PCIE,
    T4, MI300X,
)


def peak_flops(acc: Accelerator, dtype: str, matmul_precision: str = "highest") -> float | None:
    """Dense peak FLOP/s of a matmul running in `dtype` on `acc`; None when unknown.

    `dtype` is a torch dtype name ("bfloat16", "float32", "float8_e4m3fn"; a "torch." prefix is
    ignored) or "tf32". A float32 matmul gets the TF32 rate when `matmul_precision` is "high" or
    "medium" (what `torch.set_float32_matmul_precision` set) on a device where PyTorch then uses
    TF32 (NVIDIA Ampere and newer); on CUDA "medium" also means TF32. Otherwise it gets the
    float32 rate.
    """
    if matmul_precision not in MATMUL_PRECISIONS:
        raise AmpscopeError(f"unknown matmul precision {matmul_precision!r}; "
                            f"expected one of {', '.join(MATMUL_PRECISIONS)}")
    figure = dtype.removeprefix("torch.")
    if figure.startswith("float8"):
        figure = "float8"
    if figure == "float32" and matmul_precision != "highest" and acc.tf32_matmuls:
        figure = "tf32"
    return acc.peak_flops.get(figure)


def mfu(flops_by_dtype: Mapping[str, float], step_seconds: float, acc: Accelerator | None,
        matmul_precision: str = "highest") -> float | None:
    """Model FLOPs utilisation of a step, each dtype's FLOPs against that dtype's own peak.

        MFU = (Σ_d flops_d / peak_d) / step_seconds

    The sum is the time the step would take if every matmul ran at the peak of the dtype it ran
    in; MFU is that ideal time over the measured one. Dividing all FLOPs by one peak would hold a
    mixed step to the wrong bar: under bf16 autocast the logits or an fp32 head still run in
    float32, at a fraction of the bf16 rate (67 vs 989 TFLOP/s on an H100), and counting them
    against the bf16 peak would report a step that runs every matmul at full speed as far below
    100%. For a step in one dtype the formula is the usual flops / (seconds · peak).

    `flops_by_dtype` maps a dtype (as for `peak_flops`) to the FLOPs its matmuls did; dtypes
    with no FLOPs are ignored. None when `acc` is None or a needed peak is unknown (show n/a).
    """
    if step_seconds <= 0:
        raise AmpscopeError(f"step time must be positive, got {step_seconds} s")
    if acc is None:
        return None
    ideal_seconds = 0.0
    for dtype, flops in flops_by_dtype.items():
        if not flops:
            continue
        peak = peak_flops(acc, dtype, matmul_precision)
        if peak is None:
            return None
        ideal_seconds += flops / peak
    return ideal_seconds / step_seconds


def describe(acc: Accelerator) -> str:
    """One line: the peaks, memory and bandwidth of `acc`, and the documents they come from."""
    order = ("bfloat16", "float16", "float8", "tf32", "float32", "float64")
    peaks = ", ".join(f"{d} {acc.peak_flops[d] / 1e12:g}" for d in order if d in acc.peak_flops)
    sources = "; ".join(dict.fromkeys(acc.sources.values()))
    memory = "memory unknown" if acc.memory_bytes is None else f"{acc.memory_bytes / GiB:g} GiB"
    if acc.bandwidth_bytes_per_s is not None:
        memory += f" at {acc.bandwidth_bytes_per_s / 1e12:g} TB/s"
    return f"{acc.name}: {acc.title}: {peaks} TFLOP/s dense; {memory} (sources: {sources})"


__all__ = [
    "KNOWN",
    "Accelerator",
    "peak_flops",
    "mfu",
    "describe",
    "A10",
    "A100",
    "A100_40GB",
    "A100_PCIE",
    "B200",
    "DTYPES",
    "GiB",
    "H100",
    "H100_NVL",
    "H100_PCIE",
    "H200",
    "L4",
    "L40S",
    "MATMUL_PRECISIONS",
    "MI300X",
    "RTX_3090",
    "RTX_4090",
    "T4",
    "V100",
    "V100_16GB",
    "V100_PCIE",
    "V100_PCIE_16GB",
]
