"""Live progress of a long stage: the figures it shows, and quiet where nobody watches."""
from __future__ import annotations

from monitoring import progress
from monitoring.progress import ProgressSink


def test_quiet_in_ci_and_when_stdout_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("CI", "true")
    assert progress.wanted() is False
    monkeypatch.delenv("CI")
    assert progress.wanted() is True
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: False, raising=False)
    assert progress.wanted() is False


def test_the_key_figures_follow_the_metric_callbacks():
    with ProgressSink("policy", total=30, figures={"policy/reward": "reward", "policy/kl": "KL"}, enabled=False) as p:
        p(1, {"policy/kl": 0.5, "policy/entropy": 2.0})
        p(2, {"policy/reward": 0.25, "policy/kl": 0.125})
    assert p.shown == {"policy/reward": 0.25, "policy/kl": 0.125}
    assert p.text() == "reward 0.25  KL 0.125"


def test_a_live_bar_counts_steps_up_to_the_total():
    with ProgressSink("sft", total=4, figures={"sft/loss": "loss"}, enabled=True) as p:
        for step in (1, 2, 5):
            p(step, {"sft/loss": 1.0 / step})
        bar = p._progress.tasks[0]
    assert (bar.completed, bar.total, bar.fields["figures"]) == (4, 4, "loss 0.2")


def test_a_workers_metrics_reach_the_progress_through_the_jobs_exporter(tmp_path):
    """Rank 0 of a Ray job sends its metrics to the driver's exporter; the bar lives there."""
    from monitoring.prometheus import JobExporter

    bar = ProgressSink("policy", total=30, figures={"policy/reward_mean": "reward", "policy/kl": "KL"}, enabled=False)
    exporter = JobExporter("run-p", "policy", targets_dir=tmp_path / "targets", on_record=bar)
    try:
        exporter.sink()(3, {"policy/reward_mean": 0.5, "policy/kl": 0.25, "worker/0/host": "n1"})
    finally:
        exporter.close()
    assert bar.text() == "reward 0.5  KL 0.25"
