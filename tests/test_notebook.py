"""examples/tour.ipynb runs headless, top to bottom, in a fresh Jupyter kernel, and shows what
the same calls give here: the trace's HTML report, its findings, the memory report and a
DataFrame. Skipped when nbclient, nbformat or ipykernel are not installed (the dev extra has
them)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "examples" / "tour.ipynb"


def shown(cell, mime: str) -> str:
    """What a cell displayed as `mime` (its result or a display), or printed for text/plain."""
    parts = [o["data"][mime] for o in cell.outputs
             if o.output_type in ("execute_result", "display_data") and mime in o["data"]]
    if mime == "text/plain":
        parts += [o["text"] for o in cell.outputs if o.output_type == "stream"]
    return "".join(parts)


def test_the_tour_notebook_runs_headless_and_shows_the_reports():
    import ampscope

    nb = nbformat.read(TOUR, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not any(c.outputs for c in code), "the notebook is stored without outputs"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    trace_cell, findings_cell, memory_cell, frame_cell = code

    t = ampscope.trace("gpt2-tiny", setting="fp32+amp-bf16", seq=8)
    assert shown(trace_cell, "text/html") == t._repr_html_()
    assert shown(findings_cell, "text/plain").splitlines() == [
        f"• {f.text}" for f in t.findings[:5]]
    assert shown(memory_cell, "text/html") == ampscope.memory(t)._repr_html_()
    modules = t.to_dataframe("modules")
    assert shown(frame_cell, "text/html") == \
        modules[modules.phase == "forward"].head(8)._repr_html_()
