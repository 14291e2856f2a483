"""The precision ladder: the same training steps under one setting after another, timed, each
rung trained by the reference trainer (`loop.train`) from the same seed on the same batches.
A rung's form (`SETTING[+compile][+flash]`), why a rung without `+flash` pins the math kernel,
and when a rung is n/a: docs/training.md ("The precision ladder: `ampscope bench`").
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ampscope.errors import AmpscopeError, named_line
from ampscope.precision import Setting, device_available, matmul, on_device, parse_setting
from ampscope.records import dtype_name
from ampscope.torchcompat import dynamo
from ampscope.train import measure
from ampscope.train.config import TrainConfig, defaults_for
from ampscope.train.loop import train

RUNG_PARTS = ("compile", "flash")


def default_ladder() -> list[str]:
    """fp32 → TF32 → bf16 autocast → flash attention, and pure bf16 weights for contrast."""
    return ["fp32", "fp32+tf32", "fp32+amp-bf16", "fp32+amp-bf16+flash", "bf16"]


@dataclass(frozen=True)
class Rung:
    name: str  # as shown: "fp32+amp-bf16+compile+flash"
    setting: Setting
    compile: bool
    flash: bool


def parse_rung(text: str, device: str, compile_all: bool = False) -> Rung:
    """"fp32+amp-bf16+flash" as a Rung on `device` (unless the text names its own device)."""
    words = text.strip().lower().split("+")
    repeated = sorted({w for w in words if w in RUNG_PARTS and words.count(w) > 1})
    if repeated:
        raise AmpscopeError(f"repeated part {repeated[0]!r} in rung {text!r}")
    extras = {w for w in words if w in RUNG_PARTS}
    spec = "+".join(w for w in words if w not in RUNG_PARTS)
    setting = parse_setting(spec if ":" in spec else on_device(spec, device))
    compiled = compile_all or "compile" in extras
    # The table shows the device once, in its title: rungs on it go without the prefix.
    name = setting.name.split(":")[-1] if setting.device == device else setting.name
    name += ("+compile" if compiled else "") + ("+flash" if "flash" in extras else "")
    return Rung(name, setting, compiled, "flash" in extras)


def _tf32_changes_cpu_matmuls() -> bool:
    """Whether allowing TF32 changes a float32 matmul on this CPU. oneDNN may use a
    reduced-precision path on CPUs that have one; most have none, and then the rung would only
    repeat fp32."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
    saved = matmul.snapshot()
    try:
        exact = a @ b
        matmul.set_matmul_precision("high")
        return not torch.equal(exact, a @ b)
    finally:
        matmul.restore(saved)


def not_applicable(rung: Rung) -> str | None:
    """Why a rung cannot run (or would only repeat another) on this machine; None if it can."""
    s = rung.setting
    if s.param_dtype is None:
        return "native keeps the model's own dtypes: a rung names its parameter dtype (fp32, bf16)"
    if not device_available(s.device):
        return f"this machine has no {s.device} device"
    cuda_capability = torch.cuda.get_device_capability() if s.device == "cuda" else None
    if s.matmul_precision == "high":
        if s.device == "cpu" and not _tf32_changes_cpu_matmuls():
            return ("TF32 is a CUDA Tensor Core mode: float32 matmuls on this CPU give the same "
                    "bits with it allowed")
        if cuda_capability is not None and cuda_capability < (8, 0):
            major, minor = cuda_capability
            return f"TF32 needs an Ampere or newer GPU (sm80+); this one is sm{major}{minor}"
    uses_bf16 = torch.bfloat16 in (s.param_dtype, s.autocast_dtype)
    if uses_bf16 and s.device == "cuda" and not torch.cuda.is_bf16_supported(False):
        return "this GPU has no bf16 arithmetic"
    if rung.flash and s.device == "cuda":
        compute = s.autocast_dtype or s.param_dtype
        if compute not in (torch.float16, torch.bfloat16):
            return (f"FlashAttention takes fp16 or bf16 only; this rung's attention runs in "
                    f"{dtype_name(compute)}")
        if cuda_capability is not None and cuda_capability < (8, 0):
            return "FlashAttention needs an Ampere or newer GPU (sm80+)"
    return None


@dataclass
class RungResult:
    name: str
    setting: dict
    compile: bool
    attention: str  # "math" or "flash"
    status: str  # "ok", "n/a" or "failed"
    reason: str | None = None
    ms_per_step: float | None = None  # median of the timed steps
    tokens_per_s: float | None = None
    speedup: float | None = None  # over the baseline rung
    mfu: float | None = None
    peak_memory: int | None = None
    memory_kind: str = "n/a"
    final_loss: float | None = None  # training loss of the last step
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included
    step_ms: list[float] = field(default_factory=list)


@dataclass
class BenchReport:
    model: str
    parameters: int | None
    device: str
    device_name: str
    batch: int
    seq: int
    tokens_per_step: int
    warmup: int
    steps: int
    tokenizer: str | None
    flops_per_token: int | None
    flops_formula: str | None
    baseline: str | None
    rungs: list[RungResult]

    def to_dict(self) -> dict:
        return {"schema": "ampscope.bench/1", **dataclasses.asdict(self)}


def _free(device: str, compiled: bool) -> None:
    """Let the next rung start clean: compiled graphs and cached device memory released."""
    if compiled:
        dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bench(model: str | None = None, ladder: Sequence[str] | None = None, *,
          device: str | None = None, steps: int = 10, warmup: int = 3,
          batch: int | None = None, seq: int | None = None, total_batch: int | None = None,
          compile: bool = False, data: str | None = None, tokenizer: str = "auto",
          seed: int = 0, on_rung: Callable[[int, str], None] | None = None) -> BenchReport:
    """Run every rung for `warmup` + `steps` training steps; time the last `steps`.

    `compile` compiles every rung. Defaults come from `config.defaults_for(device)` and
    `default_ladder()`; `on_rung(i, name)` is called before rung i runs.
    """
    device = device or measure.default_device()
    defaults = defaults_for(device)
    model, batch, seq = model or defaults.model, batch or defaults.batch, seq or defaults.seq
    if steps < 1 or warmup < 0:
        raise AmpscopeError("--steps must be positive and --warmup not negative")
    rungs = [parse_rung(text, device, compile) for text in (ladder or default_ladder()) if text]
    if not rungs:
        raise AmpscopeError("the ladder is empty; give rungs like fp32,fp32+amp-bf16")
    report = BenchReport(model=model, parameters=None, device=device,
                         device_name=measure.device_name(device) if device_available(device)
                         else device,
                         batch=batch, seq=seq, tokens_per_step=total_batch or batch * seq,
                         warmup=warmup, steps=steps, tokenizer=None, flops_per_token=None,
                         flops_formula=None, baseline=None, rungs=[])
    for i, rung in enumerate(rungs):
        if on_rung is not None:
            on_rung(i, rung.name)
        row = RungResult(name=rung.name, setting=rung.setting.to_dict(), compile=rung.compile,
                         attention="flash" if rung.flash else "math", status="n/a")
        report.rungs.append(row)
        row.reason = not_applicable(rung)
        if row.reason:
            continue
        config = TrainConfig(model=model, setting=rung.setting.name, steps=warmup + steps,
                             batch=batch, seq=seq, total_batch=total_batch, data=data,
                             tokenizer=tokenizer, eval_every=0, eval_batches=1, sample_tokens=0,
                             compile=rung.compile, attention=row.attention, seed=seed)
        try:
            result = train(config)
        except AmpscopeError:
            raise  # bad input (model, sizes, data): the same for every rung
        except Exception as e:  # noqa: BLE001 - out of memory, a compiler error, a missing kernel: the rung's row says which
            row.status, row.reason = "failed", named_line(e)
            _free(device, rung.compile)
            continue
        timed = [s.seconds for s in result.steps[warmup:]]
        seconds = statistics.median(timed)
        row.status = "ok"
        row.ms_per_step = seconds * 1e3
        row.tokens_per_s = result.tokens_per_step / seconds
        setting = rung.setting
        row.mfu = measure.mfu(result.flops_per_token * result.tokens_per_step,
                              setting.autocast_dtype or setting.param_dtype, seconds,
                              measure.accelerator(device), setting.matmul_precision)
        row.peak_memory, row.memory_kind = result.peak_memory, result.memory_kind
        row.final_loss = result.steps[-1].loss
        row.losses = [s.loss for s in result.steps]
        row.step_ms = [s.seconds * 1e3 for s in result.steps]
        report.parameters = result.parameters
        report.tokenizer = result.tokenizer
        report.flops_per_token, report.flops_formula = result.flops_per_token, result.flops_formula
        del result
        _free(device, rung.compile)
    _set_speedups(report)
    return report


def _set_speedups(report: BenchReport) -> None:
    """Speedup over plain fp32 when it ran, else over the first rung that ran."""
    ran = [r for r in report.rungs if r.status == "ok"]
    if not ran:
        return
    base = next((r for r in ran if r.name == "fp32"), ran[0])
    report.baseline = base.name
    for r in ran:
        assert base.ms_per_step is not None and r.ms_per_step is not None  # (every rung that ran)
        r.speedup = base.ms_per_step / r.ms_per_step
