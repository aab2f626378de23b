"""Prefect tasks for the data stage: materialise the inputs, then validate them.

Validation also reads the gates' regression suites (`gates.regression_suites`; the demo's are
generated here): a missing file or a bad row fails the stage, by file and line, before
anything trains.

The data contract (Great Expectations) is cached on the dataset fingerprint and the
`validation` settings: a nightly run on the same data reuses the report instead of
re-running every expectation, and still records its own validate run, tags and report.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from rlhf_core.config import PipelineConfig, ValidationConfig
from rlhf_core.data.demo_task import demo_settings_misfit
from rlhf_core.data.schema import LINE_COLUMN, fingerprint, prompt_key, read_table, write_jsonl
from rlhf_core.data.sources import read_source
from rlhf_core.data.synthetic import generate_demo_data
from rlhf_core.data.validation_report import ValidationReport
from rlhf_core.eval.regression import RegressionSuite
from rlhf_core.feedback.mix import data_format, labelled_answers, mix, recent_exports
from tasks.data_contract import (
    DataFormatError, DataPaths, DataValidationError, PreparedData, ValidatedData, check_files, contract, failure, prepare_files,
    write_report,
)
from tasks.feedback import export_root
from tasks.pretrained import PretrainedBase
from tasks.tracking import PipelineRun, stage_run


__all__ = ["DataFormatError", "DataPaths", "DataValidationError", "PreparedData", "ValidatedData", "check_files",
           "prepare_data", "validate_data"]


@task(name="prepare-data")
def prepare_data(cfg: PipelineConfig, out_dir: Path, pretrained: PretrainedBase | None = None) -> DataPaths:
    """The configured data checked and rendered (`rlhf_core.data.prepare`), or the embedded demo
    task generated under `out_dir/data`; with `feedback.use`, the recent feedback datasets
    mixed into the preference data first."""
    logger = get_run_logger()
    exports = recent_exports(export_root(cfg), cfg.feedback.recency_days) if cfg.feedback.use else []
    if cfg.feedback.use and not exports:
        logger.warning("feedback.use is on but %s holds no feedback dataset from the last %s days",
                       export_root(cfg), cfg.feedback.recency_days)
    # KTO also learns from the thumbs: single answers rated up or down
    answers_too = bool(exports) and cfg.policy.algorithm == "kto"
    if cfg.data.preferences_path is not None:
        d = cfg.data
        preferences, labelled = _with_feedback(d.preferences_path, exports, cfg, out_dir / "data" / "raw", answers_too)
        paths = prepare_files(cfg, preferences, d.eval_path, d.sft_path, d.prompts_path, out_dir / "data",
                              pretrained.policy if pretrained is not None else None, labelled)
        for note in paths.notes:
            logger.warning("%s", note)
        misfit = demo_settings_misfit(cfg.policy.verifiable_reward, [s.path for s in cfg.gates.regression_suites],
                                      list(read_source(d.preferences_path).get("prompt", [])),
                                      f"data.preferences_path ({d.preferences_path})")
        if misfit:
            raise ValueError("demo-only settings meet your data (the demo is `rlhf demo`; `rlhf run` without "
                             "--config trains on configs/own-data.yaml):\n  " + "\n  ".join(misfit))
    else:
        files = generate_demo_data(cfg.data.demo, out_dir / "data")
        logger.info("generated demo data under %s", files.preferences.parent)
        preferences, labelled = _with_feedback(files.preferences, exports, cfg, out_dir / "data", answers_too)
        paths = DataPaths(Path(preferences), files.eval, files.sft, generated=True, labelled=labelled)
    if not exports:
        return paths
    if paths.labelled is not None and paths.eval is not None:
        _leave_out_eval_prompts(paths.labelled, paths.eval)
    served = sorted({v for e in exports for v in e.served_versions}, key=lambda v: (len(v), v))
    return replace(paths, feedback=tuple(e.version for e in exports), feedback_served_versions=tuple(served))


def _with_feedback(preferences: str | Path, exports, cfg: PipelineConfig, out_dir: Path,
                   answers_too: bool) -> tuple[str | Path, Path | None]:
    """-> (the preference data, the rated answers). Without feedback datasets: `preferences`
    itself and no answers. Else, in `out_dir`: a JSONL of its rows followed by the feedback pairs
    (`rlhf_core.feedback.mix`), and with `answers_too` a JSONL of the thumbs
    (`rlhf_core.feedback.mix.labelled_answers`) in the base data's format."""
    if not exports:
        return preferences, None
    logger = get_run_logger()
    for export in exports:  # what each export kept and dropped, and how far its raters agree
        for line in export.report:
            logger.info("feedback %s: %s", export.version, line)
    base = read_source(preferences).drop(columns=[LINE_COLUMN], errors="ignore").to_dict("records")
    mixed = mix(base, exports, cfg.feedback.weight, seed=cfg.data.demo.seed, where=str(preferences))
    logger.info("training on %d base pairs and %s feedback pairs (%d feedback pairs left out: already in the "
                "data)", len(base), mixed.taken, mixed.already_present)
    mixed_path = write_jsonl(mixed.rows, out_dir / "preferences-with-feedback.jsonl")
    if not answers_too:
        return mixed_path, None
    answers = labelled_answers(exports, cfg.feedback.weight, seed=cfg.data.demo.seed, base_format=data_format(base),
                               where=str(preferences))
    logger.info("KTO: %s answers rated up or down taken from the feedback (left out: %d rated both ways, %d "
                "blank)", answers.taken, answers.contradictory, answers.blank)
    return mixed_path, write_jsonl(answers.rows, out_dir / "labelled-answers.jsonl")


def _leave_out_eval_prompts(labelled: Path, eval_path: Path) -> None:
    """Rewrite `labelled` without the answers to eval prompts (compared with runs of whitespace
    collapsed, as the data contract's leakage check does): a user asking an eval question must
    not put its answer into training."""
    evals = {prompt_key(p) for p in read_table(eval_path)["prompt"]} - {None}
    rows = read_table(labelled).to_dict("records")
    kept = [r for r in rows if prompt_key(r["prompt"]) not in evals]
    if len(kept) < len(rows):
        get_run_logger().warning("%d rated answers left out of %s: their prompts are eval prompts",
                                 len(rows) - len(kept), labelled)
        write_jsonl(kept, labelled)


def _publish(report: ValidationReport, out_dir: Path, title: str) -> Path:
    path = write_report(report, out_dir)
    create_markdown_artifact(key="data-validation-report", markdown=f"# {title}\n\n{report.to_markdown()}",
                             description="Preference-data validation (Great Expectations)")
    return path


# Bump when the expectations or the report's shape change: old cached reports then stop matching.
CONTRACT_CACHE_VERSION = 2


def _contract_key(context, parameters: dict) -> str:
    inputs = {"version": CONTRACT_CACHE_VERSION, "fingerprint": parameters["data_fingerprint"],
              "validation": parameters["cfg"].model_dump(mode="json")}
    return "contract-" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


@task(name="check-data-contract", cache_key_fn=_contract_key, persist_result=True, cache_expiration=timedelta(days=30))
def check_data_contract(data_fingerprint: str, paths: DataPaths, cfg: ValidationConfig) -> ValidationReport:
    """The expectations' verdict on the data whose fingerprint is `data_fingerprint`."""
    return contract(paths, cfg)


def check_regression_suites(data: ValidatedData, cfg: PipelineConfig, out_dir: Path) -> list[RegressionSuite]:
    """The gates' regression suites read and checked as the evaluate stage will read them (the
    demo's generated without the eval prompts); raises `SuiteFormatError` naming file and line."""
    if not cfg.gates.regression_suites:
        return []
    from tasks.evaluate import regression_suites  # noqa: PLC0415 - loads the model stack

    return regression_suites(cfg, out_dir, data.eval_set[0])


@task(name="validate-data")
def validate_data(paths: DataPaths, cfg: PipelineConfig, run: PipelineRun) -> ValidatedData:
    """Run the data contract; record the report in MLflow and Prefect; raise when it fails."""
    data_fp = fingerprint([p for p in (paths.preferences, paths.eval, paths.prompts, paths.labelled) if p is not None])
    with stage_run(run, "validate", {"dataset.fingerprint": data_fp}) as stage_id:
        client = run.client
        client.set_tag(run.run_id, "dataset.fingerprint", data_fp)
        for key, value in paths.lineage().items():  # the feedback datasets mixed in
            client.set_tag(run.run_id, key, value)
            client.set_tag(stage_id, key, value)
        report = check_data_contract(data_fp, paths, cfg.validation)
        report_path = _publish(report, run.out_dir, f"Validation of {paths.preferences.name}")
        client.log_artifact(stage_id, str(report_path))
        client.log_artifact(stage_id, str(run.out_dir / "validation_report.md"))
        client.log_metric(stage_id, "validate/rows", report.num_rows)
        client.log_metric(stage_id, "validate/failed_checks", len(report.failed))
        client.set_tag(stage_id, "validation.verdict", "passed" if report.success else "failed")
        if not report.success:
            raise failure(paths, report, run.out_dir)
        data = ValidatedData(paths, cfg.reward.eval_share, cfg.reward.seed, data_fp, report.num_rows, report_path)
        suites = check_regression_suites(data, cfg, run.out_dir)
        if suites:
            get_run_logger().info("regression suites: %s", ", ".join(f"{s.name} ({len(s.prompts)} rows, {s.path})"
                                                                      for s in suites))
    return data
