"""Precision and memory under torch.distributed: DDP and FSDP2, real or predicted at scale.

    ampscope.distributed.capture(model)        # in your torchrun script, every rank
    ampscope.distributed.launch("gpt2-tiny", Parallel("fsdp", 2, param_dtype=torch.bfloat16))
    ampscope.distributed.predict("llama-3-70b", Parallel("fsdp", 64, ...))

- `capture.py`: capture on every rank, gathered on rank 0;
- `launch.py`: one step on N real processes, or rank 0 of N predicted;
- `step.py`: one rank's train step under DDP or FSDP2; `parallel.py`: the strategy and its
  mixed-precision policy; `report.py`: what crossed the network and what each rank held;
  `tensor_parallel.py`: how a Llama-family block splits across a tensor-parallel group;
  `verdicts.py`: whether each rank's peak fits a GPU's memory (the report's notes);
  `block_forward.py`: whether a model's repeated blocks run alike (`fit --gpus` takes its
  first blocks for all only where they do); `probe_depth.py`: a model cut to its first
  blocks for a probe, and made whole again; `fake_world.py`: the probes' fake process group
  of N ranks and their (dp, tp) meshes.

See docs/distributed.md.
"""

from ampscope.distributed.capture import DistributedCapture, capture
from ampscope.distributed.launch import launch, predict
from ampscope.distributed.parallel import Parallel, parse_mp_policy
from ampscope.distributed.report import Collective, DistributedReport, RankReport

__all__ = ["Collective", "DistributedCapture", "DistributedReport", "Parallel", "RankReport",
           "capture", "launch", "parse_mp_policy", "predict"]
