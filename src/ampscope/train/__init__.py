"""Training lab: a reference trainer (`train`) and the precision ladder (`bench`).

    from ampscope.train import TrainConfig, train
    result = train(TrainConfig(model="gpt2-tiny", setting="fp32+amp-bf16", steps=200))
    result.evals[-1].val_loss, result.steps[-1].tokens_per_s, result.sample

See docs/training.md.
"""

from ampscope.train.bench import BenchReport, RungResult, bench, default_ladder
from ampscope.train.loop import EvalLog, StepLog, TrainConfig, TrainResult, train

__all__ = ["BenchReport", "EvalLog", "RungResult", "StepLog", "TrainConfig", "TrainResult",
           "bench", "default_ladder", "train"]
