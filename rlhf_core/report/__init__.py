"""The run report: one self-contained HTML page per pipeline run for the person who reviews it
(stage table, training curves, gate checks with their intervals, sampled answers).

Pure rendering: plain data in (`summary.json`'s dict, `gate_report.json`'s dict, curves as
`{metric: [(step, value)]}`), an HTML string out. Gathering the data from MLflow and writing
the page beside `summary.json` is `tasks.run_report`'s job.
"""
from rlhf_core.report.curves import PANELS, Curves, Panel, Series, curve_keys, plot_png
from rlhf_core.report.html import render_report

__all__ = ["PANELS", "Curves", "Panel", "Series", "curve_keys", "plot_png", "render_report"]
