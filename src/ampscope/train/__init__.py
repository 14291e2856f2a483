"""Training lab: a reference trainer (`train`) and the precision ladder (`bench`).

    from ampscope.train import TrainConfig, train
    result = train(TrainConfig(model="gpt2-tiny", setting="fp32+amp-bf16", steps=200))
    result.evals[-1].val_loss, result.steps[-1].tokens_per_s, result.sample

- `loop.py`: the trainer, one loop readable top to bottom; `bench.py`: the ladder;
- `config.py`: what a run is asked (`TrainConfig`) and what it reports (`TrainResult`);
- `data.py`: the embedded corpus, the split and the loader; `tokenizer.py`: GPT-2's BPE or bytes;
- `checkpoint.py`: safetensors checkpoints that resume bit for bit;
- `measure.py`: wall time, peak memory, FLOPs and MFU of a step.

See docs/training.md.
"""

from ampscope.train.bench import BenchReport, RungResult, bench, default_ladder
from ampscope.train.config import EvalLog, StepLog, TrainConfig, TrainResult
from ampscope.train.loop import train

__all__ = ["BenchReport", "EvalLog", "RungResult", "StepLog", "TrainConfig", "TrainResult",
           "bench", "default_ladder", "train"]
