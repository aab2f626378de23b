"""The training curves a reviewer looks at, and how one panel of them becomes a PNG.

A panel groups the metrics that share an axis (the reward model's and the audit's scores,
normalised alike). Curves come in as plain `{metric name: [(step, value), ...]}`; a series
with no finite value is not drawn, and a panel none of whose series has one is not drawn at all
(`plot_png` returns None, and the page says so in one line).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

Curves = dict[str, list[tuple[int, float]]]


@dataclass(frozen=True)
class Series:
    key: str  # the metric name the policy stage logs
    label: str
    points_only: bool = False  # a few evaluations: markers, not a line through them
    color: str | None = None  # one model's rollouts and held-out answers share a colour


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: tuple[Series, ...]
    absent: str  # why a run may have none of it, for the one-line note


PANELS: tuple[Panel, ...] = (
    Panel("Reward-model and audit score", "normalised score", (
        Series("policy/rm_score_mean", "reward model, rollouts", color="C0"),
        Series("policy/audit_score_mean", "audit model, rollouts", color="C1"),
        Series("eval/rm_score", "reward model, held-out", points_only=True, color="C0"),
        Series("eval/audit_score", "audit model, held-out", points_only=True, color="C1"),
    ), "the policy stage scores rollouts only with a reward model"),
    Panel("KL to the reference", "KL per sequence", (
        Series("policy/kl", "KL, rollouts"),
    ), "the RL algorithms (PPO, GRPO) log it per step"),
    Panel("Held-out accuracy", "exact match", (
        Series("eval/accuracy", "greedy answers, held-out", points_only=True),
    ), "only an eval set with answers has it"),
    Panel("Response length", "length", (
        Series("policy/response_length", "rollouts (tokens)"),
        Series("eval/response_length", "held-out greedy answers (characters)", points_only=True),
    ), "the RL algorithms log it per step"),
    Panel("Labels asked", "labels", (
        Series("rounds/labels_total", "asked so far"),
        Series("rounds/asked", "asked in the round", points_only=True),
    ), "only runs with preference rounds (policy.rounds) ask for labels"),
)


def curve_keys(panels: tuple[Panel, ...] = PANELS) -> list[str]:
    """Every metric name the panels plot, in their order."""
    return [s.key for p in panels for s in p.series]


def finite(points: list[tuple[int, float]] | None) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in points or [] if v is not None and math.isfinite(v)]


def plotted_series(panel: Panel, curves: Curves) -> list[Series]:
    """The panel's series that have at least one finite point."""
    return [s for s in panel.series if finite(curves.get(s.key))]


def plot_png(panel: Panel, curves: Curves) -> bytes | None:
    """The panel as a PNG (matplotlib's Agg canvas, no pyplot state), or None when none of its
    series has a finite point."""
    drawn = plotted_series(panel, curves)
    if not drawn:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 2.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in drawn:
        steps, values = zip(*finite(curves[s.key]))
        if s.points_only or len(steps) == 1:
            ax.plot(steps, values, marker="o", linestyle="--", linewidth=1, color=s.color, label=s.label)
        else:
            ax.plot(steps, values, linewidth=1.5, color=s.color, label=s.label)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
