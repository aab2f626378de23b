"""Prefect tasks for the evaluation gates and the registration of a passing candidate.

`evaluate_candidate` answers the held-out prompts with the candidate, the reference (SFT)
policy and the current champion, and applies `rlhf_core.eval.gates.gate`. The decision
goes to MLflow (metrics `eval/...`, `gate/passed`, tags `gate.*`), to the Prefect table
artifact `gate-decision`, and to `gate_report.json` in the run's output directory. Every
policy also answers the regression suites (`gates.regression_suites`; the demo's generated
into `<run>/data`); the report names each suite with the accuracies and the interval.

`register_candidate` turns a passing candidate into a version of the config's registered
policy model (`tracking.registered_model`, default `policy`) with its lineage,
gate report and model card (`README.md` in its model directory, `rlhf_core.eval.model_card`),
gives it the alias `challenger`, and promotes it to `champion` when `gates.auto_promote` is
on. An undecided candidate is registered too, with no alias and tagged `gate.status=undecided`,
so that a person can have the gates look at more rows (`rlhf evaluate VERSION --set ...`,
`undecided_next_steps`) or promote it past them with a reason. A rejected candidate is not
registered: the pipeline ends with status `rejected` and the reasons (see `flows.pipeline`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.fault_injection import fault_point
from rlhf_core.distributed.stage_task import run_stage_task
from rlhf_core.eval.evaluate import EvalResult
from rlhf_core.eval.gate_models import GateModels, evaluate_on
from rlhf_core.eval.gates import Decision, gate
from rlhf_core.eval.model_card import base_model_of, render_model_card, training_settings
from rlhf_core.eval.regression import RegressionSuite, load_suites, rendered, suite_report
from rlhf_core.models.reward import current_audit_dir
from rlhf_core.tokenizer import load_tokenizer
from tasks.registry import (
    CHALLENGER, CHAMPION, by_alias, fetch_version, get_version, promote, register_model_version,
)
from tasks.tracking import PipelineRun, stage_run


@dataclass(frozen=True)
class Candidate:
    """What is evaluated, and where it comes from (lineage for the registry)."""

    model_dir: Path
    reference_dir: Path  # the SFT policy RL started from
    reward_dir: Path
    audit_dir: Path | None  # the audit model that judges it (the policy stage's, else the reward stage's); None: none
    lineage: dict[str, str]  # dataset.fingerprint, base_model.run_id, reward_model.version, policy.run_id, ...


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    result: EvalResult
    decision: Decision
    champion_version: str | None
    run_id: str  # the evaluate stage's MLflow run
    report_path: Path
    suites: tuple[RegressionSuite, ...] = ()

    @property
    def passed(self) -> bool:
        return self.decision.passed

    def summary(self) -> dict:
        c = self.result.candidate.figures
        return {
            "status": self.decision.status,
            "accuracy": c.accuracy, "reference_accuracy": self.result.reference.figures.accuracy,
            "win_rate_vs_reference": round(c.win_rate_vs_reference, 3),
            "kl_to_reference": round(c.kl_to_reference, 3),
            "champion": self.champion_version,
            **({"regression": self.regression_summary()} if self.suites else {}),
            **({"reasons": list(self.decision.reasons)} if self.decision.reasons else {}),
            **({"undecided": list(self.decision.undecided)} if self.decision.undecided else {}),
            "report": str(self.report_path),
        }

    def regression_summary(self) -> dict[str, dict]:
        """Per suite: the candidate's and the reference's accuracy, the rows answered, and the
        interval of the difference at the last look (to 4 decimals)."""
        r = self.result
        rows = suite_report(self.suites, r.candidate.figures, r.reference.figures,
                            None if r.champion is None else r.champion.figures)
        def rounded(interval: dict | None) -> dict | None:
            return None if interval is None else {k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in interval.items()}

        return {row["name"]: {"accuracy": row["candidate"], "reference_accuracy": row["reference"], "rows": row["rows"],
                              "diff_vs_reference": rounded(row["diff_vs_reference"])} for row in rows}


def regression_suites(cfg: PipelineConfig, out_dir: Path, eval_prompts: list[str],
                      tokenizer_dir: Path | None = None) -> list[RegressionSuite]:
    """The configured regression suites, read and checked (`SuiteFormatError` naming file and line);
    the demo's are generated into `out_dir/data`, without the eval prompts. With `tokenizer_dir`
    (the reference policy's) conversational prompts are rendered by its chat template."""
    suites = load_suites(cfg.gates.regression_suites, out_dir / "data", cfg.data.demo, exclude=eval_prompts)
    if tokenizer_dir is None or not suites:
        return suites
    tokenizer = load_tokenizer(tokenizer_dir)
    return [rendered(s, tokenizer) for s in suites]


def _report_json(ev_result: EvalResult, decision: Decision, candidate: Candidate, champion: str | None, cfg,
                 suites: list[RegressionSuite]) -> dict:
    def policy(report):
        if report is None:
            return None
        return {"figures": {**asdict(report.figures), "length_ratio": report.figures.length_ratio},
                "length": report.length, "failed_prompts": report.failed_prompts,
                "samples": [{"prompt": p, "answer": a} for p, a in report.samples]}

    return {
        "decision": decision.to_dict(),
        "thresholds": cfg.gates.model_dump(mode="json"),
        "num_prompts": ev_result.num_prompts,
        "eval_looks": [asdict(look) for look in ev_result.looks],
        "candidate": {"model_dir": str(candidate.model_dir), **policy(ev_result.candidate)},
        "reference": {"model_dir": str(candidate.reference_dir), **policy(ev_result.reference)},
        "champion": None if champion is None else {"version": champion, **policy(ev_result.champion)},
        "regression_suites": suite_report(
            suites, ev_result.candidate.figures, ev_result.reference.figures,
            None if ev_result.champion is None else ev_result.champion.figures),
        "lineage": candidate.lineage,
    }


def _publish_decision(decision: Decision, champion: str | None) -> None:
    rows = [
        {"check": c.name, "observed": "–" if c.observed is None else f"{c.observed:.4g}",
         "interval": "–" if c.low is None else f"[{c.low:.4g}, {c.high:.4g}]",
         "threshold": "–" if c.threshold is None else f"{c.op} {c.threshold:.4g}",
         "result": f"skipped ({c.skipped})" if c.skipped else "undecided" if c.undecided else (
             "pass" if c.passed else "FAIL")}
        for c in decision.checks
    ]
    verdict = {"passed": "passed", "rejected": "rejected: " + "; ".join(decision.reasons),
               "undecided": "undecided: " + "; ".join(decision.undecided)}[decision.status]
    vs = f"champion v{champion}" if champion else "no champion yet"
    create_table_artifact(key="gate-decision", table=rows, description=f"Gate {verdict} (vs reference and {vs})")


@task(name="evaluate-candidate")
def evaluate_candidate(
    candidate: Candidate, prompts: list[str], answers: list[str] | None, cfg: PipelineConfig, run: PipelineRun
) -> Evaluation:
    log = get_run_logger()
    client, name = run.client, cfg.tracking.registered_model
    champion = by_alias(client, CHAMPION, name)
    champion_version = None if champion is None else str(champion.version)
    with stage_run(run, "evaluate", {**candidate.lineage, "champion.version": champion_version or ""}) as stage_id:
        champion_dir = None
        if champion is not None:
            champion_dir = fetch_version(run.tracking_uri, champion_version, run.out_dir / "champion", name)
        suites = regression_suites(cfg, run.out_dir, prompts, tokenizer_dir=candidate.reference_dir)
        models = GateModels(candidate.model_dir, candidate.reference_dir, candidate.reward_dir, champion_dir,
                            candidate.audit_dir)
        # where the policy stage trains: on a GPU where there is one, so the gates take minutes, not hours
        result, where = run_stage_task("evaluate", evaluate_on, models, prompts, answers, cfg, suites,
                                       use_gpu=cfg.policy.use_gpu, settings="policy")
        client.set_tag(stage_id, "evaluate.device", where)
        decision = gate(
            result.candidate.figures, result.reference.figures,
            None if result.champion is None else result.champion.figures, cfg.gates,
        )
        report = _report_json(result, decision, candidate, champion_version, cfg, suites)
        report_path = run.out_dir / "gate_report.json"
        tmp = report_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(tmp, report_path)
        client.log_artifact(stage_id, str(report_path))
        for key, value in {**result.metrics(), "gate/passed": float(decision.passed)}.items():
            client.log_metric(stage_id, key, value)
        for target in (stage_id, run.run_id):
            client.set_tag(target, "gate.passed", str(decision.passed).lower())
            client.set_tag(target, "gate.status", decision.status)
            client.set_tag(target, "gate.reasons", "; ".join((*decision.reasons, *decision.undecided))[:5000])
        _publish_decision(decision, champion_version)
        log.info("gate %s: %s", decision.status.upper(),
                 "; ".join((*decision.reasons, *decision.undecided)) or "every check passed")
    return Evaluation(candidate, result, decision, champion_version, stage_id, report_path, tuple(suites))


@dataclass(frozen=True)
class Registration:
    version: str
    promoted: bool
    previous_champion: str | None

    aliased: bool = True  # False: undecided, registered without an alias

    def summary(self) -> dict:
        status = "promoted" if self.promoted else "challenger" if self.aliased else "undecided"
        return {"status": status, "version": self.version,
                "aliases": [CHAMPION] if self.promoted else [CHALLENGER] if self.aliased else [],
                "previous_champion": self.previous_champion}


def _write_model_card(evaluation: Evaluation, cfg: PipelineConfig, run: PipelineRun) -> Path:
    """The candidate's model card (`rlhf_core.eval.model_card`), written atomically to
    `<run>/model_card/README.md`."""
    lineage = evaluation.candidate.lineage
    pretrained = cfg.model.pretrained
    # the run's copy of a pretrained model (tasks.pretrained) links its README, a hub model's too
    readme_dirs = [] if pretrained is None else [run.out_dir / "models" / "base", Path(pretrained)]
    base = base_model_of(pretrained, cfg.sft.enabled, lineage["base_model.run_id"], readme_dirs)
    report = json.loads(evaluation.report_path.read_text())
    card = render_model_card(report, lineage, training_settings(cfg.policy), base, eval_run_id=evaluation.run_id)
    path = run.out_dir / "model_card" / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("README.md.tmp")
    tmp.write_text(card)
    os.replace(tmp, path)
    return path


@task(name="register-candidate")
def register_candidate(evaluation: Evaluation, cfg: PipelineConfig, run: PipelineRun) -> Registration:
    """Register a passing candidate as a version of `tracking.registered_model` (alias
    `challenger`) and promote it if configured; an undecided one with no alias."""
    if evaluation.decision.status == "rejected":
        raise ValueError("a rejected candidate is never registered")  # the flow does not call this then
    log = get_run_logger()
    client, name = run.client, cfg.tracking.registered_model
    lineage = evaluation.candidate.lineage
    c = evaluation.result.candidate.figures
    client.log_artifact(lineage["policy.run_id"], str(evaluation.report_path), artifact_path="gate")
    # model/README.md: the card travels with the files the version's source points at (a re-run overwrites it)
    client.log_artifact(lineage["policy.run_id"], str(_write_model_card(evaluation, cfg, run)), artifact_path="model")
    tags = {
        **lineage, "eval.run_id": evaluation.run_id, "gate.passed": str(evaluation.passed).lower(),
        "gate.status": evaluation.decision.status,
        **({"gate.reasons": "; ".join(evaluation.decision.undecided)[:5000]} if evaluation.decision.undecided else {}),
        "gate.report": f"runs:/{lineage['policy.run_id']}/gate/{evaluation.report_path.name}",
        "gate.vs_champion": evaluation.champion_version or "none",
        "eval.accuracy": "" if c.accuracy is None else f"{c.accuracy:.4f}",
        "eval.win_rate_vs_reference": f"{c.win_rate_vs_reference:.4f}",
        "eval.kl_to_reference": f"{c.kl_to_reference:.4f}",
    }
    version = register_model_version(
        client, name, lineage["policy.run_id"], "model", tags,
        description=f"{lineage.get('algorithm', 'RL')} policy; gate {evaluation.decision.status} vs "
                    f"{'champion v' + evaluation.champion_version if evaluation.champion_version else 'reference only'}",
    )
    client.set_tag(run.run_id, "registered_model", f"{name}/{version}")
    if not evaluation.passed:
        log.info("%s v%s is registered undecided, with no alias: %s", name, version,
                 "; ".join(evaluation.decision.undecided))
        return Registration(version, False, None, aliased=False)
    client.set_registered_model_alias(name, CHALLENGER, version)
    previous = None
    promoted = False
    if canary_first(cfg, evaluation.champion_version):
        log.info("%s v%s is the %s and starts as a canary beside champion v%s (serving.canary.enabled)", name,
                 version, CHALLENGER, evaluation.champion_version)
    elif cfg.gates.auto_promote:
        fault_point("register:promote")
        promotion = promote(client, version, requested_by=f"pipeline:{run.run_id}", reason="gates.auto_promote",
                            name=name, expected_champion=evaluation.champion_version)  # the one it was judged against
        promoted, previous = True, promotion.previous
        log.info("%s v%s promoted to %s (previous champion: %s)", name, version, CHAMPION, previous or "none")
    else:
        log.info("%s v%s is the %s; promote it with `rlhf promote %s` or in the MLflow UI", name, version, CHALLENGER, version)
    return Registration(version, promoted, previous)


def canary_first(cfg: PipelineConfig, champion_version: str | None) -> bool:
    """Whether a candidate that passed starts as a canary instead of being promoted: with
    `serving.canary.enabled`, served here, and a champion to serve beside."""
    return cfg.serving.canary.enabled and cfg.serving.enabled and champion_version is not None


def undecided_next_steps(evaluation: Evaluation, version: str, config_path: str | None) -> dict[str, str]:
    """What a person can do about an undecided candidate registered as `version`: the command
    that has the gates look at more rows (twice the rows of each suite whose looks ended
    undecided, twice the eval prompts looked at when a call on them is open), what to add when
    the eval set has no more prompts to look at, and the command that promotes it past the
    gates with the reason recorded. `config_path`: the run's, named unless None."""
    result = evaluation.result
    more = [f"gates.regression_suites.{i}.max_rows={2 * suite.looks[-1].rows}"
            for i, suite in enumerate(result.candidate.figures.regression)
            if suite.looks and suite.looks[-1].stopped != "decided"]
    spent = bool(result.looks) and result.looks[-1].stopped.startswith("the eval set has no more prompts")
    eval_open = [c.name for c in evaluation.decision.checks if c.undecided and not c.name.startswith("regression_")]
    if eval_open and not spent:
        more.append(f"gates.max_eval_prompts={2 * result.num_prompts}")
    config = [] if config_path is None else [f"--config {config_path}"]
    steps = {"look at more rows": " ".join(["rlhf evaluate", version, *config, *(f"--set {m}" for m in more)])}
    if eval_open and spent:
        steps["add eval prompts"] = (f"all {result.num_prompts} prompts of the eval set left {', '.join(eval_open)} "
                                     "open: add held-out rows to it (data.eval_path), then look again")
    return steps | {"or promote it anyway": " ".join(["rlhf promote", version, *config, '--force --reason "..."'])}


LINEAGE_TAGS = ("dataset.fingerprint", "base_model.run_id", "reward_model.version", "policy.run_id", "algorithm",
                "feedback.datasets", "feedback.served_versions")


@dataclass(frozen=True)
class RegisteredCandidate:
    """A registered policy version, downloaded with its reference policy and reward model."""

    version: str
    candidate: Candidate


@task(name="fetch-registered-candidate", retries=2, retry_delay_seconds=2)
def fetch_registered_candidate(name_or_alias: str, cfg: PipelineConfig, run: PipelineRun) -> RegisteredCandidate:
    """Download a version (number or alias) of `tracking.registered_model`, the SFT policy it
    started from and the reward model it was trained against, under the run's output directory."""
    client, name = run.client, cfg.tracking.registered_model
    version = get_version(client, name_or_alias, name)
    tags = version.tags
    reference_dir = run.out_dir / "reference"
    if not reference_dir.exists():
        client.download_artifacts(tags["base_model.run_id"], "model", str(run.out_dir))
        (run.out_dir / "model").rename(reference_dir)
    model_dir = fetch_version(run.tracking_uri, str(version.version), run.out_dir / "candidate", name)
    reward_dir = fetch_version(run.tracking_uri, tags["reward_model.version"], run.out_dir / "reward",
                               cfg.tracking.registered_reward_model)
    candidate = Candidate(model_dir, reference_dir, reward_dir, current_audit_dir(model_dir, reward_dir),
                          {k: v for k, v in tags.items() if k in LINEAGE_TAGS} | {"pipeline.run_id": run.run_id})
    return RegisteredCandidate(str(version.version), candidate)


@task(name="record-gate-verdict", retries=2, retry_delay_seconds=2)
def record_gate_verdict(version: str, evaluation: Evaluation, cfg: PipelineConfig, run: PipelineRun) -> None:
    """Tag the registered version with the verdict (`gate.*`), so `rlhf promote` can refuse it."""
    client = run.client
    for key, value in {"gate.passed": str(evaluation.passed).lower(),
                       "gate.status": evaluation.decision.status,
                       "gate.reasons": "; ".join((*evaluation.decision.reasons, *evaluation.decision.undecided)),
                       "gate.vs_champion": evaluation.champion_version or "none",
                       "eval.run_id": evaluation.run_id}.items():
        client.set_model_version_tag(cfg.tracking.registered_model, version, key, value)
