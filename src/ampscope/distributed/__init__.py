"""Precision and memory under torch.distributed: DDP and FSDP2, real or predicted at scale.

    ampscope.distributed.capture(model)        # in your torchrun script, every rank
    ampscope.distributed.launch("gpt2-tiny", Parallel("fsdp", 2, param_dtype=torch.bfloat16))
    ampscope.distributed.predict("llama-3-70b", Parallel("fsdp", 64, ...))

See docs/distributed.md.
"""

from ampscope.distributed.capture import DistributedCapture, capture
from ampscope.distributed.launch import launch, predict
from ampscope.distributed.parallel import Parallel, parse_mp_policy
from ampscope.distributed.report import Collective, DistributedReport, RankReport

__all__ = ["Collective", "DistributedCapture", "DistributedReport", "Parallel", "RankReport",
           "capture", "launch", "parse_mp_policy", "predict"]
