"""The run report as one self-contained HTML page: plain data in, a string out.

Inputs are what the run left behind, as plain JSON-like data: the run's summary (as written to
`summary.json`), its gate report (`gate_report.json`, None when the run stopped before the
gates) and its training curves (`curves.Curves`). Every value that comes from them is
HTML-escaped; the plots are embedded as `data:` PNGs and the style is inline, so the page
loads nothing from anywhere (MLflow shows it inline, a browser opens it offline).
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from rlhf_core.report.curves import PANELS, Curves, Panel, plot_png, plotted_series

GOOD = {"completed", "passed", "promoted", "serving", "ready", "prepared", "challenger", "cached", "skipped"}
BAD = {"failed", "rejected"}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; } th, td { border: 1px solid #ddd; padding: 0.3em 0.6em;
  text-align: left; vertical-align: top; } th { background: #f5f5f5; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.good { color: #116329; font-weight: 600; } .bad { color: #b3261e; font-weight: 600; }
.open { color: #8a5a00; font-weight: 600; }
.note { color: #555; font-style: italic; } nav a { margin-right: 1em; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 0.9em; }
pre.error { background: #fdf0ef; padding: 0.6em; border-left: 3px solid #b3261e; }
div.curves { display: flex; flex-wrap: wrap; gap: 1em; } figure { margin: 0; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
"""


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def num(x: Any) -> str:
    """A figure as the tables show it: 4 significant digits, `–` for none."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def status_class(status: Any) -> str:
    s = str(status).lower()
    return "good" if s in GOOD else "bad" if s in BAD else "open" if s == "undecided" else ""


def render_report(summary: dict, gate_report: dict | None, curves: Curves, panels: tuple[Panel, ...] = PANELS) -> str:
    """The page of one run: header, stage table, training curves, gate table with intervals,
    regression suites, and sampled answers of the reference and the candidate side by side."""
    name = Path(summary.get("output_dir") or "").name or summary.get("mlflow_run_id", "run")
    sections = [
        ("stages", "Stages", stages_section(summary.get("stages") or {})),
        ("curves", "Training curves", curves_section(curves, panels)),
        ("gates", "Gates", gates_section(gate_report)),
        ("samples", "Sampled answers", samples_section(gate_report)),
    ]
    nav = " ".join(f'<a href="#{key}">{title}</a>' for key, title, _ in sections)
    body = "\n".join(f'<h2 id="{key}">{title}</h2>\n{content}' for key, title, content in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>Run report: {e(name)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>Run report: {e(name)}</h1>\n{header(summary)}\n<nav>{nav}</nav>\n{body}\n</body>\n</html>\n"
    )


def header(summary: dict) -> str:
    status = summary.get("status", "unknown")
    rows = [
        ("status", f'<span class="{status_class(status)}">{e(status)}</span>'),
        ("pipeline", e(summary.get("pipeline", "–"))),
        ("MLflow run", e(summary.get("mlflow_run_id", "–"))),
        ("config", e(summary.get("config", "–"))),
        ("output directory", e(summary.get("output_dir", "–"))),
    ]
    if "failed_stage" in summary:
        rows.append(("failed stage", e(summary["failed_stage"])))
    out = [table(["", ""], rows, head=False)]
    if summary.get("error"):
        out.append(f'<pre class="error">{e(summary["error"])}</pre>')
    if summary.get("reasons"):
        out.append("<ul>" + "".join(f"<li>{e(r)}</li>" for r in summary["reasons"]) + "</ul>")
    return "\n".join(out)


def table(columns: list[str], rows: list[tuple], head: bool = True, numeric: set[int] = frozenset()) -> str:
    """Cells are HTML already (escape data before); `numeric` columns align right."""
    thead = "<tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>" if head else ""
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table>{thead}{body}</table>"


# --- stages -------------------------------------------------------------------------------

def key_figure(stage: str, r: dict) -> str:
    """The one figure of a stage's record a reviewer reads first (plain text)."""
    if r.get("status") == "failed":
        return str(r.get("error", "failed")).strip().splitlines()[0] if r.get("error") else "failed"
    g = r.get
    if stage == "pretrained":
        return f"{g('model_type', '?')}, {num(g('num_parameters'))} parameters"
    if stage == "validate":
        return f"{num(g('rows'))} preference rows" if "rows" in r else "data prepared"
    if stage == "sft":
        return f"held-out accuracy {num(g('eval_accuracy'))}" if "eval_accuracy" in r else str(g("reason", ""))
    if stage == "reward":
        audit = f", audit {num(g('audit_eval_accuracy'))}" if "audit_eval_accuracy" in r else ""
        return f"held-out pair accuracy {num(g('eval_accuracy'))}{audit}"
    if stage == "policy":
        figures = []
        if g("accuracy_before") is not None or g("accuracy_after") is not None:
            figures.append(f"held-out accuracy {num(g('accuracy_before'))} → {num(g('accuracy_after'))}")
        if g("rm_score_before") is not None:
            figures.append(f"reward-model score {num(g('rm_score_before'))} → {num(g('rm_score_after'))}")
        figures.append(f"KL max {num(g('kl_max'))}")
        return f"{g('algorithm', '?')}: " + ", ".join(figures)
    if stage == "evaluate":
        return (f"accuracy {num(g('accuracy'))} (reference {num(g('reference_accuracy'))}), "
                f"win rate vs reference {num(g('win_rate_vs_reference'))}")
    if stage == "register":
        return f"policy v{g('version', '?')} ({', '.join(g('aliases') or [])})"
    if stage == "deploy":
        return f"v{g('version', '?')} at {g('endpoint', '?')}"
    return ""


def stages_section(stages: dict) -> str:
    if not stages:
        return '<p class="note">No stage ran.</p>'
    rows = []
    for stage, r in stages.items():
        status = str(r.get("status", "?")) + (" (reused)" if r.get("reused") else "")
        rows.append((e(stage), f'<span class="{status_class(r.get("status"))}">{e(status)}</span>',
                     e(num(r.get("seconds"))), e(key_figure(stage, r))))
    return table(["stage", "status", "seconds", "key figure"], rows, numeric={2})


# --- curves -------------------------------------------------------------------------------

def curves_section(curves: Curves, panels: tuple[Panel, ...]) -> str:
    notes, figures = [], []
    if not any(plotted_series(p, curves) for p in panels):
        notes.append('<p class="note">The run has no policy-stage training metrics: the policy stage did not run, '
                     "or logged none of these.</p>")
    for panel in panels:
        png = plot_png(panel, curves)
        if png is None:
            keys = ", ".join(s.key for s in panel.series)
            notes.append(f'<p class="note">{e(panel.title)}: not plotted, no data ({e(keys)}); {e(panel.absent)}.</p>')
            continue
        drawn = plotted_series(panel, curves)
        missing = ", ".join(s.key for s in panel.series if s not in drawn)
        caption = f'<figcaption class="note">no data: {e(missing)}</figcaption>' if missing else ""
        src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        figures.append(f'<figure><img src="{src}" alt="{e(panel.title)}" width="560" height="280">{caption}</figure>')
    grid = '<div class="curves">\n' + "\n".join(figures) + "\n</div>" if figures else ""
    return "\n".join([grid, *notes]).strip()


# --- gates --------------------------------------------------------------------------------

def check_result(c: dict) -> tuple[str, str]:
    """(text, css class) of one check's outcome."""
    if c.get("skipped"):
        return f"skipped ({c['skipped']})", "note"
    if c.get("undecided"):
        return "undecided", "open"
    return ("pass", "good") if c.get("passed") else ("FAIL", "bad")


def interval(low: Any, high: Any) -> str:
    return "–" if low is None else f"[{num(low)}, {num(high)}]"


def gates_section(report: dict | None) -> str:
    if not report:
        return '<p class="note">No gate report: the run stopped before the evaluation gates.</p>'
    decision = report.get("decision") or {}
    status = decision.get("status", "unknown")
    confidence = (report.get("thresholds") or {}).get("confidence")
    level = f"{confidence:.0%} " if isinstance(confidence, (int, float)) else ""
    champion = report.get("champion")
    versus = f"champion v{champion.get('version')}" if champion else "no champion yet"
    verdict = (f'<p>Verdict: <span class="{status_class(status)}">{e(status)}</span> '
               f"(vs the reference and {e(versus)}, on {e(num(report.get('num_prompts')))} eval prompts; "
               f"intervals are {e(level)}paired bootstrap intervals).</p>")
    out = [verdict]
    rows = []
    for c in decision.get("checks", []):
        text, css = check_result(c)
        threshold = "–" if c.get("threshold") is None else f"{c.get('op', '')} {num(c['threshold'])}"
        rows.append((e(c.get("name", "?")), e(num(c.get("observed"))), e(interval(c.get("low"), c.get("high"))),
                     e(threshold), f'<span class="{css}">{e(text)}</span>'))
    out.append(table(["check", "observed", "interval", "threshold", "result"], rows, numeric={1}))
    lines = [*decision.get("reasons", []), *(f"undecided: {u}" for u in decision.get("undecided", []))]
    if lines:
        out.append("<ul>" + "".join(f"<li>{e(line)}</li>" for line in lines) + "</ul>")
    if report.get("regression_suites"):
        out.append("<h3>Regression suites</h3>")
        out.append(suites_table(report["regression_suites"]))
    if looks := looks_rows(report):
        out.append("<h3>Looks</h3><p>Each look's intervals are drawn at a level that spends the error rate "
                   "across the looks; a call still open is looked at on twice the rows.</p>")
        out.append(table(["rows of", "rows", "level", "intervals", "stopped"], looks, numeric={1, 2}))
    return "\n".join(out)


def looks_rows(report: dict) -> list[tuple]:
    """One row per look at the eval prompts, then per look at each regression suite."""
    rows = []
    for look in report.get("eval_looks") or []:
        calls = "; ".join(f"{name}{' (open)' if name in look.get('open', ()) else ''} "
                          f"{interval(c.get('low'), c.get('high'))}" for name, c in (look.get("calls") or {}).items())
        rows.append(("eval prompts", e(num(look.get("rows"))), e(f"{look.get('level', 0):.2%}"), e(calls),
                     e(look.get("stopped") or "went on")))
    for suite in report.get("regression_suites") or []:
        for look in suite.get("looks") or []:
            diff = look.get("vs_reference") or {}
            rows.append((e(f"suite {suite.get('name', '?')}"), e(num(look.get("rows"))),
                         e(f"{look.get('level', 0):.2%}"),
                         e(f"candidate − reference {interval(diff.get('low'), diff.get('high'))}"),
                         e(look.get("stopped") or "went on")))
    return rows


def suites_table(suites: list[dict]) -> str:
    rows = []
    for s in suites:
        diff = s.get("diff_vs_reference") or {}
        rows.append((e(s.get("name", "?")), e(num(s.get("rows"))), e(num(s.get("candidate"))),
                     e(num(s.get("reference"))), e(num(s.get("champion"))),
                     e(interval(diff.get("low"), diff.get("high"))), e(num(s.get("margin")))))
    return table(["suite", "rows", "candidate", "reference", "champion", "candidate − reference", "margin"],
                 rows, numeric={1, 2, 3, 4, 6})


# --- samples ------------------------------------------------------------------------------

def samples_section(report: dict | None) -> str:
    if not report:
        return '<p class="note">No sampled answers: they come with the gate report.</p>'
    candidate = (report.get("candidate") or {}).get("samples") or []
    if not candidate:
        return '<p class="note">The gate report holds no sampled answers.</p>'
    others = [(name, answers_by_prompt((report.get(name) or {}).get("samples") or []))
              for name in ("reference", "champion")]
    others = [(name, answers) for name, answers in others if answers]
    rows = []
    for s in candidate:
        prompt = s.get("prompt", "")
        theirs = (f"<pre>{e(answers.get(prompt, '–'))}</pre>" for _, answers in others)
        rows.append((f"<pre>{e(prompt)}</pre>", *theirs, f"<pre>{e(s.get('answer', ''))}</pre>"))
    note = ("" if any(name == "reference" for name, _ in others)
            else '<p class="note">The gate report holds no reference answers: the candidate\'s alone.</p>')
    return (f"<p>The first {len(candidate)} eval prompts, answered greedily at the gates. "
            "The gate report does not keep the gold answers.</p>" + note
            + table(["prompt", *(name for name, _ in others), "candidate"], rows))


def answers_by_prompt(samples: list[dict]) -> dict[str, str]:
    return {s.get("prompt", ""): s.get("answer", "") for s in samples}
