"""A command's heavy imports, made first with the garbage collector paused: what they cost
otherwise, and why the console script alone then freezes them, in docs/cli.md (the paragraph
on `cli/startup.py`). Importing makes next to no garbage, so pausing the collector loses
nothing; `main()` called from Python never freezes: the caller's objects are not ours to make
permanent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc

# Commands that answer without torch and must stay fast (`diff` mostly reads two trace files).
# Every other command imports torch and ampscope's API.
_LIGHT_COMMANDS = frozenset({"models", "formats", "diff"})


def _needs_transformers(spec: str) -> bool:
    from ampscope.models.catalog import requires

    return spec.startswith("hf:") or "transformers" in requires(spec.strip())


def preload(args: argparse.Namespace, *, freeze: bool) -> None:
    """Import what `args.command` will, with the collector paused; then, with `freeze`, move
    everything alive into the collector's permanent generation. An import that fails here is
    left for the command to meet and report as it would."""
    if args.command is None or args.command in _LIGHT_COMMANDS:
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with contextlib.suppress(Exception):
            import ampscope.api  # noqa: F401 - torch and everything a run uses

            model = getattr(args, "model", None)
            if isinstance(model, str) and _needs_transformers(model):
                from ampscope.models.hf import transformers_module

                transformers_module()
        if freeze:
            gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
