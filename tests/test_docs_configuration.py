"""docs/configuration.md is generated from the config models and kept in step with them."""
from __future__ import annotations

from pydantic import Field

from rlhf_core.config import doc as config_doc
from rlhf_core.config import PipelineConfig, _Strict


def test_every_key_and_section_is_described():
    assert config_doc.undocumented() == []


def test_the_committed_page_is_what_the_generator_writes_now():
    assert config_doc.PAGE.read_text(encoding="utf-8") == config_doc.render(), "run `make docs`"


def test_the_page_lists_every_key_with_type_default_and_meaning():
    page = config_doc.render()
    for prefix, section in config_doc.sections():
        for name, field in section.model_fields.items():
            if not config_doc._is_section(field):
                assert f"| `{prefix}{name}` | " in page, prefix + name
    assert ("| `policy.ppo.clip_range` | float, > 0, < 1 | 0.2 | Clip range of the policy's probability ratio. |"
            in page)
    assert "| `serving.ports` | tuple[int, int] | [8100, 8101] |" in page
    assert '| `policy.algorithm` | "ppo" \\| "grpo" \\| "dpo" \\| "kto" | "grpo" |' in page
    assert PipelineConfig.__doc__.strip() in page


def test_a_field_without_description_is_reported_by_its_dotted_path():
    class Inner(_Strict):
        """A section."""

        described: int = Field(1, description="Has one.")
        bare: int = 2

    class Outer(_Strict):
        """The top."""

        inner: Inner = Inner()
        name: str = Field("x", description="Has one.")

    assert config_doc.undocumented(Outer) == ["inner.bare"]


def test_the_own_model_pages_config_sets_only_model_data_and_budget_and_switches_no_demo_key_off():
    """The config a user copies sets model, data and lengths; what it leaves out describes no task:
    the reward model alone, no answer checker, no regression suite of the demo's, no rounds, a
    person promotes."""
    import re
    from pathlib import Path

    import yaml

    from rlhf_core.config import parse_config

    page = (Path(__file__).resolve().parents[1] / "docs/own-model-and-data.md").read_text(encoding="utf-8")
    raw = yaml.safe_load(re.search(r"## A complete config\n\n```yaml\n(.*?)```", page, re.S).group(1))
    assert set(raw) == {"name", "output_dir", "model", "data", "sft", "reward", "policy"}
    assert set(raw["policy"]) == {"algorithm", "max_new_tokens", "steps"}
    cfg = parse_config(raw)
    policy = cfg.policy
    assert (policy.reward_model_weight, policy.verifiable_reward_weight, policy.verifiable_reward) == (1.0, 0.0, None)
    assert not policy.rounds.enabled and cfg.gates.regression_suites == [] and not cfg.gates.auto_promote
    assert policy.min_accuracy_gain == 0.0 and cfg.reward.min_eval_accuracy == 0.6
