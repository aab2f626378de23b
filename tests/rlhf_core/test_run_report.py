"""The run report page (rlhf_core.report): rendered from data shaped as the pipeline writes it,
well-formed, escaped, self-contained, and as a browser shows it (headless Chromium)."""
from __future__ import annotations

import base64
import math
import re
from html.parser import HTMLParser

import pytest

from rlhf_core.eval.checks import Decision, at_most, better_than, not_above, not_worse_than, skip
from rlhf_core.eval.confidence import Interval
from rlhf_core.report import PANELS, render_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "link", "input"}
HOSTILE_PROMPT = "<script>alert('x')</script> 12+34="


def interval(estimate, low, high) -> Interval:
    return Interval(estimate, low, high, 0.95, 200)


def samples(answers: list[str]) -> list[dict]:
    return [{"prompt": p, "answer": a} for p, a in zip([HOSTILE_PROMPT, "36+31=", "70+59="], answers)]


def policy_report(model_dir: str, answers: list[str]) -> dict:
    return {"model_dir": model_dir, "figures": {"accuracy": 0.94, "rm_score_mean": 0.54, "length_ratio": 1.0},
            "length": {"mean": 3.0, "p50": 3.0, "p90": 3.0, "max": 3.0}, "failed_prompts": [],
            "samples": samples(answers)}


@pytest.fixture
def gate_report() -> dict:
    """Shaped as `tasks.evaluate._report_json` writes `gate_report.json`: a rejected candidate,
    one check failed and one open, decided on paired bootstrap intervals."""
    win = interval(0.7925, 0.7575, 0.8250625)
    gap = interval(0.12, 0.09, 0.15)
    audit = interval(0.52, 0.47, 0.57)
    checks = (
        better_than("accuracy_vs_reference", "accuracy", interval(0.56, 0.485, 0.630125), 0.0, 0.0, "accuracy gain"),
        skip("accuracy_vs_champion", ">=", "no champion"),
        better_than("win_rate_vs_reference", "win_rate", win, 0.5, 0.5, "win rate vs reference"),
        not_worse_than("audit_vs_reference", "audit", audit, 0.5, "audit win rate vs reference"),
        not_above("proxy_audit_gap", "reward_hacking", gap, 0.08, "proxy-audit gap"),
        at_most("kl_to_reference", "kl", 0.3729, 10.0, "KL to the reference"),
    )
    return {
        "decision": Decision.from_checks(checks).to_dict(),
        "thresholds": {"confidence": 0.95, "bootstrap_samples": 2000, "max_kl": 10.0},
        "num_prompts": 400,
        "eval_looks": [{"rows": 200, "level": 0.9874, "calls": {"audit_vs_reference": {"low": 0.44, "high": 0.6}},
                        "open": ["audit_vs_reference"], "stopped": None},
                       {"rows": 400, "level": 0.9841, "calls": {"audit_vs_reference": {"low": 0.47, "high": 0.57}},
                        "open": ["audit_vs_reference"], "stopped": "budget of 400 prompts reached"}],
        "candidate": policy_report("/runs/r/models/policy", ["167", "067", "129"]),
        "reference": policy_report("/runs/r/models/sft", ["067", "<b>067</b>", "029"]),
        "champion": None,
        "regression_suites": [{"name": "no_carry", "path": "/runs/r/data/regression-no_carry.jsonl",
                               "checker": "answer_exact_match", "margin": 0.05, "rows": 200, "candidate": 0.995,
                               "reference": 1.0, "champion": None,
                               "diff_vs_reference": interval(-0.005, -0.015, 0.0).to_dict(), "diff_vs_champion": None}],
        "lineage": {"policy.run_id": "3b8c", "algorithm": "grpo"},
    }


@pytest.fixture
def summary() -> dict:
    return {
        "pipeline": "rlhf-pipeline", "config": "configs/demo.yaml", "mlflow_run_id": "d550c594",
        "output_dir": "/runs/demo-20260101T000000Z", "status": "rejected",
        "reasons": ["reward_hacking: proxy-audit gap 0.12 [0.09, 0.15] > max 0.08"],
        "stages": {
            "validate": {"status": "passed", "rows": 3000, "dataset_fingerprint": "sha256:d578"},
            "sft": {"status": "completed", "eval_accuracy": 0.38, "seconds": 107.7},
            "reward": {"status": "completed", "eval_accuracy": 0.9233, "audit_eval_accuracy": 0.8967, "seconds": 83.7},
            "policy": {"status": "completed", "algorithm": "grpo", "accuracy_before": 0.38, "accuracy_after": 0.94,
                       "rm_score_before": -0.555, "rm_score_after": 0.394, "kl_max": 0.919, "seconds": 97.4},
            "evaluate": {"status": "rejected", "accuracy": 0.94, "reference_accuracy": 0.38,
                         "win_rate_vs_reference": 0.792},
        },
    }


@pytest.fixture
def curves() -> dict:
    """Two panels with data (scores, KL), labels asked logged but empty, accuracy all NaN."""
    steps = range(1, 31)
    return {
        "policy/rm_score_mean": [(s, -0.5 + s / 30) for s in steps],
        "eval/rm_score": [(0, -0.55), (10, 0.43), (20, 0.53), (30, 0.39)],
        "policy/kl": [(s, 0.03 * s) for s in steps],
        "rounds/labels_total": [],
        "eval/accuracy": [(0, math.nan), (10, math.nan)],
    }


class WellFormed(HTMLParser):
    """Every element closed, in order (void elements excepted)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.problems: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.open[-1:] or 'nothing'}")
        else:
            self.open.pop()


def parsed(page: str) -> WellFormed:
    parser = WellFormed()
    parser.feed(page)
    parser.close()
    assert parser.problems == [] and parser.open == [], (parser.problems, parser.open)
    return parser


def test_the_page_is_well_formed_and_holds_every_stage_and_gate_check(summary, gate_report, curves):
    page = render_report(summary, gate_report, curves)
    tags = parsed(page).tags
    assert [t for t, _ in tags[:3]] == ["html", "head", "meta"]
    for stage in summary["stages"]:
        assert f"<td>{stage}</td>" in page
    assert "0.38 → 0.94" in page  # the policy's key figure
    for check in gate_report["decision"]["checks"]:
        assert f"<td>{check['name']}</td>" in page
    assert "[0.485, 0.6301]" in page and "[0.7575, 0.8251]" in page  # the intervals the checks were judged on
    assert "95% paired bootstrap" in page
    assert "skipped (no champion)" in page
    assert re.search(r'class="bad">FAIL<', page)  # the proxy-audit gap
    assert re.search(r'class="open">undecided<', page)  # the audit's interval straddles its bar
    assert "[-0.015, 0]" in page  # the regression suite's interval
    assert "<td>audit_vs_reference (open) [0.44, 0.6]</td>" in page  # each look at the eval prompts
    assert "<td>budget of 400 prompts reached</td>" in page and ">98.74%</td>" in page


def test_everything_from_the_data_is_escaped(summary, gate_report):
    summary["error"] = "RuntimeError: <img src=x onerror=alert(1)>"
    page = render_report(summary, gate_report, {"policy/kl": [(1, 0.1)], "rounds/<b>": [(1, 1.0)]})
    assert "<script>" not in page and "<b>067</b>" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; 12+34=" in page
    assert "&lt;b&gt;067&lt;/b&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert not any(t == "script" for t, _ in parsed(page).tags)


def test_the_plots_are_embedded_pngs_and_an_empty_curve_is_a_note(summary, gate_report, curves):
    page = render_report(summary, gate_report, curves)
    images = [attrs for tag, attrs in parsed(page).tags if tag == "img"]
    assert [i["alt"] for i in images] == ["Reward-model and audit score", "KL to the reference"]
    for image in images:
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        assert base64.b64decode(image["src"][len(prefix):], validate=True).startswith(PNG_SIGNATURE)
    assert "Labels asked: not plotted, no data" in page  # logged, but no point
    assert "Held-out accuracy: not plotted, no data" in page  # NaN only
    assert page.count("not plotted, no data") == len(PANELS) - 2
    assert "no data: policy/audit_score_mean, eval/audit_score" in page  # a panel drawn without its audit series


def test_the_reference_and_the_candidate_answer_side_by_side(summary, gate_report):
    page = render_report(summary, gate_report, {})
    rows = re.findall(r"<tr><td><pre>(.*?)</pre></td><td><pre>(.*?)</pre></td><td><pre>(.*?)</pre></td></tr>", page)
    assert rows[1:] == [("36+31=", "&lt;b&gt;067&lt;/b&gt;", "067"), ("70+59=", "029", "129")]
    assert "<th>prompt</th><th>reference</th><th>candidate</th>" in page
    gate_report["reference"]["samples"] = []
    alone = render_report(summary, gate_report, {})
    assert "holds no reference answers" in alone and "<th>prompt</th><th>candidate</th>" in alone


def test_a_run_that_failed_before_the_gates_still_has_a_page(summary):
    summary.update(status="failed", failed_stage="reward", error="reward stage: out of memory")
    summary["stages"] = {"validate": summary["stages"]["validate"],
                         "reward": {"status": "failed", "error": "reward stage: out of memory\ntraceback ..."}}
    page = render_report(summary, None, {})
    parsed(page)
    assert "<img" not in page
    assert "No gate report" in page and "the policy stage did not run" in page
    assert "<td>reward stage: out of memory</td>" in page  # the failed stage's key figure: its error's first line
    assert '<pre class="error">reward stage: out of memory</pre>' in page


def test_headless_chromium_loads_every_image_and_finds_no_error_nor_outside_link(summary, gate_report, curves,
                                                                                   tmp_path):
    from tests.browser import BrowserMissing, check_page

    page = tmp_path / "report.html"
    page.write_text(render_report(summary, gate_report, curves), encoding="utf-8")
    try:
        shown = check_page(page, screenshot=tmp_path / "report.png")
    except BrowserMissing as exc:
        pytest.fail(str(exc))
    assert len(shown.images) == 2 and shown.broken_images == [], shown.images
    assert shown.console_errors == []
    assert shown.outside_links == [] and shown.requests == []
    assert shown.title == "Run report: demo-20260101T000000Z"
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_SIGNATURE)
