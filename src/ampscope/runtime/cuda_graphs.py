"""CUDA graphs on the virtual device, run eagerly: what `torch.cuda.graph`, `CUDAGraph`,
`graph_pool_handle` and `make_graphed_callables` become while a run emulates CUDA (what each
does is docs/emulation.md's, in the virtual device's table, and `GraphUse.notes`' words). There
are no kernels to record: the captured block runs once, eagerly, as it does on a GPU during
capture, so its ops, dtypes and memory are recorded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class GraphUse:
    """What a run did with CUDA graphs: captures, replays, callables handed back eagerly."""

    captures: int = 0
    replays: int = 0
    callables: int = 0

    def notes(self, target: str) -> list[str]:
        notes = []
        if self.captures:
            notes.append(
                f"torch.{target}.graph captured {self._times(self.captures)}: each captured block "
                f"ran once, eagerly, and was traced; its {self._times(self.replays, 'replay')} "
                "ran nothing (a replay repeats the captured kernels on the same buffers: the "
                "same dtypes, shapes and memory; the static outputs kept their captured values).")
        if self.callables:
            notes.append(f"torch.{target}.make_graphed_callables returned its "
                         f"{self._times(self.callables, 'callable')} as they were: each call "
                         "ran eagerly.")
        return notes

    @staticmethod
    def _times(n: int, noun: str = "time") -> str:
        return f"{n} {noun}" + ("" if n == 1 else "s")

    # -- what the virtual device puts in torch.cuda's place
    def graph_class(self) -> type:
        use = self

        class CUDAGraph:
            """torch.cuda.CUDAGraph, run eagerly (runtime/cuda_graphs.py)."""

            def __init__(self, keep_graph: bool = False) -> None:
                self.captured = False

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                              **kwargs: Any) -> None:
                self.captured = False

            def capture_end(self) -> None:
                self.captured = True
                use.captures += 1

            def replay(self) -> None:
                use.replays += 1

            def instantiate(self) -> None:
                pass

            def reset(self) -> None:
                self.captured = False

            def pool(self) -> tuple[int, int]:
                return (0, 0)

            def enable_debug_mode(self) -> None:
                pass

            def debug_dump(self, debug_path: str) -> None:
                pass

        return CUDAGraph

    def graph_context(self) -> type:
        class graph:  # (torch.cuda.graph's own name)
            """torch.cuda.graph: the block runs eagerly, as the capture (runtime/cuda_graphs.py)."""

            def __init__(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
                         capture_error_mode: str = "global", **kwargs: Any) -> None:
                self.cuda_graph = cuda_graph

            def __enter__(self) -> None:
                self.cuda_graph.capture_begin()

            def __exit__(self, *exc: object) -> None:
                if exc[0] is None:
                    self.cuda_graph.capture_end()

        return graph

    def make_graphed_callables(self) -> Callable:
        def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3,
                                   allow_unused_input: bool = False, pool: Any = None):
            self.callables += len(callables) if isinstance(callables, tuple) else 1
            return callables

        return make_graphed_callables


def graph_pool_handle() -> tuple[int, int]:
    """torch.cuda.graph_pool_handle: a pool no graph needs here."""
    return (0, 0)
