"""The recorders: what one run did, captured as plain records while it runs.

- `session.py`: `Capture`, every recorder at once around one run → a `Trace`;
- `modules.py`: module calls (forward and backward) and the phase clock;
- `ops.py`: user-level calls (a TorchFunctionMode) and aten ops (a TorchDispatchMode);
- `memory.py`: every storage's birth, death and saved-for-backward flag;
- `flops.py`: FLOPs per aten op; `inventory.py`: parameters, buffers, optimizer state;
- `values.py`: values for numerics; `source.py`: the user's file:line; `tensors.py`: metadata;
- `progress.py`: how far a run has got, told to a callback the caller sets.

Recorders emit records (`ampscope.records`) and nothing else: findings and diagnoses are
computed from the records by the analysis layer, never here.
"""
