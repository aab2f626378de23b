"""The seed-spread benchmark's own arithmetic: the loss floor and the plateau step."""
import math
from pathlib import Path

from bench.seed_spread import failure, noise_floor, plateau_step
from rlhf_core.config import load_config

REPO = Path(__file__).resolve().parents[1]


def test_noise_floor_is_the_label_noise_entropy_spread_over_the_answer_tokens():
    rows = [{"prompt": "07+48=", "completion": "055"}, {"prompt": "01+02=", "completion": "003"}]  # one carries
    h = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    assert math.isclose(noise_floor(rows, 0.6), h * 0.5 / 4)  # 3 digits + </s>
    assert noise_floor(rows, 0.0) == 0.0 and noise_floor(rows, 1.0) == 0.0


def test_plateau_is_the_first_step_whose_running_mean_is_under_the_threshold():
    history = [(10 * i, loss) for i, loss in enumerate([0.9, 0.8, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1], start=1)]
    assert plateau_step(history, 0.2, window=3) == 50  # mean(0.3, 0.1, 0.1) = 0.167 at step 50
    assert plateau_step(history, 0.15, window=3) == 60  # mean(0.1, 0.1, 0.1) at step 60
    assert plateau_step(history, 0.05, window=3) is None


def test_a_row_fails_on_the_first_bar_it_misses():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    good = {"sft_plateau_share": 0.3, "sft_steps": 3000, "base_accuracy": 0.35, "reward_accuracy": 0.95,
            "gain": 0.6, "gate_passed": True, "gate_reasons": None}
    assert failure(good, cfg, sft_only=False) is None
    assert failure({**good, "sft_plateau_share": None}, cfg, False).startswith("sft: no plateau by 60%")
    assert failure({**good, "base_accuracy": 0.04}, cfg, False).startswith("sft: held-out accuracy 0.040")
    assert failure({**good, "reward_accuracy": 0.6}, cfg, False).startswith("reward:")
    assert failure({**good, "gain": 0.1}, cfg, False).startswith("policy: gain +0.100")
    assert failure({**good, "gate_passed": False, "gate_reasons": "kl"}, cfg, False) == "gates: kl"
    assert failure({**good, "reward_accuracy": None}, cfg, sft_only=True) is None


def test_merged_rows_are_judged_again_by_the_config_given():
    from bench.seed_spread import merged

    cfg = load_config(REPO / "configs" / "demo.yaml")
    row = {"sft_plateau_share": 0.3, "sft_steps": 3000, "base_accuracy": 0.35, "reward_accuracy": 0.5,
           "gain": 0.6, "gate_passed": True, "gate_reasons": None, "success": True, "failure": None}
    again = merged(row, cfg)
    assert again["stages"] == "all" and not again["success"] and again["failure"].startswith("reward:")
    sft_row = merged({**row, "reward_accuracy": None}, cfg)
    assert sft_row["stages"] == "sft" and sft_row["success"]
