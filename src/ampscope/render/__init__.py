"""Views: they read reports and compute nothing.

- terminal (rich): `text.py` (a trace), `memory.py`, `flops.py`, `numerics.py`, `matrix.py`,
  `diff.py`, `diagram.py`, `autocast.py`, `formats.py`, `models.py`, `fit.py`, `train.py`,
  `distributed.py`, `ranks.py` (the per-rank section of `run --nproc`), `plans.py` (`fit --gpus N`),
  `diagnostics.py` (what the checks found: `ampscope check`, the top of a report),
  `predicted_step.py` (a step predicted on a GPU, in words: every report's line or section),
  with `style.py` (dtype names and colours, byte counts, `titled_table`: the form of every table);
- HTML: `html.py` (the report page and notebook fragments), `plots.py` (matplotlib figures as
  SVG), `flowgraph.py` (the dtype flow as SVG), `templating.py` (the jinja2 environment of the
  templates in `templates/`);
- `notebook.py`: Jupyter display (`register()`, called by the package root);
- `report_kinds.py`: the reports, each registered once (`register_report`): public name, command
  (its arguments and examples), view, notebook view, section of the HTML report.

The step as a Trace Event timeline is no view: it is data, `Trace.to_perfetto`
(records/perfetto.py).
"""

