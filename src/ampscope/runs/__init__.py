"""The recorders: what one run did, captured as plain records while it runs.

- `environment.py`: `RunEnvironment`, what one run happens in, assembled once and in one
  order, and `exact_retry`, the one fallback to the exact path;
- `session.py`: `Capture`, every recorder at once around one run → a `Trace`;
- `modules.py`: module calls (forward and backward) and the phase clock;
- `functions.py`: user-level calls (a TorchFunctionMode), above autocast;
- `ops.py`: the aten ops that ran (a TorchDispatchMode), below autocast and autograd;
- `observed.py`: the setting a run of user code showed;
- `passes.py`: what each forward pass of the model was for (training, evaluation, sampling);
- `memory.py`: every storage's birth, death and saved-for-backward flag;
- `flops.py`: FLOPs per aten op; `inventory.py`: parameters, buffers, optimizer state;
- `values.py`: values for numerics; `source.py`: the user's file:line; `tensor_meta.py`: tensor
  metadata (`meta_of`, `tensor_key`);
- `value_checks.py`: what a real run's values say (inf/NaN made from finite inputs, the largest
  |x| per module, 16-bit updates that round away), when `CaptureOptions.values` asks;
- `progress.py`: how far a run has got, told to a callback the caller sets;
- `autocast_regions.py`: each `torch.autocast` region the run enters, and the ops run in it.

The speed tricks of a predicted run (ampscope.tricks; each has an exact path):

- `repeats.py`: identical blocks recorded twice and replayed for the others, with `alike.py`
  (which blocks are identical), `blockio.py` (what a block call takes and leaves),
  `windows.py` (one recorded block call's records, appended again under another block's names)
  and `replayed.py` (the autograd Function a replayed block runs as);
- `foreach.py`: foreach ops dispatched over one list entry of each kind;
- `shortcuts.py`: per-parameter ops FakeTensorMode never caches, answered as it would;
- `fake_cache.py`: other ops answered from FakeTensorMode's own cache, by a cheaper key.

Recorders emit records (`ampscope.records`) and nothing else: findings and diagnoses are
computed from the records by the analysis layer, never here.
"""
