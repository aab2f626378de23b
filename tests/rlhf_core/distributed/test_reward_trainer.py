"""Reward-model training on a real local Ray cluster with DeepSpeed ZeRO on CPU.

The fault-tolerance test SIGKILLs a real worker process mid-run and checks that the resumed
run is indistinguishable from an uninterrupted one with the same seed.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.config import RewardConfig
from rlhf_core.data.pairs import split_by_prompt, steps_per_epoch
from rlhf_core.distributed.fault_injection import FAULT_ENV
from rlhf_core.distributed.deepspeed_engine import deepspeed_config
from rlhf_core.distributed.reward_trainer import train_reward_model
from rlhf_core.models.reward import read_reward_meta, score
from rlhf_core.testing.sinks import JsonlSink
from rlhf_core.training.stage_types import StageSite

from .conftest import arithmetic_pairs

# Test modules are not importable on Ray workers: ship this module's callables by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# 1500 pairs -> 1200 train / 300 held out; global batch 16 x 2 workers = 32 -> 37 steps an
# epoch, 74 in all. Training takes seconds; Ray and DeepSpeed start-up take the rest.
CFG = RewardConfig(
    seed=0,
    num_workers=2,
    zero_stage=2,
    micro_batch_size=16,
    epochs=2,
    learning_rate=3e-3,
    warmup_steps=3,
    checkpoint_every=10,
    max_failures=1,
    min_eval_accuracy=0.0,
)
# Killed at step 42, after the checkpoint at step 40 (epoch 1's third step): steps 41-42 are
# lost and redone inside the epoch. Killed at step 38, epoch 1's first: the resume from the
# checkpoint at step 30 redoes steps 31-38 across the epoch boundary (epoch 0 ends at 37).
KILL_STEPS = [pytest.param(42, id="inside-an-epoch"), pytest.param(38, id="across-an-epoch-boundary")]


@pytest.fixture(scope="module")
def pairs():
    return split_by_prompt(arithmetic_pairs(1500), eval_share=0.2, seed=0)


def run(pairs, base, tmp: Path, cfg: RewardConfig = CFG, on_metrics=None):
    train, held = pairs
    return train_reward_model(train, held, base, cfg, StageSite(tmp / "model", tmp / "ray", "reward", on_metrics))


@pytest.fixture(scope="module")
def baseline(ray_cluster, pairs, tiny_base, tmp_path_factory):
    """An uninterrupted ZeRO-2 run, shared by the training and the fault-tolerance tests."""
    tmp = tmp_path_factory.mktemp("baseline")
    sink = JsonlSink(tmp / "metrics.jsonl")
    return run(pairs, tiny_base, tmp, on_metrics=sink), sink.path


# ----------------------------------------------------------------------------- fast


def _ds(cfg, use_gpu):
    """The DeepSpeed config the reward trainer builds from its config."""
    return deepspeed_config(train_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
                            grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm,
                            zero_stage=cfg.zero_stage, learning_rate=cfg.learning_rate,
                            weight_decay=cfg.weight_decay, use_gpu=use_gpu)


def test_deepspeed_config_follows_reward_config():
    cfg = CFG.model_copy(update={"zero_stage": 3, "grad_accum_steps": 2, "max_grad_norm": 0.5, "weight_decay": 0.1})
    ds = _ds(cfg, use_gpu=False)
    assert ds["train_micro_batch_size_per_gpu"] == 16 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == cfg.global_batch_size == 64
    assert ds["zero_optimization"] == {"stage": 3} and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["optimizer"]["params"]["weight_decay"] == 0.1 and ds["optimizer"]["params"]["lr"] == cfg.learning_rate
    assert ds["bf16"] == {"enabled": False}
    assert _ds(cfg, use_gpu=True)["bf16"] == {"enabled": True}


def test_a_stage_saves_its_model_in_the_dtype_deepspeed_computes_in():
    from rlhf_core.distributed.deepspeed_engine import saved_dtype

    assert saved_dtype(use_gpu=True) == torch.bfloat16 and _ds(CFG, use_gpu=True)["bf16"]["enabled"]
    assert saved_dtype(use_gpu=False) is None and not _ds(CFG, use_gpu=False)["bf16"]["enabled"]  # fp32 as trained


def test_the_gpu_optimizer_is_torchs_fused_adamw_which_needs_no_compiler():
    """DeepSpeed's FusedAdam would be compiled with nvcc on first use; torch's AdamW with
    `fused` ships with the CUDA wheel. DeepSpeed hands the params, less `torch_adam`, to
    torch.optim.AdamW: they must be its keyword arguments."""
    params = _ds(CFG, use_gpu=True)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    assert "fused" not in _ds(CFG, use_gpu=False)["optimizer"]["params"]
    kwargs = {k: v for k, v in params.items() if k != "torch_adam"}
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], **kwargs)  # fused AdamW also runs on CPU tensors
    weight.grad = torch.ones(3)
    optimizer.step()
    assert optimizer.defaults["fused"] and (weight < 1).all()


def test_empty_training_set_fails_before_training(pairs, tiny_base, tmp_path):
    with pytest.raises(ValueError, match=r"training set is empty \(0 preference pairs\)"):
        train_reward_model([], pairs[1], tiny_base, CFG, StageSite(tmp_path / "m", tmp_path / "ray", "x"))
    assert not (tmp_path / "ray").exists()


def test_overlength_pairs_with_reject_fail_before_training(pairs, tiny_base, tmp_path):
    cfg = CFG.model_copy(update={"max_length": 12, "on_overlength": "reject"})  # pairs are 11 tokens
    rows = list(pairs[0])
    rows[3] = {**rows[3], "chosen": "0" * 5}
    with pytest.raises(ValueError, match=rf"training pairs\): 1 of {len(rows)} .* id={rows[3]['id']} \(13 tokens\)"):
        train_reward_model(rows, pairs[1], tiny_base, cfg, StageSite(tmp_path / "m", tmp_path / "ray", "x"))
    assert not (tmp_path / "ray").exists()


def test_fewer_pairs_than_one_global_batch_fails_before_training(pairs, tiny_base, tmp_path):
    with pytest.raises(ValueError, match=r"31 training pairs are fewer than one global batch of 32"):
        train_reward_model(pairs[0][:31], pairs[1], tiny_base, CFG, StageSite(tmp_path / "m", tmp_path / "ray", "x"))


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_more_workers_than_cluster_cpus_fails_before_training(ray_cluster, pairs, tiny_base, tmp_path):
    cfg = CFG.model_copy(update={"num_workers": 5})
    with pytest.raises(ValueError, match=r"reward.num_workers=5 but the Ray cluster has 4 CPUs"):
        run(pairs, tiny_base, tmp_path, cfg)
    assert not (tmp_path / "ray").exists()


def check_trained(result, pairs, cfg: RewardConfig) -> None:
    train, held = pairs
    steps = steps_per_epoch(len(train), cfg.global_batch_size) * cfg.epochs
    assert result.steps == steps == len(result.run.metrics_history) == len(result.run.consumed)
    losses = [m["reward/loss"] for m in result.run.metrics_history]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1  # from ~ln 2 = 0.69 to below ~0.5
    assert result.eval_accuracy >= 0.75  # chance is 0.5; this tiny model tops out near 0.8
    # The saved directory is a plain HF reward model that reproduces the held-out accuracy.
    model = AutoModelForSequenceClassification.from_pretrained(str(result.path)).eval()
    tok = AutoTokenizer.from_pretrained(str(result.path))
    prompts = [r["prompt"] for r in held]
    r_c = score(model, tok, prompts, [r["chosen"] for r in held], cfg.max_length)
    r_r = score(model, tok, prompts, [r["rejected"] for r in held], cfg.max_length)
    assert (r_c > r_r).float().mean().item() == pytest.approx(result.eval_accuracy)
    all_scores = torch.cat([r_c, r_r]).double()
    assert all_scores.mean().item() == pytest.approx(result.reward_mean, abs=1e-5)
    assert all_scores.std(unbiased=False).item() == pytest.approx(result.reward_std, abs=1e-5)
    meta = read_reward_meta(result.path)
    assert meta["reward_mean"] == result.reward_mean and meta["eval_accuracy"] == result.eval_accuracy
    # Every rank's ZeRO shards landed in the one reported checkpoint.
    ckpt = Path(result.run.checkpoint_path)
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= {p.name for p in (ckpt / "engine").iterdir()}
    assert {"trainer_state.json", "rng_rank_0.pt", "rng_rank_1.pt"} <= {p.name for p in ckpt.iterdir()}


@pytest.mark.slow
def test_zero2_trains_and_reports_every_step(baseline, pairs):
    result, metrics_file = baseline
    check_trained(result, pairs, CFG)
    assert result.run.attempts == 1 and result.run.resumed_from_step is None
    assert read_reward_meta(result.path)["precision"] == "fp32"  # the default
    logged = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    # on_metrics ran on rank 0 once per optimizer step, with every worker's figures besides the step's
    assert [{k: v for k, v in m.items() if not k.startswith("worker/")} for m in logged] == result.run.metrics_history
    for m in logged:
        for rank in (0, 1):
            assert m[f"worker/{rank}/samples_per_second"] > 0 and m[f"worker/{rank}/cpu_utilization"] > 0
            assert isinstance(m[f"worker/{rank}/host"], str) and m[f"worker/{rank}/pid"].isdigit()
    assert m["worker/0/pid"] != m["worker/1/pid"]
    names = set(logged[-1])
    for name in ("loss", "accuracy", "margin", "chosen_mean", "rejected_mean", "grad_norm", "pairs_per_s", "truncated"):
        assert f"reward/{name}" in names
    assert {"reward/step_time_s/worker_0", "reward/step_time_s/worker_1"} <= names


@pytest.mark.slow
def test_zero3_trains_in_bf16_mixed_precision(baseline, pairs, tiny_base, tmp_path):
    """Parameters sharded over both workers and the forward passes under bf16 autocast: it
    learns as the fp32 baseline does, and the saved model (fp32, scored in fp32) says how it
    was trained."""
    cfg = CFG.model_copy(update={"zero_stage": 3, "precision": "bf16"})
    result = run(pairs, tiny_base, tmp_path, cfg)
    check_trained(result, pairs, cfg)
    assert read_reward_meta(result.path)["precision"] == "bf16"
    # the same first batch through the same initial weights: in fp32 this ZeRO-3 run gives the
    # ZeRO-2 baseline's first loss bit for bit (tried: 0.7004716098308563 both); under bf16
    # autocast the forward pass rounds, and the loss moves (0.700426 here)
    first, fp32_first = result.run.metrics_history[0]["reward/loss"], baseline[0].run.metrics_history[0]["reward/loss"]
    assert 0 < abs(first - fp32_first) < 0.05, (first, fp32_first)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at_step", KILL_STEPS)
def test_killed_worker_resumes_from_last_checkpoint_with_identical_results(baseline, pairs, tiny_base, tmp_path,
                                                                          monkeypatch, kill_at_step):
    expected, _ = baseline
    monkeypatch.setenv(FAULT_ENV, f"kill:reward:step{kill_at_step}:rank1={tmp_path / 'killed'}")
    result = run(pairs, tiny_base, tmp_path)

    assert (tmp_path / "killed").exists()  # rank 1 did SIGKILL itself
    assert result.run.attempts == 2
    assert result.run.resumed_from_step == kill_at_step // CFG.checkpoint_every * CFG.checkpoint_every
    assert steps_per_epoch(len(pairs[0]), CFG.global_batch_size) == 37  # the boundary the second case crosses

    # No data position repeated or skipped: the committed steps consumed exactly what the
    # uninterrupted run did, and within an epoch no pair twice.
    assert result.run.consumed == expected.run.consumed
    per_epoch = steps_per_epoch(len(pairs[0]), CFG.global_batch_size)
    for epoch in range(CFG.epochs):
        used = [i for step in result.run.consumed[epoch * per_epoch : (epoch + 1) * per_epoch] for i in step]
        assert len(used) == per_epoch * CFG.global_batch_size and max(Counter(used).values()) == 1

    # Same numbers. Tolerance: exact. On CPU in fp32 with the same seeds the run is
    # deterministic: the data order is a function of (seed, epoch, step), the DeepSpeed
    # checkpoint round-trips the fp32 weights, Adam moments and scheduler bit for bit, the
    # model has no dropout, and a gloo sum over two ranks does not depend on arrival order.
    drop_timing = lambda h: [{k: v for k, v in m.items() if "step_time" not in k and "pairs_per_s" not in k} for m in h]  # noqa: E731
    assert drop_timing(result.run.metrics_history) == drop_timing(expected.run.metrics_history)
    assert (result.eval_accuracy, result.eval_loss, result.final_loss) == (
        expected.eval_accuracy,
        expected.eval_loss,
        expected.final_loss,
    )
    assert (result.reward_mean, result.reward_std) == (expected.reward_mean, expected.reward_std)
    got, want = load_file(result.path / "model.safetensors"), load_file(expected.path / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_bootstrap_weights_are_one_draw_per_pair_and_member():
    from rlhf_core.distributed.reward_trainer import bootstrap_weights

    assert bootstrap_weights(100, 1, seed=0) is None  # one model sees every pair once
    w = bootstrap_weights(4000, 3, seed=0)
    assert w.shape == (4000, 3) and torch.equal(w, bootstrap_weights(4000, 3, seed=0))
    assert (w >= 0).all() and torch.equal(w, w.round())
    assert abs(w.mean().item() - 1.0) < 0.05 and abs((w == 0).float().mean().item() - math.exp(-1)) < 0.02
    assert not torch.equal(w[:, 0], w[:, 1])  # each member its own resample


# The audit model takes the larger share of the prompts here (720 training pairs, 22 steps;
# the ensemble 480, 15), so that a kill at step 18 lands in the audit model's run alone.
ENSEMBLE = CFG.model_copy(update={"ensemble_size": 3, "audit_share": 0.6, "epochs": 1, "frozen_layers": 1})
AUDIT_KILL_STEP = 18


@pytest.mark.slow
def test_an_ensemble_and_its_audit_model_train_together_and_the_audits_own_run_resumes_a_killed_worker(
        ray_cluster, pairs, tiny_base, tmp_path, monkeypatch):
    """Three heads on one backbone, each on its own bootstrap, plus an audit model on a
    disjoint share of the prompts, saved inside the ensemble's directory; with the embeddings and
    the first layer frozen (`frozen_layers`), which both models save as the backbone had them.
    The audit model is a Ray Train run of its own after the ensemble's: a worker killed in it at
    step 18 resumes that run from step 10's checkpoint, redoing steps 11-18 as the killed attempt
    did them, and the ensemble's finished run is not redone."""
    from rlhf_core.distributed.reward_trainer import train_reward_models
    from rlhf_core.models.reward import audit_model_dir, load_reward_model, member_stats, read_reward_meta

    train, held = pairs
    cfg = ENSEMBLE
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    monkeypatch.setenv(FAULT_ENV, f"kill:reward:step{AUDIT_KILL_STEP}:rank1={tmp_path / 'killed'}")
    models = train_reward_models(train, held, tiny_base, cfg, StageSite(tmp_path / "rm", tmp_path / "ray", "ens", sink))
    assert (tmp_path / "killed").exists() and models.proxy.steps < AUDIT_KILL_STEP < models.audit.steps
    assert (models.proxy.run.attempts, models.audit.run.attempts) == (1, 2) and models.audit.run.resumed_from_step == 10
    first: dict[int, dict] = {}
    redone: dict[int, dict] = {}
    for m in map(json.loads, sink.path.read_text().splitlines()):
        if "reward_audit/loss" in m:
            (redone if m["step"] in first else first)[m["step"]] = m
    assert sorted(redone) == list(range(11, AUDIT_KILL_STEP + 1))
    figures = ("reward_audit/loss", "reward_audit/accuracy", "reward_audit/margin", "reward_audit/grad_norm")
    assert all([redone[s][k] for k in figures] == [first[s][k] for k in figures] for s in redone)  # bit for bit

    assert models.proxy_pairs + models.audit_pairs == len(train) and models.audit_pairs > 0
    assert len(models.proxy.member_eval_accuracy) == 3 and models.audit.member_eval_accuracy
    assert models.proxy.eval_accuracy > 0.6 and models.audit.eval_accuracy > 0.6
    meta = read_reward_meta(tmp_path / "rm")
    assert meta["ensemble_size"] == 3 and len(member_stats(meta)) == 3
    assert audit_model_dir(tmp_path / "rm") == tmp_path / "rm" / "audit"
    model, tok, _ = load_reward_model(tmp_path / "rm")
    assert model.config.num_labels == 3
    from rlhf_core.models.reward import score_members

    prompts = [r["prompt"] for r in held[:32]]
    members = score_members(model, tok, prompts, [r["chosen"] for r in held[:32]], cfg.max_length)
    assert members.shape == (3, 32) and not torch.allclose(members[0], members[1])  # the heads differ

    backbone = load_file(str(tiny_base / "model.safetensors"))
    for saved_dir in (tmp_path / "rm", audit_model_dir(tmp_path / "rm")):
        saved = load_file(str(saved_dir / "model.safetensors"))
        for name, tensor in saved.items():
            if name.startswith(("model.embed_tokens.", "model.layers.0.")):
                assert torch.equal(tensor, backbone[name]), name  # frozen: the backbone's, bit for bit
        assert not torch.equal(saved["model.layers.1.mlp.down_proj.weight"], backbone["model.layers.1.mlp.down_proj.weight"])



@dataclass(frozen=True)
class StopAfter:
    """A stop request (`StageSite.stop_requested`) once the stage's metrics file holds `step` steps
    (both are rank 0's, the file written just before the stage asks)."""

    metrics: Path
    step: int

    def __call__(self) -> str | None:
        seen = len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0
        return f"test: stop after step {self.step}" if seen >= self.step else None


@pytest.mark.slow
def test_a_stop_request_ends_the_stage_after_a_step_with_its_checkpoint_and_the_resumed_run_ends_the_same(
        baseline, pairs, tiny_base, tmp_path):
    """Asked to stop after step 12 (checkpoints every 10): the stage saves step 12's checkpoint,
    saves no model and raises `StageStopped`; run again, it resumes at step 12 and ends as an
    uninterrupted run does, bit for bit."""
    from rlhf_core.training.stage_types import StageStopped

    expected, _ = baseline
    train, held = pairs
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    site = StageSite(tmp_path / "model", tmp_path / "ray", "reward", sink, StopAfter(sink.path, 12))
    with pytest.raises(StageStopped) as stopped:
        train_reward_model(train, held, tiny_base, CFG, site)
    assert (stopped.value.step, stopped.value.reason) == (12, "test: stop after step 12")
    assert stopped.value.checkpoint_path and not (tmp_path / "model" / "model.safetensors").exists()
    result = run(pairs, tiny_base, tmp_path)  # the same run name: resumed, no stop asked
    assert result.run.resumed_from_step == 12 and result.run.consumed == expected.run.consumed
    got, want = load_file(result.path / "model.safetensors"), load_file(expected.path / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
