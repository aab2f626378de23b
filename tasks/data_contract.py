"""The preference-data contract on files, with no Prefect or MLflow: read them, run the
Great Expectations suite, write the report. `rlhf validate` calls `check_files` directly (its
answer then takes about as long as Great Expectations does); the pipeline's validate task
(`tasks.data`) runs the same contract, cached and recorded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from rlhf_core.config import PipelineConfig, ValidationConfig
from rlhf_core.data.prepare import Limits, prepare_inputs
from rlhf_core.data.pairs import split_by_prompt
from rlhf_core.data.schema import PREFERENCE_COLUMNS, DataFormatError, fingerprint, read_table
from rlhf_core.data.sources import could_exist
from rlhf_core.data.validation_report import ValidationReport

__all__ = ["DataFormatError", "DataPaths", "DataValidationError", "ValidatedData", "check_files", "contract",
           "could_exist", "failure", "prepare_files", "write_report"]


class DataValidationError(RuntimeError):
    """Preference data broke the contract; training must not start. `report_path` is the
    validation report that lists every check and the offending rows."""

    def __init__(self, message: str, report_path: Path):
        super().__init__(message)
        self.report_path = report_path

    def __reduce__(self):  # Prefect may pickle a task's exception with its state
        return type(self), (str(self), self.report_path)


@dataclass(frozen=True)
class DataPaths:
    preferences: Path
    eval: Path | None
    sft: Path | None  # None: SFT on the preference data's chosen responses
    generated: bool
    prompts: Path | None = None  # the RL prompt set; None: the SFT and preference prompts
    notes: tuple[str, ...] = ()  # what preparing the data did to it (rows truncated or left out)
    feedback: tuple[str, ...] = ()  # the feedback datasets mixed into the preferences
    feedback_served_versions: tuple[str, ...] = ()  # the served versions their answers came from
    labelled: Path | None = None  # answers rated up or down (prompt, completion, desirable): KTO's feedback

    def summary(self) -> dict:
        out = {"status": "prepared", "preferences": str(self.preferences), "notes": list(self.notes)}
        if self.feedback:
            out["feedback"] = list(self.feedback)
        if self.labelled is not None:
            out["labelled"] = str(self.labelled)
        return out

    def lineage(self) -> dict[str, str]:
        """Tags naming the feedback datasets the run trains on, and the versions they rated."""
        if not self.feedback:
            return {}
        return {"feedback.datasets": ",".join(self.feedback),
                "feedback.served_versions": ",".join(self.feedback_served_versions)}


@dataclass(frozen=True)
class PreparedData:
    """The prepared files as the later stages take them: read once, split once. `eval_share` and
    `split_seed` (`reward.eval_share`, `reward.seed`) say which prompts the reward model holds
    out; DPO/KTO hold out the same ones, and without an eval file the gates judge on them."""

    paths: DataPaths
    eval_share: float
    split_seed: int

    @classmethod
    def of(cls, paths: DataPaths, cfg: PipelineConfig) -> "PreparedData":
        return cls(paths, cfg.reward.eval_share, cfg.reward.seed)

    @cached_property
    def pairs(self) -> list[dict]:
        """The preference pairs (prompt, chosen, rejected), in file order."""
        return read_table(self.paths.preferences)[list(PREFERENCE_COLUMNS)].to_dict("records")

    @cached_property
    def split(self) -> tuple[list[dict], list[dict]]:
        """-> (training pairs, held-out pairs): every pair of a prompt on one side."""
        return split_by_prompt(self.pairs, self.eval_share, self.split_seed)

    @cached_property
    def eval_set(self) -> tuple[list[str], list[str] | None]:
        """-> (prompts, answers or None) the gates decide on: the eval file (answers when it has
        an `answer` column), else the distinct prompts of the held-out pairs."""
        if self.paths.eval is not None:
            table = read_table(self.paths.eval)
            return list(table["prompt"]), (list(table["answer"]) if "answer" in table.columns else None)
        return list(dict.fromkeys(r["prompt"] for r in self.split[1])), None


@dataclass(frozen=True)
class ValidatedData(PreparedData):
    """Prepared data that passed the data contract: its fingerprint, rows and report."""

    fingerprint: str
    num_rows: int
    report_path: Path

    def summary(self) -> dict:
        return {"status": "passed", "rows": self.num_rows, "dataset_fingerprint": self.fingerprint,
                "report": str(self.report_path)}


def write_report(report: ValidationReport, out_dir: Path) -> Path:
    """`validation_report.json` and `validation_report.md` in `out_dir`; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "validation_report.json"
    path.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    (out_dir / "validation_report.md").write_text(report.to_markdown())
    return path


def contract(paths: DataPaths, cfg: ValidationConfig) -> ValidationReport:
    """The expectations' verdict on the files (no caching, no recording)."""
    # Great Expectations takes 2 s to import: a run that reuses its validation never loads it
    from rlhf_core.data.validation import validate_preferences  # noqa: PLC0415

    prefs = read_table(paths.preferences)
    evals = read_table(paths.eval) if paths.eval is not None else None
    return validate_preferences(prefs, cfg, eval_df=evals)


def failure(paths: DataPaths, report: ValidationReport, out_dir: Path) -> DataValidationError:
    """The error a failed contract raises: every failed check with its lines, and the report."""
    return DataValidationError(
        f"{paths.preferences}: {len(report.failed)} data check(s) failed\n" + report.failure_message(),
        out_dir / "validation_report.md",
    )


def prepare_files(cfg: PipelineConfig, preferences: str | Path, eval_path: str | Path | None,
                  sft: str | Path | None, prompts: str | Path | None, out_dir: Path,
                  model_dir: str | Path | None = None, labelled: str | Path | None = None) -> DataPaths:
    """The files checked and rendered for the run (`rlhf_core.data.prepare`) into `out_dir`, with
    the tokenizer and context of `model_dir` (the run's pretrained model; None for the demo,
    whose tokenizer is trained later)."""
    tokenizer = context = None
    if model_dir is not None:
        from transformers import AutoConfig  # noqa: PLC0415 - only for a pretrained model

        from rlhf_core.chat import read_chat_template  # noqa: PLC0415
        from rlhf_core.models.pretrained import run_tokenizer  # noqa: PLC0415

        template = read_chat_template(cfg.model.chat_template) if cfg.model.chat_template else None
        tokenizer = run_tokenizer(model_dir, template)
        text = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
        context = getattr(text, "max_position_embeddings", None)
    limits = Limits(cfg.reward.max_length, cfg.reward.on_overlength,
                    None if context is None else context - cfg.policy.max_new_tokens, cfg.data.on_overlength)
    files = prepare_inputs(preferences, eval_path, sft, prompts, tokenizer, limits, out_dir, labelled)
    return DataPaths(files.preferences, files.eval, files.sft, generated=False, prompts=files.prompts,
                     notes=tuple(files.notes), labelled=files.labelled)


def check_files(paths: DataPaths, cfg: PipelineConfig, out_dir: Path) -> ValidatedData:
    """Run the contract on the files and write its report under `out_dir`, without Prefect or
    MLflow: what `rlhf validate` does, in about the time Great Expectations needs. Raises
    `DataValidationError` when a check fails."""
    data_fp = fingerprint([p for p in (paths.preferences, paths.eval) if p is not None])
    report = contract(paths, cfg.validation)
    report_path = write_report(report, out_dir)
    if not report.success:
        raise failure(paths, report, out_dir)
    return ValidatedData(paths, cfg.reward.eval_share, cfg.reward.seed, data_fp, report.num_rows, report_path)
