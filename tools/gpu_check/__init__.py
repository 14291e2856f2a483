"""gpu_check: on a real GPU, measure what ampscope's GPU model predicts and write the comparison
(`make gpu-check`; benchmarks/gpu/README.md). It uses ampscope's public API and torch only.

- `__main__.py`: the command line, the parts in order, where the results go;
- `timing.py`: CUDA-event and wall-clock timing, progress lines, time boxes, torch's global
  settings saved and restored;
- `measure.py`: the device, matmul throughput, memory bandwidth, attention kernels;
- `steps.py`: the reference model's training step in the built-in settings, time and peaks;
- `predict.py`: ampscope's prediction for each measured item, and the ratios;
- `report.py`: the JSON, the markdown tables, the docs/performance.md section.
"""
