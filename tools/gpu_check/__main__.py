"""`python -m gpu_check` (with tools/ on PYTHONPATH; `make gpu-check` runs it): measure on this
machine's GPU what ampscope's GPU model predicts, and write the comparison.

    make gpu-check                                   # on a machine with an NVIDIA GPU
    PYTHONPATH=tools python -m gpu_check --device cpu --tiny --out /tmp/g   # the plumbing, on a CPU
    PYTHONPATH=tools python -m gpu_check --update-docs benchmarks/gpu/gpu_check.json

Exit status: 0 written; 1 written, but a part failed (its error is in the files); 2 no GPU here
(and no --device cpu), or a bad argument.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from gpu_check import measure, predict, report, steps
from gpu_check.timing import Box, first_line, log, restored_settings

ROOT = Path(__file__).resolve().parents[2]
# Each part's time box in seconds (GPU run; the whole stays under 8 minutes on an H100/H200:
# the boxes add up to 420 s, and a part stops starting new items once its box is spent).
BOXES = {"matmuls": 90, "bandwidth": 15, "attention": 45, "steps": 120, "predictions": 150}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; exits 2 without one) or cpu (the plumbing, with --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="every part at tiny shapes and the tiny GPT-2: seconds on a CPU")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for gpu_check.json and gpu_check.md (default: $OUT, else "
                        "benchmarks/gpu/)")
    p.add_argument("--gpu", default=None,
                   help="the accelerator of ampscope's table to predict for (default: the one "
                        "the device's name matches)")
    p.add_argument("--update-docs", type=Path, metavar="RESULTS_JSON", default=None,
                   help="only rewrite the 'Measured on a GPU' section of --doc from this JSON")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "performance.md",
                   help="the page --update-docs rewrites (default: docs/performance.md)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, command: str, out: Path) -> dict:
    """Every part in order, each in its time box, the files written again after each (a run
    killed at its limit still leaves what it measured); torch's global settings as before
    after. A part that fails is recorded in `errors` and the next one runs: one broken
    backend must not cost the rest of a GPU lease."""
    device = torch.device(args.device)
    results: dict = {"schema": report.SCHEMA, "command": command, "tiny": args.tiny,
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "errors": []}
    with restored_settings():
        results["device"] = measure.device_info(device)
        d = results["device"]
        log(f"device: {d['name']}, {d['multiprocessors']} SMs, torch {d['torch']}, "
            f"CUDA {d['cuda']}")
        for part, fn in (("matmuls", measure.matmuls), ("bandwidth", measure.bandwidth),
                         ("attention", measure.attention), ("steps", steps.training_steps)):
            log(f"{part}: starting ({BOXES[part]} s box)")
            try:
                results[part] = fn(device, Box(part, BOXES[part]), tiny=args.tiny)
            except Exception as e:  # noqa: BLE001 - any failure is recorded; the next part runs
                results[part] = []
                results["errors"].append(f"{part}: {first_line(e)}")
                log(f"{part} failed: {first_line(e)}")
            report.write(results, out)
        log("predictions: starting")
        try:
            predict.predictions(results, args.gpu, Box("predictions", BOXES["predictions"]))
        except Exception as e:  # noqa: BLE001 - the measured figures are written all the same
            results["errors"].append(f"predictions: {first_line(e)}")
            log(f"predictions failed: {first_line(e)}")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.update_docs is not None:
        results = json.loads(args.update_docs.read_text())
        report.update_docs(results, args.doc)
        print(f"gpu_check: rewrote '{report.SECTION}' in {args.doc} from {args.update_docs}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a machine "
              "with an NVIDIA GPU, or pass --device cpu --tiny to check the plumbing",
              file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "gpu")
    command = "python -m gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    results = run(args, command.strip(), out)
    json_path, md_path = report.write(results, out)
    log(f"wrote {json_path} and {md_path}")
    print(report.markdown(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
