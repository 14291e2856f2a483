"""gpu_check's results as files: the JSON document, the markdown tables (measured, predicted,
ratio) and the "Measured on a GPU" section of docs/performance.md rewritten from a JSON.

A prediction column that no row has (the model that makes it is not in this ampscope) is left
out of its table; a single unknown figure is "n/a".
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

SCHEMA = "ampscope.gpu_check/1"
SECTION = "## Measured on a GPU"
PARTS = ("device", "accelerator", "matmuls", "bandwidth", "attention", "steps")


def _num(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:,.{digits}f}"


def _gib(value: float | None) -> str:
    """Bytes in binary units, GiB down to KiB (the tiny run's peaks are KiB)."""
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value} B"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


Column = tuple[str, Callable[[dict], str], bool]  # header, cell, optional (dropped if all n/a)


def table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    """A markdown table; an optional column whose every cell is "n/a" is left out."""
    kept = [c for c in columns if not c[2] or any(c[1](r) != "n/a" for r in rows)]
    lines = ["| " + " | ".join(c[0] for c in kept) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i, _ in enumerate(kept)) + "|"]
    lines += ["| " + " | ".join(c[1](r) for c in kept) + " |" for r in rows]
    return "\n".join(lines)


def _pred(row: dict, key: str) -> float | None:
    return (row.get("predicted") or {}).get(key)


def _rat(row: dict, key: str) -> float | None:
    return (row.get("ratio") or {}).get(key)


def _seconds_ms(row: dict) -> str:
    if row.get("seconds") is not None:
        return _num(row["seconds"], 1e3, 3)
    why = row.get("skipped", "")
    return f"n/a ({why[:60]}{'…' if len(why) > 60 else ''})" if why else "n/a"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def markdown(results: dict) -> str:
    """The tables that docs/performance.md shows, from a results document."""
    d, acc = results["device"], results.get("accelerator") or {}
    memory = "n/a" if d.get("memory_bytes") is None else _gib(d["memory_bytes"])
    out = [f"Device: **{d['name']}** ({d.get('multiprocessors') or 'n/a'} SMs, {memory}), "
           f"torch {d['torch']}, CUDA {d.get('cuda') or 'n/a'}; predictions for "
           f"{acc.get('title') or 'no accelerator'} ({acc.get('chosen', 'n/a')}); "
           f"{results.get('date', 'n/a')}, `{results.get('command', 'n/a')}`"
           + (" (tiny shapes: a plumbing check, not a measurement)" if results.get("tiny") else "")
           + "."]
    if acc.get("name") is not None and "multiprocessors" in acc:
        sms = acc["multiprocessors"]
        line = (f"The table's {acc['name']}: {sms or 'no'} SMs (this device: "
                f"{d.get('multiprocessors') or 'n/a'}), "
                f"{_num(acc.get('bandwidth_bytes_per_s'), 1e-12)} TB/s")
        out += ["", line + ("." if sms else "; without an SM count the model times matmuls "
                            "without tile or wave quantization.")]
    for line in results.get("not_predicted", []):
        out += ["", f"Not predicted: {line}."]
    for line in results.get("errors", []):
        out += ["", f"Failed: {line}"]
    out += ["", "**Matmuls** (`torch.mm`, median of N after warm-up; ratio = measured / predicted "
            "time)", "", table([
                ("shape", lambda r: f"{r['name']} {r['m']}×{r['k']} @ {r['k']}×{r['n']}", False),
                ("mode", lambda r: r["mode"], False),
                ("measured ms", _seconds_ms, False),
                ("predicted ms", lambda r: _num(_pred(r, "seconds"), 1e3, 3), True),
                ("ratio", lambda r: _ratio(_rat(r, "seconds")), True),
                ("TFLOP/s", lambda r: _num(r.get("tflops"), 1, 1), False),
                ("of table peak", lambda r: _percent(r.get("of_peak")), True),
            ], results.get("matmuls", []))]
    out += ["", "**Memory bandwidth** (float32; bytes read + written / median time)", "", table([
        ("op", lambda r: r["name"], False),
        ("bytes moved", lambda r: _gib(r["bytes"]), False),
        ("measured TB/s", lambda r: _num(r.get("bytes_per_s"), 1e-12, 2), False),
        ("table TB/s", lambda r: _num(r.get("peak_bytes_per_s"), 1e-12, 2), True),
        ("of table peak", lambda r: _percent(r.get("of_peak")), True),
    ], results.get("bandwidth", []))]
    out += ["", "**Attention** (causal, GPT-2 124M's shape (batch, heads, tokens, head size) "
            f"{tuple(results['attention'][0]['shape']) if results.get('attention') else 'n/a'}; "
            "TFLOP/s on 4·B·H·T²·D forward, ×3 with backward)", "", table([
                ("kernel", lambda r: r["name"], False),
                ("dtype", lambda r: r["dtype"], False),
                ("pass", lambda r: r["direction"], False),
                ("measured ms", _seconds_ms, False),
                ("predicted ms", lambda r: _num(_pred(r, "seconds"), 1e3, 3), True),
                ("ratio", lambda r: _ratio(_rat(r, "seconds")), True),
                ("TFLOP/s", lambda r: _num(r.get("tflops"), 1, 1), False),
            ], results.get("attention", []))]
    steps = results.get("steps", [])
    out += ["", "**Training step** (ampscope's built-in model, random weights, AdamW; median of "
            "the timed steps; first-step peaks: a fresh model and optimizer, as a predicted step; "
            "ratio = measured / predicted)", "", table([
                ("model", lambda r: f"{r.get('model', 'n/a')} {r.get('batch', '?')}×{r.get('seq', '?')}"
                 + (f" (batch cut from {r['batch_reduced_from']})" if r.get("batch_reduced_from")
                    else ""), False),
                ("setting", lambda r: r["setting"], False),
                ("measured ms", _seconds_ms, False),
                ("predicted ms", lambda r: _num(_pred(r, "seconds"), 1e3, 1), True),
                ("ratio (time)", lambda r: _ratio(_rat(r, "seconds")), True),
                ("allocated, 1st step", lambda r: _gib((r.get("first_step_peak") or {}).get("allocated")), False),
                ("predicted allocated", lambda r: _gib(_pred(r, "allocated_rounded") or _pred(r, "allocated")), True),
                ("ratio (allocated)", lambda r: _ratio(_rat(r, "allocated")), True),
                ("reserved, 1st step", lambda r: _gib((r.get("first_step_peak") or {}).get("reserved")), False),
                ("predicted reserved", lambda r: _gib(_pred(r, "reserved")), True),
                ("ratio (reserved)", lambda r: _ratio(_rat(r, "reserved")), True),
                ("reserved, steady", lambda r: _gib((r.get("steady_peak") or {}).get("reserved")), False),
            ], steps)]
    return "\n".join(out) + "\n"


def write(results: dict, out_dir: Path) -> tuple[Path, Path]:
    """`gpu_check.json` and `gpu_check.md` in `out_dir` (made if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    return json_path, md_path


INTRO = (
    "`make gpu-check` measures on a real NVIDIA GPU what the model above predicts, item by item: "
    "`torch.mm` at the GEMM shapes of GPT-2 124M (batch 16 × 1024 tokens) and of a "
    "Llama-3-8B layer (8,192 tokens) in fp32, TF32, bf16 and fp16; a copy and an add of 2 GiB "
    "(memory bandwidth); causal attention at GPT-2's shape with each SDPA backend the build "
    "runs and the hand-written form; and GPT-2 124M's training step in fp32, fp32+tf32, "
    "fp32+amp-bf16 and bf16 with `torch.cuda.max_memory_allocated()` and "
    "`max_memory_reserved()`. Beside each it puts ampscope's prediction for the matching "
    "accelerator of the hardware table (the GEMM kernel of `op_time`, `memory_seconds`, "
    "`step_time` of the same module or step traced on fake tensors, the predicted allocated "
    "peak, the allocator replay's reserved peak) and the ratio measured / predicted. "
    "[benchmarks/gpu/README.md](../benchmarks/gpu/README.md) says how to run it and where its "
    "results go; "
    "`make gpu-check GPU_CHECK_ARGS=\"--update-docs benchmarks/gpu/gpu_check.json\"` rewrites "
    "this section from them.")
NOT_RUN = ("Not run on a GPU yet (2026-11-29): no machine with one has been available to the "
           "project since the check was written, so there are no measured figures here; the "
           "tables above are predictions only. The first run's results replace this paragraph.")


def section(results: dict | None) -> str:
    """The "Measured on a GPU" section of docs/performance.md: the tables of `results`, or
    without results the paragraph that says none were measured yet."""
    body = markdown(results) if results is not None else _wrapped(NOT_RUN) + "\n"
    return f"{SECTION}\n\n{_wrapped(INTRO)}\n\n{body}"


def _wrapped(text: str) -> str:
    """A paragraph at the page's width; never broken at a hyphen ("fp32+amp-bf16")."""
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


def update_docs(results: dict | None, doc: Path) -> None:
    """Rewrite the section from `SECTION` up to the next `## ` heading (or the end) of `doc`;
    append it where the page has none (and create the page where there is none). The page's
    other sections are left as they are."""
    text = doc.read_text() if doc.exists() else ""
    new = section(results)
    match = re.search(rf"^{re.escape(SECTION)}\s*$", text, re.MULTILINE)
    if match is None:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + new
    else:
        following = re.search(r"^## ", text[match.end():], re.MULTILINE)
        end = match.end() + following.start() if following else len(text)
        text = text[:match.start()] + new + ("\n" + text[end:] if following else "")
    doc.write_text(text)
