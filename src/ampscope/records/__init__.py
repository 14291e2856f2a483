"""The bottom layer: the plain records every other layer passes around.

Records are frozen dataclasses of names, dtypes, shapes and source locations — never live
tensors or modules — so a trace keeps no activation alive and can be saved, compared and
analysed without the model:

- `records/tensors.py`: what one capture sees (module calls, op calls, tensors, storages), and
  `RowLayout`, a record's fields by name while a recorder keeps it as a row;
- `records/setting.py`: the setting a trace ran under, as data;
- `records/diagnostics.py`: `Diagnostic`, one judgement of a run (id, severity, evidence, fix);
- `records/trace.py`: `Trace`, everything one capture saw, and its JSON form;
- `records/table.py`: `Table`, the one tabular form (DataFrame, CSV); `records/trace_table.py`:
  a trace's ops, modules and tensors as tables;
- `records/fp8.py`: the fp8 casts of a step and their scales, read off the op records.
- `records/timeline.py`: when the storages are live over a step, in bytes or CUDA's blocks.
- `records/perfetto.py`: a trace's records as a Trace Event timeline (`Trace.to_perfetto`).
- `records/value_checks.py`: what a real run's values said (non-finite values, the largest |x|
  per module, updates that rounded away), when the run was asked to look.
- `records/autocast_regions.py`: each `torch.autocast` region a run entered, and what ran in it.

Nothing here imports another ampscope layer.
"""

from ampscope.records.diagnostics import SEVERITIES, Diagnostic
from ampscope.records.setting import UNKNOWN_SETTING, SettingRecord
from ampscope.records.tensors import (
    EXPLICIT_CASTS,
    FUNCTION_ROW,
    OP_ROW,
    PHASES,
    STORAGE_CATEGORIES,
    TARGET_NAMES,
    ArgumentOrigin,
    BufferRecord,
    FailedCall,
    FunctionCall,
    HeldRecord,
    InputRecord,
    ModuleCall,
    OpCall,
    OptimizerStateRecord,
    ParameterRecord,
    PassKind,
    PassRecord,
    Phase,
    RowLayout,
    StorageCategory,
    StorageRecord,
    TensorMeta,
    dtype_name,
    from_rows,
    module_label,
)
from ampscope.records.trace import SCHEMA, Finding, ModelInfo, Trace

__all__ = [
    "EXPLICIT_CASTS", "PHASES", "SEVERITIES", "UNKNOWN_SETTING", "SCHEMA", "STORAGE_CATEGORIES", "TARGET_NAMES", "ArgumentOrigin",
    "BufferRecord", "Diagnostic", "FailedCall", "Finding", "FunctionCall", "HeldRecord", "InputRecord", "ModelInfo",
    "ModuleCall", "OpCall", "OptimizerStateRecord", "ParameterRecord", "PassKind", "PassRecord", "Phase", "SettingRecord",
    "StorageCategory", "StorageRecord", "TensorMeta", "Trace", "dtype_name", "from_rows", "module_label",
    "FUNCTION_ROW", "OP_ROW", "RowLayout",
]
