"""Reports from records: pure functions from a `Trace` (or several) to a report with
`to_dict()`, the JSON the CLI writes. Nothing here runs a model or imports a recorder.

- `summary.py`: `TraceSummary`, what the terminal shows of a trace, and its dtype inventory;
- `flow.py`: the dtype flow through modules and ops, repeated blocks collapsed;
- `diagram.py`: the dtype flow of one forward pass as a chain of steps;
- `findings.py`: the short list of dtype facts; `causes.py`: why each tensor changed dtype;
- `checks/`: the rules that judge a run (`ampscope check`): each mistake with an id, a severity,
  its evidence and its fix;
- `diagnosis.py`: a dtype error explained (a mismatch, a constant out of range), with its fixes;
- `compare.py`: `Matrix`, settings side by side; `diff.py`: `TraceDiff` of two traces, with
  `time_diff.py` (why one is faster: their predicted steps compared);
- `memory.py`: `MemoryReport`, every byte by category and dtype, the peak;
- `allocator.py`: a step's storages replayed through the CUDA caching allocator
  (hardware/cuda_allocator.py): the reserved peak, `replay_storages`;
- `flops.py`: `FlopReport`, FLOPs by phase, dtype and module, and MFU;
- `step_time.py`: `StepTime`, a step's predicted time on an accelerator and where it goes, from
  `op_time.py` (one op's time: matmuls with tile and wave quantization, memory, launch,
  collectives) and `fusion.py` (compiled code's ops as Inductor's fused kernels);
- `numerics.py`: `NumericsReport`, divergence from a reference and ranges;
- `autocast.py`: `PolicyReport`, autocast policies side by side;
- `policy_versions.py`: the finding that says when dtypes depend on the PyTorch release;
- `formats.py`: number formats and how they store a value, with `format_table.py` (their facts
  as plain data, read without torch);
- `fp8.py`: what an fp8 training step did; `fit.py`: the search and report of `ampscope fit`;
  `plans.py`: the rules and report of `fit --gpus N` (parallel plans from traced ranks).
"""

