from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, PipelineConfig, apply_overrides, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def problems_of(raw) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    return exc.value.problems


def test_demo_config_loads_and_is_the_default_shape():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert isinstance(cfg, PipelineConfig)
    assert cfg.data.preferences_path is None  # the demo generates its data


def test_unknown_key_is_named_with_its_path():
    assert problems_of({"sft": {"epochz": 3}}) == ["sft.epochz: unknown key"]


def test_wrong_type_is_named_with_its_path_and_value():
    (msg,) = problems_of({"sft": {"batch_size": "many"}})
    assert msg.startswith("sft.batch_size: ") and "'many'" in msg


def test_out_of_range_value_reads_like_the_rule():
    assert problems_of({"sft": {"learning_rate": -1}}) == ["sft.learning_rate: must be > 0, got -1"]
    assert problems_of({"data": {"demo": {"wrong_share": 1.5}}}) == ["data.demo.wrong_share: must be <= 1, got 1.5"]


def test_every_problem_is_reported_at_once():
    problems = problems_of({"sft": {"epochs": 0}, "model": {"num_layers": 0}, "bogus": 1})
    assert sorted(p.split(":")[0] for p in problems) == ["bogus", "model.num_layers", "sft.epochs"]


def test_cross_field_rules():
    (msg,) = problems_of({"model": {"hidden_size": 100, "num_heads": 3}})
    assert msg.startswith("model: hidden_size (100) must be divisible by num_heads (3)")
    (msg,) = problems_of({"validation": {"min_chars": 10, "max_chars": 5}})
    assert "min_chars (10) must be <= max_chars (5)" in msg


def test_pipelined_rollouts_rules():
    (msg,) = problems_of({"policy": {"pipeline": {"max_lag": 1}, "top_p": 0.9}})
    assert msg.startswith("policy: pipeline.max_lag > 0 needs top_p = 1 (got 0.9)")
    (msg,) = problems_of({"policy": {"prompts_per_step": 4, "num_workers": 1, "minibatch_size": 32,
                                     "micro_batch_size": 32, "pipeline": {"chunks": 5}}})
    assert msg.startswith("policy: pipeline.chunks (5) must not exceed prompts_per_step (4)")
    assert problems_of({"policy": {"pipeline": {"is_cap": 0.5}}}) == ["policy.pipeline.is_cap: must be >= 1, got 0.5"]
    assert parse_config({"policy": {"pipeline": {"max_lag": 2}}}).policy.pipeline.max_lag == 2


def test_overrides_parse_values_as_yaml_and_are_validated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sft:\n  epochs: 2\n")
    cfg = load_config(path, ["sft.epochs=5", "sft.learning_rate=1e-3", "data.demo.seed=7"])
    assert (cfg.sft.epochs, cfg.sft.learning_rate, cfg.data.demo.seed) == (5, 1e-3, 7)
    with pytest.raises(ConfigError, match="sft.epochs: must be >= 1, got 0"):
        load_config(path, ["sft.epochs=0"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["sft.epochs"])


def test_missing_and_malformed_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(listy)


def test_simulated_rounds_need_an_answer_key_and_a_judge_needs_its_endpoint():
    from rlhf_core.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="answer key"):
        parse_config({"policy": {"rounds": {"enabled": True}}})  # the defaults name no answer key
    with pytest.raises(ConfigError, match="judge.base_url"):
        parse_config({"policy": {"rounds": {"enabled": True, "annotator": "llm_judge"}}})
    with pytest.raises(ConfigError, match=r"\{prompt\}"):
        parse_config({"policy": {"rounds": {"judge": {"template": "no fields"}}}})
    ok = parse_config({"policy": {"verifiable_reward": "addition_exact_match", "rounds": {"enabled": True}}})
    assert ok.policy.rounds.annotator == "simulated" and ok.policy.verifiable_reward == "addition_exact_match"


def test_a_pretrained_path_under_home_is_expanded_and_a_hub_id_kept(monkeypatch, tmp_path):
    from rlhf_core.config import parse_config

    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_config({"model": {"pretrained": "~/models/m"}}).model.pretrained == str(tmp_path / "models/m")
    assert parse_config({"model": {"pretrained": "org/name"}}).model.pretrained == "org/name"


def test_frozen_reward_layers_beyond_the_demo_model_are_refused():
    from rlhf_core.config import PipelineConfig

    with pytest.raises(ValueError, match=r"reward.frozen_layers is 5 but the model has 4 layers \(model.num_layers\)"):
        PipelineConfig.model_validate({"model": {"num_layers": 4}, "reward": {"frozen_layers": 5}})
    assert PipelineConfig.model_validate({"model": {"num_layers": 4}, "reward": {"frozen_layers": 4}}).reward.frozen_layers == 4
