"""The model card of a registered `policy` version: the README.md of its model directory.

Whoever downloads a version reads there, without MLflow, where it comes from and why it was
let through. `render_model_card` builds it from what the pipeline already recorded: the gate
report (`gate_report.json`, as `tasks.evaluate` writes it), the lineage tags, the training
settings (`training_settings`) and the base model with its license (`base_model_of`). The
front matter is Hugging Face's model card metadata (`license`, `base_model`, `library_name`,
`pipeline_tag`, `tags`, `datasets`) plus an `rlhf` block with the fingerprints and MLflow runs;
the Markdown holds the gate verdict with every check's figures and interval, the regression
suites, the settings, the data and the runs.

The license is inherited: a pretrained base's README names it in its front matter
(`read_license`), else it is `unknown`; the demo's model is built from scratch here and carries
the project's license, or `other` with a sentence while the project names none.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.config import PolicyConfig
from rlhf_core.eval.checks import Check, Decision, fmt

PROJECT = "rlhf-pipeline"
UNKNOWN_LICENSE = "unknown"
SCRATCH_LICENSE_NOTE = (
    "The model is built and trained from scratch by this pipeline (no pretrained weights), and the "
    "project names no license for what it produces: ask its owners before you redistribute it.")
_ALGORITHMS = {"ppo": "PPO", "grpo": "GRPO", "dpo": "DPO", "kto": "KTO"}


@dataclass(frozen=True)
class BaseModel:
    """What a policy was trained from, for the card."""

    name: str  # front matter `base_model`: the pretrained model's hub id or path, else runs:/<sft run>/model
    description: str  # one sentence for the Markdown
    license: str  # a Hugging Face license id, `unknown` or `other`
    license_note: str  # where the license comes from


def read_license(model_dir: str | Path) -> str | None:
    """The `license:` of a Hugging Face model directory's README.md front matter; None when
    there is no README, no front matter, no such key, or the front matter is not YAML."""
    readme = Path(model_dir) / "README.md"
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    end = next((i for i, line in enumerate(lines[1:], start=1) if line.strip() == "---"), None)
    if end is None:
        return None
    try:
        meta = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return None if value in (None, "") else str(value)


def project_license() -> str | None:
    """The license this project's package metadata names (pyproject's `license`), if any."""
    try:
        meta = metadata.metadata(PROJECT)
    except metadata.PackageNotFoundError:
        return None
    return meta.get("License-Expression") or meta.get("License") or None


def base_model_of(pretrained: str | None, sft_enabled: bool, sft_run_id: str,
                  readme_dirs: Sequence[Path] = ()) -> BaseModel:
    """The base model of a run: `model.pretrained` (license from the first of `readme_dirs`
    whose README names one), else the demo's model trained from scratch by the SFT run."""
    sft = f"MLflow run `{sft_run_id}`"
    if pretrained is None:
        own = project_license()
        return BaseModel(
            f"runs:/{sft_run_id}/model",
            f"The demo's Llama-architecture model, built and trained from scratch by this pipeline's SFT stage "
            f"({sft}); it is also the reference policy.",
            own or "other",
            "The model is trained from scratch by this project and carries its license." if own else
            SCRATCH_LICENSE_NOTE)
    how = (f"fine-tuned with SFT by this pipeline ({sft}), which is the reference policy" if sft_enabled else
           f"as it is, without SFT ({sft}); it is also the reference policy")
    found = next((lic for lic in map(read_license, readme_dirs) if lic), None)
    note = (f"Inherited from the base model `{pretrained}` (the front matter of its README.md)." if found else
            f"The base model `{pretrained}` names no license in its README.md front matter: check its terms "
            "before you use or redistribute this model.")
    return BaseModel(pretrained, f"`{pretrained}`, {how}.", found or UNKNOWN_LICENSE, note)


def training_settings(policy: PolicyConfig) -> dict[str, Any]:
    """The settings that say how the policy was trained, keyed by their path in the config."""
    p = policy
    out: dict[str, Any] = {"policy.algorithm": p.algorithm, "policy.seed": p.seed}
    if p.offline is not None:  # DPO, KTO: passes over the labels, no rollouts
        out |= {f"policy.{p.algorithm}.{k}": v for k, v in p.offline.model_dump().items()}
    else:
        out |= {f"policy.{k}": getattr(p, k) for k in (
            "steps", "prompts_per_step", "epochs_per_step", "minibatch_size", "learning_rate", "max_grad_norm",
            "kl_coef", "kl_estimator", "entropy_coef", "temperature", "max_new_tokens", "reward_model_weight",
            "verifiable_reward", "verifiable_reward_weight")}
        if p.adaptive_kl_target is not None:
            out |= {"policy.adaptive_kl_target": p.adaptive_kl_target,
                    "policy.adaptive_kl_horizon": p.adaptive_kl_horizon}
        section = p.ppo if p.algorithm == "ppo" else p.grpo
        out |= {f"policy.{p.algorithm}.{k}": v for k, v in section.model_dump().items()}
        out |= {f"policy.shaping.{k}": v for k, v in p.shaping.model_dump(exclude_defaults=True).items()}
        if p.pipeline.max_lag > 0:
            out |= {"policy.pipeline.max_lag": p.pipeline.max_lag, "policy.pipeline.is_cap": p.pipeline.is_cap}
        if p.rounds.enabled:
            out |= {f"policy.rounds.{k}": getattr(p.rounds, k) for k in ("every", "prompts", "annotator")}
    if p.lora.enabled:
        out |= {f"policy.lora.{k}": v for k, v in p.lora.model_dump().items() if k != "enabled"}
    return out


def render_model_card(report: Mapping[str, Any], lineage: Mapping[str, str], settings: Mapping[str, Any],
                      base: BaseModel, eval_run_id: str | None = None) -> str:
    """The README.md of a registered version: YAML front matter, then the Markdown card.

    report: the gate report dict (`gate_report.json`); lineage: the version's lineage tags
    (`dataset.fingerprint`, `base_model.run_id`, `reward_model.version`, `policy.run_id`,
    `pipeline.run_id`, `algorithm`, `feedback.*`); settings: `training_settings`;
    eval_run_id: the evaluation stage's MLflow run.
    """
    algorithm = lineage.get("algorithm") or str(settings.get("policy.algorithm", "rl"))
    name = _ALGORITHMS.get(algorithm, algorithm)
    front_matter = yaml.safe_dump(_front_matter(report, lineage, settings, base, algorithm, eval_run_id),
                                  sort_keys=False)
    sections = [
        f"# policy ({name})",
        (f"A causal language model trained with {name} by the rlhf-pipeline and registered in MLflow as `policy` "
         "after it passed the promotion gates. It loads with `AutoModelForCausalLM.from_pretrained` on this "
         "directory and needs no custom code."),
        "## Base model\n\n" + _base_section(base, lineage, algorithm),
        "## Training data\n\n" + _data_section(lineage),
        "## Training\n\n" + _table(["setting", "value"], [[f"`{k}`", _value(v)] for k, v in settings.items()]),
        "## Gate verdict\n\n" + _gate_section(report),
        "## Regression suites\n\n" + _suites_section(report),
        "## Provenance\n\n" + _provenance_section(lineage, eval_run_id),
        f"## License\n\n`{base.license}`. {base.license_note}",
    ]
    return f"---\n{front_matter}---\n\n" + "\n\n".join(sections) + "\n"


def _front_matter(report: Mapping[str, Any], lineage: Mapping[str, str], settings: Mapping[str, Any],
                  base: BaseModel, algorithm: str, eval_run_id: str | None) -> dict[str, Any]:
    feedback = _feedback(lineage)
    lora = any(k.startswith("policy.lora.") for k in settings)
    mlflow_runs = {"policy_run_id": lineage.get("policy.run_id"), "pipeline_run_id": lineage.get("pipeline.run_id"),
                   "eval_run_id": eval_run_id, "reference_run_id": lineage.get("base_model.run_id")}
    return {
        "license": base.license,
        "base_model": base.name,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["rlhf", algorithm, *(["lora"] if lora else [])],
        "datasets": [d for d in (lineage.get("dataset.fingerprint"), *feedback) if d],
        "rlhf": {
            "gate": report["decision"]["status"],
            "dataset_fingerprint": lineage.get("dataset.fingerprint"),
            "feedback_datasets": feedback,
            "reward_model_version": lineage.get("reward_model.version"),
            "mlflow": {k: v for k, v in mlflow_runs.items() if v},
        },
    }


def _base_section(base: BaseModel, lineage: Mapping[str, str], algorithm: str) -> str:
    lines = [f"- Base model: `{base.name}`. {base.description}"]
    if "reward_model.version" in lineage:
        trained = " the policy trained against it, and" if algorithm in ("ppo", "grpo") else ""
        lines.append(f"- Reward model: `reward-model` version {lineage['reward_model.version']} (registered in "
                     f"MLflow):{trained} the gates scored the answers with it.")
    return "\n".join(lines)


def _data_section(lineage: Mapping[str, str]) -> str:
    lines = [(f"- Preference dataset: fingerprint `{lineage.get('dataset.fingerprint', 'unknown')}` (the "
              "validated data the reward model and the policy trained on).")]
    feedback = _feedback(lineage)
    if feedback:
        served = lineage.get("feedback.served_versions", "")
        lines.append(f"- Feedback datasets mixed in: {', '.join(f'`{d}`' for d in feedback)}"
                     + (f" (answers served by policy version {served})." if served else "."))
    else:
        lines.append("- Feedback datasets: none.")
    return "\n".join(lines)


def _gate_section(report: Mapping[str, Any]) -> str:
    t, d = report.get("thresholds", {}), report["decision"]
    champion = report.get("champion")
    against = (f"the reference policy and the champion, `policy` version {champion['version']}" if champion else
               "the reference policy (there was no champion yet)")
    level = t.get("confidence")
    intervals = (f"Intervals are {level:.0%} paired bootstrap intervals over the prompts "
                 f"({t.get('bootstrap_samples')} resamples); a check with an interval is decided on it, one "
                 "without on the observed value." if level else
                 "Without intervals (`gates.confidence` is null): every check compares the observed value.")
    decision = Decision(passed=d["passed"], reasons=tuple(d["reasons"]), undecided=tuple(d["undecided"]),
                        checks=tuple(Check(**c) for c in d["checks"]))
    return "\n\n".join([
        f"Judged on {report.get('num_prompts')} held-out prompts against {against}. "
        + intervals,
        decision.to_markdown(),
        "Figures of each policy on the same prompts:",
        _figures_table(report),
    ])


def _figures_table(report: Mapping[str, Any]) -> str:
    policies = [("candidate (this model)", report["candidate"]), ("reference", report["reference"])]
    if report.get("champion"):
        policies.append((f"champion (v{report['champion']['version']})", report["champion"]))
    keys = ("accuracy", "win_rate_vs_reference", "kl_to_reference", "mean_length", "degenerate_rate",
            "rm_score_mean", "audit_score_mean")
    return _table(["policy", *keys], [[name, *(fmt(p["figures"].get(k)) for k in keys)] for name, p in policies])


def _suites_section(report: Mapping[str, Any]) -> str:
    suites = report.get("regression_suites") or []
    if not suites:
        return "None configured (`gates.regression_suites`)."
    rows = [[s["name"], str(s["rows"]), f"`{s['checker']}`", fmt(s["margin"]), fmt(s["candidate"]),
             fmt(s["reference"]), fmt(s.get("champion")), _interval(s.get("diff_vs_reference")),
             _interval(s.get("diff_vs_champion"))] for s in suites]
    table = _table(["suite", "rows", "checker", "margin", "candidate", "reference", "champion",
                    "candidate − reference", "candidate − champion"], rows)
    return ("Accuracy on each suite, and the paired interval of the candidate's accuracy minus the other policy's; "
            "the gate rejects a drop beyond the margin (checks `regression_vs_reference:<suite>`, "
            "`regression_vs_champion:<suite>` above).\n\n" + table)


def _provenance_section(lineage: Mapping[str, str], eval_run_id: str | None) -> str:
    policy_run = lineage.get("policy.run_id", "unknown")
    lines = [(f"- Policy run: `{policy_run}`; this directory is its `model` artifact (`runs:/{policy_run}/model`), "
              "and the full gate report is its `gate/gate_report.json`."),
             f"- Pipeline run: `{lineage.get('pipeline.run_id', 'unknown')}`."]
    if eval_run_id:
        lines.append(f"- Evaluation run: `{eval_run_id}`.")
    lines.append(f"- Reference (SFT) policy run: `{lineage.get('base_model.run_id', 'unknown')}`.")
    return "\n".join(lines)


def _feedback(lineage: Mapping[str, str]) -> list[str]:
    return [d for d in lineage.get("feedback.datasets", "").split(",") if d]


def _interval(i: Mapping[str, float] | None) -> str:
    return "–" if i is None else f"{fmt(i['estimate'])} [{fmt(i['low'])}, {fmt(i['high'])}]"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    return "none" if v is None else str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])
