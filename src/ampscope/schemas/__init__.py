"""JSON Schemas (draft 2020-12) of the JSON documents ampscope writes.

One file per document, `<name>.schema.json`, shipped inside the package: `trace` for
`ampscope.trace/1`, `matrix`, `diff`, `memory`, `distributed`, `flops`, `numerics`, `policy`,
`formats`, `models`, `train`, `bench`, `fit`, `plans` and `check` likewise. Each file's `$id` is the document's `schema`
string (`"ampscope.trace/1"`) and it stands alone: shared definitions are copied into each
file's `$defs`. What the fields mean is in docs/json-schema.md.

    import jsonschema
    from ampscope import schemas

    jsonschema.validate(document, schemas.load(document["schema"]))
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = ["load", "names"]

_SUFFIX = ".schema.json"


def names() -> list[str]:
    """The documents that have a schema: `["bench", "diff", ..., "train"]`."""
    return sorted(f.name.removesuffix(_SUFFIX) for f in resources.files(__name__).iterdir()
                  if f.name.endswith(_SUFFIX))


def load(name: str) -> dict:
    """The schema of one document, by name (`"trace"`) or by its `schema` string
    (`"ampscope.trace/1"`)."""
    short = name.removeprefix("ampscope.").removesuffix("/1")
    if short not in names():
        raise ValueError(f"no schema {name!r}; there are {', '.join(names())}")
    return json.loads(resources.files(__name__).joinpath(short + _SUFFIX).read_text("utf-8"))
