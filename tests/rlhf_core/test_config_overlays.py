"""Config overlays (`base:`), where each resolved value came from, and the shipped configs:
none restates a value it would have anyway or undoes its base, and k8s.yaml is placement only."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_core.config import ConfigError, PipelineConfig, config_origins, load_config
from rlhf_core.config.loading import restated_keys, undone_keys

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))

# The keys configs/k8s.yaml may set: where the cluster runs a pipeline (Ray workers on GPUs,
# shared storage, the MLflow server, exporter and gateway addresses) and how it serves (the
# Deployment rlhf-vllm). Task, model and training recipe come from the config it is composed with.
K8S_KEYS = {
    "output_dir", "reward.use_gpu", "reward.precision", "policy.use_gpu", "serving.enabled",
    "feedback.host", "feedback.salt_file",
    "monitoring.host", "monitoring.port", "monitoring.advertise_host", "monitoring.targets_dir",
    "tracking.tracking_uri",
}


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


# --- merging ------------------------------------------------------------------------------


def test_an_overlay_merges_mappings_key_by_key_and_replaces_lists_and_scalars(tmp_path):
    write(tmp_path / "base.yaml", {
        "sft": {"epochs": 3, "batch_size": 16},
        "policy": {"shaping": {"aggregate": "min", "bounded": True}},
        "serving": {"ports": [9000, 9001], "extra_args": ["--a", "--b"]},
    })
    overlay = write(tmp_path / "overlay.yaml", {
        "base": "base.yaml",
        "sft": {"epochs": 5},
        "policy": {"shaping": {"bounded": False}},
        "serving": {"extra_args": ["--c"]},
    })
    cfg = load_config(overlay)
    assert (cfg.sft.epochs, cfg.sft.batch_size) == (5, 16)  # sibling keys of the base survive
    assert (cfg.policy.shaping.aggregate, cfg.policy.shaping.bounded) == ("min", False)
    assert cfg.serving.extra_args == ["--c"]  # a list replaces the base's list, it is not appended to
    assert cfg.serving.ports == (9000, 9001)


def test_a_list_of_bases_merges_in_order_each_with_its_own_bases(tmp_path):
    write(tmp_path / "root.yaml", {"sft": {"seed": 5, "epochs": 1}})
    write(tmp_path / "recipe.yaml", {"base": "root.yaml", "sft": {"epochs": 2, "batch_size": 8}})
    write(tmp_path / "place.yaml", {"output_dir": "/shared", "sft": {"batch_size": 16}})
    mine = write(tmp_path / "mine.yaml", {"base": ["recipe.yaml", "place.yaml"], "name": "mine"})
    cfg = load_config(mine)
    assert (cfg.sft.seed, cfg.sft.epochs, cfg.sft.batch_size, str(cfg.output_dir), cfg.name) == (5, 2, 16, "/shared", "mine")
    assert config_origins(mine)["sft.batch_size"] == str(tmp_path / "place.yaml")  # the later base wins
    write(tmp_path / "loop.yaml", {"base": ["recipe.yaml", "loop.yaml"]})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="an empty list"):
        load_config(write(tmp_path / "none.yaml", {"base": []}))


def test_bases_chain_and_the_nearest_file_wins(tmp_path):
    write(tmp_path / "a.yaml", {"sft": {"epochs": 1, "batch_size": 8, "seed": 1}})
    write(tmp_path / "b.yaml", {"base": "a.yaml", "sft": {"epochs": 2, "batch_size": 16}})
    c = write(tmp_path / "c.yaml", {"base": "b.yaml", "sft": {"epochs": 3}})
    cfg = load_config(c)
    assert (cfg.sft.epochs, cfg.sft.batch_size, cfg.sft.seed) == (3, 16, 1)


def test_a_cycle_of_bases_is_refused_naming_the_files(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml", "sft": {"epochs": 1}})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "a.yaml")
    [problem] = exc.value.problems
    assert "cycle" in problem and "a.yaml -> " in problem and "b.yaml -> " in problem
    write(tmp_path / "self.yaml", {"base": "self.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "self.yaml")


def test_a_relative_base_is_found_from_the_overlays_folder_not_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path / "shared" / "base.yaml", {"sft": {"epochs": 7}})
    overlay = write(tmp_path / "team" / "run.yaml", {"base": "../shared/base.yaml", "sft": {"batch_size": 8}})
    write(tmp_path / "elsewhere" / "shared" / "base.yaml", {"sft": {"epochs": 99}})  # ../shared from the cwd
    (tmp_path / "elsewhere" / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere" / "cwd")
    cfg = load_config(overlay)
    assert (cfg.sft.epochs, cfg.sft.batch_size) == (7, 8)


def test_a_missing_base_names_the_overlay_that_wanted_it(tmp_path):
    overlay = write(tmp_path / "run.yaml", {"base": "nope.yaml"})
    with pytest.raises(ConfigError, match=r"file not found: .*nope\.yaml \(the base of .*run\.yaml\)"):
        load_config(overlay)


def test_the_packaged_demo_is_a_base_from_anywhere(tmp_path):
    overlay = write(tmp_path / "mine.yaml", {"base": "packaged:demo.yaml", "name": "mine"})
    demo = load_config(CONFIGS / "demo.yaml").model_dump()
    assert load_config(overlay).model_dump() == {**demo, "name": "mine"}


def test_set_overrides_apply_after_every_file(tmp_path):
    write(tmp_path / "base.yaml", {"sft": {"epochs": 3, "batch_size": 16}})
    overlay = write(tmp_path / "overlay.yaml", {"base": "base.yaml", "sft": {"epochs": 5}})
    cfg = load_config(overlay, ["sft.epochs=9", "sft.batch_size=4"])
    assert (cfg.sft.epochs, cfg.sft.batch_size) == (9, 4)


def test_an_unknown_key_names_the_file_it_came_from(tmp_path):
    write(tmp_path / "base.yaml", {"reward": {"epochz": 3}})
    overlay = write(tmp_path / "overlay.yaml", {"base": "base.yaml", "sft": {"epochs": 2}})
    with pytest.raises(ConfigError) as exc:
        load_config(overlay)
    assert exc.value.problems == [f"reward.epochz: unknown key (from {tmp_path / 'base.yaml'})"]
    with pytest.raises(ConfigError) as exc:
        load_config(overlay, ["sft.epochz=1"])
    assert "sft.epochz: unknown key (from --set)" in exc.value.problems


# --- origins ------------------------------------------------------------------------------


def test_origins_say_default_base_file_or_set_for_every_key(tmp_path):
    base = write(tmp_path / "base.yaml", {"sft": {"epochs": 3, "batch_size": 16}, "serving": {"ports": [1, 2]}})
    overlay = write(tmp_path / "overlay.yaml", {"base": "base.yaml", "sft": {"epochs": 5},
                                                "policy": {"shaping": {"bounded": True}}})
    origins = config_origins(overlay, ["sft.seed=4"])
    assert origins["sft.epochs"] == str(overlay)
    assert origins["sft.batch_size"] == str(base)
    assert origins["serving.ports"] == str(base)
    assert origins["policy.shaping.bounded"] == str(overlay)
    assert origins["sft.seed"] == "--set"
    assert origins["sft.learning_rate"] == origins["policy.shaping.aggregate"] == "default"
    # one entry per value of the resolved config, nested sections walked into
    assert set(origins) == set(flat(load_config(overlay).model_dump()))


def test_a_set_that_replaces_a_mapping_owns_every_key_under_it(tmp_path):
    config = write(tmp_path / "c.yaml", {"policy": {"shaping": {"aggregate": "min", "bounded": True}}})
    origins = config_origins(config, ["policy.shaping={bounded: false}"])
    assert origins["policy.shaping.bounded"] == "--set"
    assert origins["policy.shaping.aggregate"] == "default"  # the --set value replaced the file's mapping
    assert load_config(config, ["policy.shaping={bounded: false}"]).policy.shaping.aggregate == "mean"


def test_check_config_explain_prints_each_value_and_its_origin(tmp_path, capsys):
    from flows.cli import main

    write(tmp_path / "base.yaml", {"sft": {"batch_size": 16}})
    overlay = write(tmp_path / "overlay.yaml", {"base": "base.yaml", "sft": {"epochs": 5}})
    assert main(["check-config", str(overlay), "--explain", "--set", "sft.seed=4"]) == 0
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert lines["sft.epochs"] == ["5", str(overlay)]
    assert lines["sft.batch_size"] == ["16", str(tmp_path / "base.yaml"), "(base)"]
    assert lines["sft.seed"] == ["4", "--set"]
    assert lines["sft.learning_rate"] == ["0.002", "default"]


# --- the shipped configs ------------------------------------------------------------------


def test_the_restated_key_check_finds_defaults_and_base_values_but_not_a_reset(tmp_path):
    base = write(tmp_path / "base.yaml", {"sft": {"epochs": 12, "batch_size": 64}, "policy": {"precision": "fp32"}})
    assert restated_keys(base) == ["sft.batch_size"]  # 64 is the default
    overlay = write(tmp_path / "overlay.yaml", {
        "base": "base.yaml",
        "sft": {"epochs": 12},                  # the base's value again
        "policy": {"precision": "auto"},        # the default, but it changes the base's fp32
        "serving": {"ports": [8100, 8101]},     # the default, written as a list
    })
    assert sorted(restated_keys(overlay)) == ["serving.ports", "sft.epochs"]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_no_shipped_config_restates_a_value_it_would_have_anyway(path):
    assert restated_keys(path) == [], f"{path.name}: remove these keys, they change nothing"


def test_the_undo_check_finds_a_key_set_back_to_its_default_over_a_base(tmp_path):
    base = write(tmp_path / "base.yaml", {"policy": {"verifiable_reward": "addition_exact_match", "kl_coef": 0.1}})
    overlay = write(tmp_path / "overlay.yaml", {"base": "base.yaml", "policy": {"verifiable_reward": None, "kl_coef": 0.3}})
    assert undone_keys(overlay) == ["policy.verifiable_reward"]
    assert undone_keys(base) == []


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_no_shipped_config_undoes_what_its_base_set(path):
    # the GPU configs build on own-data.yaml, not on a demo whose task they would have to take back
    assert undone_keys(path) == [], f"{path.name}: these keys take back what a base set; build on another base"


def test_k8s_is_placement_only_and_the_cluster_demo_is_the_demo_placed_by_it():
    assert "base" not in yaml.safe_load((CONFIGS / "k8s.yaml").read_text())
    k8s = flat(load_config(CONFIGS / "k8s.yaml").model_dump(mode="json"))
    defaults = flat(PipelineConfig().model_dump(mode="json"))
    set_ = {key for key in defaults if defaults[key] != k8s[key]}
    assert set_ <= K8S_KEYS, f"not about placement: {sorted(set_ - K8S_KEYS)}"
    demo = flat(load_config(CONFIGS / "demo.yaml").model_dump(mode="json"))
    placed = flat(load_config(CONFIGS / "k8s-demo.yaml").model_dump(mode="json"))
    assert {key for key in demo if demo[key] != placed[key]} <= K8S_KEYS | {"name"}
    for gpu in ("gpu-1xh100-0.5b.yaml", "gpu-8xh100-7b.yaml"):  # your data: no task of the demo's
        cfg = load_config(CONFIGS / gpu)
        assert cfg.policy.verifiable_reward is None and cfg.gates.regression_suites == [] and not cfg.policy.rounds.enabled


def test_set_reaches_an_item_of_a_list_by_its_index():
    from rlhf_core.config import ConfigError, load_config

    cfg = load_config(REPO / "configs" / "demo.yaml", ["gates.regression_suites.0.max_rows=3200"])
    assert cfg.gates.regression_suites[0].max_rows == 3200 and cfg.gates.regression_suites[0].name == "no_carry"
    with pytest.raises(ConfigError, match="gates.regression_suites.1.max_rows: 1 is not an index of a list of 1"):
        load_config(REPO / "configs" / "demo.yaml", ["gates.regression_suites.1.max_rows=3200"])
