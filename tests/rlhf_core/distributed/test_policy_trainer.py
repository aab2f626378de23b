"""PPO / GRPO on a real local Ray cluster with DeepSpeed ZeRO on CPU and a real vLLM engine.

The policy is a tiny Llama (hidden 64, 2 heads: head size 32, the smallest vLLM's CPU
attention supports) given a short SFT on the demo task, so that greedy answers depend on the
prompt; the reward model is that policy's backbone with an untrained head, and the verifiable
exact-match reward carries the signal. Every run starts a vLLM engine (~40 s on two cores).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from rlhf_core.config import PolicyConfig, RolloutEngineConfig, RolloutPipelineConfig
from rlhf_core.distributed import deepspeed_engine
from rlhf_core.distributed.fault_injection import FAULT_ENV
from rlhf_core.distributed.policy_trainer import _check_inputs, train_policy
from rlhf_core.models.llama import load_policy
from rlhf_core.models.reward import reward_model_from_base, reward_stats, save_reward_model, score_members
from rlhf_core.testing.sinks import JsonlSink
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.stage_types import StageSite, StageStopped
from rlhf_core.training.circuit_breaker import CircuitBreakerTripped
from rlhf_core.training.policy_step import prompt_indices

from .conftest import N_EVAL

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = PolicyConfig(
    algorithm="grpo",
    num_workers=1,
    precision="fp32",  # the thresholds below were measured in fp32; bf16 is tested on its own
    zero_stage=2,
    steps=4,
    prompts_per_step=8,
    grpo={"group_size": 4},
    minibatch_size=16,
    micro_batch_size=8,
    epochs_per_step=1,
    learning_rate=3e-4,
    reward_model_weight=0.5,
    verifiable_reward_weight=1.0,
    verifiable_reward="addition_exact_match",
    eval_every=2,
    checkpoint_every=2,
    max_failures=1,
    min_accuracy_gain=-1.0,
)
FINITE = ("policy/reward_mean", "policy/kl", "policy/entropy", "policy/clipfrac", "policy/approx_kl",
          "policy/grad_norm", "policy/response_length", "policy/tokens_per_s", "rollout/logprob_diff",
          "rollout/prob_diff", "rollout/sync_s", "timing/generate", "timing/update", "timing/sync")


def run(demo, tmp: Path, cfg: PolicyConfig = CFG, on_metrics=None, **kwargs):
    return train_policy(demo["prompts"], demo["eval_prompts"], demo["eval_answers"], demo["sft"], demo["rm"], cfg,
                        StageSite(tmp / "policy", tmp / "ray", "policy", on_metrics), **kwargs)


def check_finite_run(result, cfg: PolicyConfig) -> None:
    assert result.steps == cfg.steps == len(result.run.metrics_history)
    for m in result.run.metrics_history:
        for name in FINITE:
            assert math.isfinite(m[name]), (name, m)
    assert [e["step"] for e in result.evaluations] == [0, *range(cfg.eval_every, cfg.steps + 1, cfg.eval_every)]
    # the headline accuracies are the first and last held-out evaluations, each a count of
    # exact matches over the eval prompts
    evals = [e["eval/accuracy"] for e in result.evaluations]
    assert (result.accuracy_before, result.accuracy_after) == (evals[0], evals[-1])
    for accuracy in evals:
        assert 0 <= accuracy <= 1 and math.isclose(accuracy * N_EVAL, round(accuracy * N_EVAL))
    assert math.isfinite(result.rm_score_before) and math.isfinite(result.rm_score_after)
    assert 0 <= result.kl_final <= result.kl_max < cfg.kl_bound
    assert {"config.json", "model.safetensors", "tokenizer.json", "rlhf_meta.json"} <= {p.name for p in result.path.iterdir()}
    assert len(result.run.consumed) == cfg.steps and all(len(c) == cfg.prompts_per_step for c in result.run.consumed)


# ----------------------------------------------------------------------------- fast


def test_the_actors_engine_takes_one_optimizer_step_per_minibatch(monkeypatch):
    """`policy_engine` hands DeepSpeed the policy config's batching: 32 sequences a step on 2 workers
    of 8 a micro-batch is 2 accumulation steps; only trainable parameters reach the optimizer."""
    cfg = CFG.model_copy(update={"num_workers": 2, "minibatch_size": 32, "micro_batch_size": 8, "zero_stage": 3})
    seen = {}

    class FakeDeepSpeed:  # records what initialize gets; the engine itself is DeepSpeed's business
        @staticmethod
        def initialize(model, model_parameters, config):
            seen.update(params=model_parameters, config=config)
            return ("engine",)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    assert deepspeed_engine.policy_engine(FakeDeepSpeed, model, cfg, 1e-5, use_gpu=False) == "engine"
    ds = seen["config"]
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == cfg.grad_accum_steps == 2
    assert ds["zero_optimization"] == {"stage": 3} and ds["optimizer"]["params"]["lr"] == 1e-5
    assert ds["optimizer"]["params"]["weight_decay"] == 0.0
    assert [id(p) for p in seen["params"]] == [id(p) for p in model[1].parameters()]


def test_bad_input_fails_before_anything_starts(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text(json.dumps({"hidden_size": 48, "num_attention_heads": 2}))
    args = (["01+02="] * 8, ["03+04="], ["007"], sft, None, CFG.model_copy(update={"reward_model_weight": 0.0}))
    with pytest.raises(ValueError, match="no training prompts"):
        train_policy([], *args[1:], StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    with pytest.raises(ValueError, match="3 training prompts are fewer than prompts_per_step=8"):
        train_policy(["01+02="] * 3, *args[1:], StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    # eval prompts may come without answers (no accuracy), but not with answers for only some
    with pytest.raises(ValueError, match="2 eval prompts but 1 answers"):
        train_policy(args[0], ["03+04=", "05+06="], ["007"], *args[3:], StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    with pytest.raises(ValueError, match="reward_model_weight > 0 but no reward model"):
        train_policy(*args[:5], CFG, StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    with pytest.raises(ValueError, match=r"head size is 24 .* vLLM's CPU backend supports \[32, 64"):
        train_policy(*args, StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    (sft / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="not every training prompt is one addition_exact_match can score"):
        train_policy(["hello"] * 8, *args[1:], StageSite(tmp_path / "o", tmp_path / "ray", "x"))
    assert not (tmp_path / "ray").exists()


def test_the_verifiable_reward_comes_from_the_config_not_the_trainer(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2}))
    args = (["hello"] * 8, ["03+04="], ["007"], sft, None)
    none = PolicyConfig.model_validate(CFG.model_dump() | {"verifiable_reward": None, "verifiable_reward_weight": 0.0})
    assert _check_inputs(*args[:4], tmp_path / "rm", none) is False  # nothing to score: any prompt will do
    own = PolicyConfig.model_validate(CFG.model_dump() | {"reward_model_weight": 0.0,
                                                         "verifiable_reward": f"{__name__}:says_hello"})
    assert _check_inputs(*args, own) is True
    demo = CFG.model_copy(update={"reward_model_weight": 0.0})
    with pytest.raises(ValueError, match="not every training prompt is one addition_exact_match can score"):
        _check_inputs(*args, demo)


def says_hello(prompts, responses):
    """A verifiable reward of a test's own: it parses only `hello`."""
    if any(p != "hello" for p in prompts):
        raise ValueError("not a hello prompt")
    return torch.tensor([float(r == "hi") for r in responses])


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_more_workers_than_cluster_cpus_fails_before_training(ray_cluster, demo, tmp_path):
    cfg = CFG.model_copy(update={"num_workers": 8, "prompts_per_step": 8, "minibatch_size": 64})
    with pytest.raises(ValueError, match=r"policy.num_workers=8 but the Ray cluster has 4 CPUs"):
        run(demo, tmp_path, cfg)
    separate = CFG.model_copy(update={"num_workers": 2, "rollout": RolloutEngineConfig(placement="separate", num_engines=3)})
    with pytest.raises(ValueError, match=r"policy.num_workers=2 with policy.rollout.num_engines=3 .*CPU 5 needed, 4 in "
                                         r"the cluster"):
        run(demo, tmp_path, separate)


LORA = {"lora": {"enabled": True, "rank": 8, "alpha": 16.0}, "learning_rate": 1e-3}


@pytest.mark.slow
@pytest.mark.parametrize("fault, what, update", [
    ("skip:policy:sync", "keeps its weights", {}),
    ("skip:policy:sync-tensors", "takes half the tensors", {}),
    ("skip:policy:lora-merge", "gets LoRA's base weights", LORA),
])
def test_a_sync_that_does_not_take_stops_the_run_at_the_first_sync(ray_cluster, demo, tmp_path, monkeypatch, fault,
                                                                    what, update):
    """The engine is checked after every sync (`policy_sync`): one that keeps its weights, takes
    every other tensor only, or gets a LoRA policy's base weights without the adapters fails the
    check at the first sync, again after the retried sync, and the stage stops with one block,
    keeping no checkpoint of that step."""
    monkeypatch.setenv(FAULT_ENV, fault)
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    cfg = PolicyConfig.model_validate(CFG.model_dump() | update | {"rollout": {"weight_sync": "file"}})
    with pytest.raises(CircuitBreakerTripped) as tripped:
        run(demo, tmp_path, cfg, on_metrics=sink)
    trip, message = tripped.value.trip, str(tripped.value)
    print(f"\nan engine that {what}:\n{message}")
    assert trip.reason == "sync_failed" and trip.step == 1, trip
    assert message.startswith("weight sync failed: the rollout engine does not serve the trainer's weights")
    assert "transport: policy.rollout.weight_sync=file (file, colocated engine)" in message
    assert "check:     " in message and "retried:   " in message and tripped.value.checkpoint_path is None
    [step1] = [json.loads(line) for line in sink.path.read_text().splitlines()][1:]
    assert step1["policy/circuit_breaker_tripped"] == 1.0


@pytest.mark.slow
def test_a_worker_killed_inside_a_round_resumes_and_the_redone_round_trains_on_the_labels_once(
        ray_cluster, demo, tmp_path, monkeypatch):
    """People's labels wait in the queue; the round of step 2 takes them and its worker is killed
    before anything trains or is checkpointed. The resumed attempt redoes step 2 and its round
    under the same id: the labels reach the reward model once, not zero times or twice."""
    queue = tmp_path / "queue"
    (queue / "labelled").mkdir(parents=True)
    rows = [{"prompt": p, "answer_a": "010", "answer_b": "011", "choice": c}
            for p, c in (("04+06=", "A"), ("05+06=", "B"), ("02+03=", "A"))]
    (queue / "labelled" / "people.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    killed = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"kill:policy-round:step2:rank0={killed}")
    cfg = PolicyConfig.model_validate(CFG.model_dump() | {
        "checkpoint_every": 1, "rounds": {"enabled": True, "every": 2, "prompts": 8, "annotator": "queue", "epochs": 1}})
    result = run(demo, tmp_path, cfg, queue_dir=queue)
    assert killed.exists() and result.run.attempts == 2 and result.run.resumed_from_step == 1
    assert result.round_pairs == len(rows)  # the killed attempt's labels, taken again by the redone round
    assert result.run.consumed == [prompt_indices(len(demo["prompts"]), 8, s, cfg.seed) for s in range(cfg.steps)]
    [taken] = (queue / "consumed").iterdir()
    assert [p.name for p in taken.iterdir()] == ["people.jsonl"] and not list((queue / "labelled").iterdir())
    assert [p.stem for p in (queue / "pending").iterdir()] == [taken.name]  # one batch for people, not two


@pytest.mark.slow
def test_a_pipelined_run_with_an_engine_of_its_own_resumes_a_killed_worker_with_the_same_ledger(
        ray_cluster, demo, tmp_path, monkeypatch):
    """Pipelined rollouts (max_lag 1) from an engine of its own: a worker killed at step 3 takes
    the attempt down, engine included; the resumed attempt starts a new engine from the step-2
    checkpoint, drops the batches generated ahead, and draws every step's prompts as an
    uninterrupted run would. The killed attempt's engine gives its placement group back."""
    killed = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"kill:policy:step3:rank1={killed}")
    cfg = CFG.model_copy(update={"num_workers": 2, "pipeline": RolloutPipelineConfig(max_lag=1, chunks=2),
                                 "rollout": RolloutEngineConfig(placement="separate")})
    before = set(ray.util.placement_group_table())
    result = run(demo, tmp_path, cfg)
    engines = [g["state"] for key, g in ray.util.placement_group_table().items() if key not in before
               and g["name"].startswith("rollout-engine")]
    assert killed.exists() and result.run.attempts == 2 and result.run.resumed_from_step == 2
    assert result.run.consumed == [prompt_indices(len(demo["prompts"]), 8, s, cfg.seed) for s in range(cfg.steps)]
    assert max(m["pipeline/lag_max"] for m in result.run.metrics_history) <= 1
    assert engines and set(engines) == {"REMOVED"}, engines  # one per attempt, each given back
    check_finite_run(result, cfg)


@pytest.mark.slow
def test_without_the_check_the_breaker_catches_an_engine_that_keeps_its_weights(ray_cluster, demo, tmp_path,
                                                                                monkeypatch):
    """Defence in depth: with `policy.rollout.verify_sync` off, a sync that silently does nothing
    shows in rollout/prob_diff from the first step after the first skipped sync, and the circuit
    breaker stops the run on it."""
    monkeypatch.setenv(FAULT_ENV, "skip:policy:sync")
    cfg = CFG.model_copy(update={"steps": 6, "checkpoint_every": 100,
                                 "rollout": RolloutEngineConfig(verify_sync=False)})
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with pytest.raises(CircuitBreakerTripped) as tripped:
        run(demo, tmp_path, cfg, on_metrics=sink)
    trip = tripped.value.trip
    drift = [json.loads(line).get("rollout/prob_diff") for line in sink.path.read_text().splitlines()][1:]
    print(f"\nrollout/prob_diff with the sync skipped: {drift}")
    assert trip.reason == "sync_drift", trip
    # step 1 sampled from the weights the trainer started from; the gap grows as the trainer
    # moves away (this machine: 1e-7, then 0.017, 0.044, 0.050, against the fp32 bound 0.01)
    patience, bound = cfg.circuit_breaker.sync_patience, cfg.circuit_breaker.max_prob_diff_fp32
    assert drift[0] < 0.005, drift
    assert trip.step == len(drift) < cfg.steps and all(d > bound for d in drift[-patience:]), drift
    assert "the engine is not sampling from the trainer's weights" in str(tripped.value)
    assert tripped.value.checkpoint_path is None


@pytest.mark.slow
def test_grpo_runs_end_to_end_and_the_engine_follows_the_trainer(ray_cluster, demo, tmp_path, monkeypatch):
    """The weights streamed into the engine over gloo, read from the trainer's module itself
    (the route a GPU run takes, `weight_transfer.ModuleSource`): no copy of the model is made."""
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    cfg = CFG.model_copy(update={"rollout": RolloutEngineConfig(weight_sync="stream", check_sync=True)})
    monkeypatch.setenv(FAULT_ENV, "nan:policy:step3:rank0")
    result = run(demo, tmp_path, cfg, on_metrics=sink)
    check_finite_run(result, CFG)
    assert result.run.attempts == 1 and result.run.resumed_from_step is None
    # (a) right after a sync the engine's greedy answers are the trainer's, and the rollouts of
    # every later step carry the trainer's logprobs (fp32 engine: ~1e-7).
    assert [c["step"] for c in result.sync_checks] == [1, CFG.steps]
    for check in result.sync_checks:
        assert check["engine"] == check["hf"]
    assert result.sync_checks[-1]["hf"] != result.sync_checks[-1]["sft"], "the policy should have moved"
    diffs = [m["rollout/logprob_diff"] for m in result.run.metrics_history]
    assert max(diffs) < 1e-3, diffs
    prob_diffs = [m["rollout/prob_diff"] for m in result.run.metrics_history]
    assert max(prob_diffs) < 0.005, prob_diffs  # verl's "healthy" bar, with room: fp32 both sides
    # every sync was checked right after it, and passed the first time
    gaps = [m["rollout/verify_gap"] for m in result.run.metrics_history]
    assert max(gaps) < 1e-3 and not any(m["rollout/verify_retries"] for m in result.run.metrics_history), gaps
    # The NaN injected at step 3 skipped exactly one optimizer step, and training went on.
    skipped = [m["policy/nonfinite_skipped"] for m in result.run.metrics_history]
    assert skipped == [0, 0, 1, 0] and result.nonfinite_skipped == 1
    logged = [json.loads(line) for line in sink.path.read_text().splitlines()]
    assert logged[0]["step"] == 0 and "eval/accuracy" in logged[0]
    # on_metrics ran on rank 0 once per step, with every worker's figures besides the step's
    assert [{k: v for k, v in m.items() if not k.startswith("worker/")} for m in logged[1:]] == result.run.metrics_history
    for m in logged[1:]:
        assert isinstance(m["worker/0/host"], str) and m["worker/0/samples_per_second"] > 0
        assert m["worker/0/cpu_utilization"] > 0 and m["worker/0/step_seconds"] > 0
        assert not [k for k in m if k.startswith("worker/0/gpu")], m  # a CPU worker: absent, not zero
        assert m["rollout/tokens_per_s"] > 0 and m["rollout/gen_tokens"] > 0  # the engine's own figures
    names = set(result.run.metrics_history[-1])
    for phase in ("generate", "score", "old_logprobs", "ref_logprobs", "values", "advantages", "update", "sync"):
        assert f"timing/{phase}" in names
    assert "policy/step_time_s/worker_0" in names and "eval/accuracy" in names
    # rank 0's high-water mark after each phase, in GiB: it only grows
    peaks = result.peak_memory
    assert list(peaks) == ["loaded", "trained", "saved"], peaks
    assert 0.1 < peaks["loaded"] <= peaks["trained"] <= peaks["saved"] < 16, peaks


@pytest.mark.slow
def test_pipelined_grpo_bounds_the_lag_and_weighs_lagged_tokens(ray_cluster, demo, tmp_path):
    """max_lag 1, two chunks per batch: the engine samples the next batch while the ranks train.
    The engine is one of its own (a Ray actor in a placement group beside the two workers, as
    `placement: separate` makes them; two engines sharing a batch: test_engine_group.py), taking
    the weights from a file on the node."""
    cfg = CFG.model_copy(update={"num_workers": 2,
                                 "pipeline": RolloutPipelineConfig(max_lag=1, chunks=2, is_cap=2.0),
                                 "rollout": RolloutEngineConfig(placement="separate", check_sync=True)})
    before = set(ray.util.placement_group_table())
    result = run(demo, tmp_path, cfg)
    engines = {g["name"]: g["state"] for key, g in ray.util.placement_group_table().items() if key not in before
               and g["name"].startswith("rollout-engine")}
    [(name, state)] = engines.items()
    assert name.endswith("-0") and state == "REMOVED"  # the run's one engine, used, then given back
    check_finite_run(result, cfg)
    history = result.run.metrics_history
    print("\n".join(f"step {m['step']}: lag {m['pipeline/lag_mean']:.2f} |log pi_old - log mu| "
                     f"{m['pipeline/is_log_ratio_abs']:.2e} wait {m['pipeline/wait_s']:.2f}s" for m in history))
    lags = [m["pipeline/lag_max"] for m in history]
    assert max(lags) == 1 and min(lags) >= 0
    assert history[0]["pipeline/lag_max"] == 0  # nothing older than the SFT policy exists
    for m in history:
        assert 0 < m["pipeline/is_weight_mean"] <= cfg.pipeline.is_cap
        if m["pipeline/lag_max"] == 0:  # sampled by the weights being trained: ratios are 1 (fp32)
            assert m["pipeline/is_log_ratio_abs"] < 1e-4, m
        if m["pipeline/lag_mean"] == 1:  # sampled one update ago: the trainer's policy has moved
            assert m["pipeline/is_log_ratio_abs"] > 1e-3, m
    # evaluation and the sync check take the engine between chunks, with the newest weights
    for check in result.sync_checks:
        assert check["engine"] == check["hf"]
    assert result.sync_checks[-1]["hf"] != result.sync_checks[-1]["sft"], "the policy should have moved"


@pytest.mark.slow
def test_pipelined_ppo_on_two_workers_with_parameters_sharded_keeps_its_critic_and_the_engine_in_step(
        ray_cluster, demo, tmp_path):
    """PPO with the KL in the reward and a value model, on two workers under ZeRO-3 (the actor's
    and the critic's parameters sharded over both), rollouts one update behind. The weights the
    engine receives are gathered from both workers and streamed into it (the weight transfer a GPU
    run uses, over gloo here) from the pipeline's producer thread, and after each sync it answers
    as the trainer does; the lag correction weighs the tokens sampled by older weights."""
    cfg = CFG.model_copy(update={"algorithm": "ppo", "num_workers": 2, "prompts_per_step": 16,
                                 "minibatch_size": 16, "micro_batch_size": 4, "zero_stage": 3,
                                 "pipeline": RolloutPipelineConfig(max_lag=1, chunks=2, is_cap=2.0),
                                 "rollout": RolloutEngineConfig(weight_sync="stream", check_sync=True)})
    result = run(demo, tmp_path, cfg)
    check_finite_run(result, cfg)
    for check in result.sync_checks:
        assert check["engine"] == check["hf"]
    assert result.sync_checks[-1]["hf"] != result.sync_checks[-1]["sft"], "the policy should have moved"
    history = result.run.metrics_history
    assert max(m["pipeline/lag_max"] for m in history) == 1
    for m in history:
        for name in ("policy/value_loss", "policy/explained_variance", "policy/critic_grad_norm",
                     "policy/step_time_s/worker_1"):
            assert name in m and (math.isfinite(m[name]) or name == "policy/explained_variance"), (name, m)
        assert 0 < m["pipeline/is_weight_mean"] <= cfg.pipeline.is_cap, m
        if m["pipeline/lag_mean"] == 1:
            assert m["pipeline/is_log_ratio_abs"] > 1e-3, m


@pytest.mark.slow
def test_grpo_with_lora_an_ensemble_audit_and_rounds_resumes_a_killed_worker_and_the_engine_follows(
        ray_cluster, demo, tmp_path, monkeypatch):
    """The options that save memory and time together (LoRA, gradient checkpointing and bf16
    mixed precision, on two workers), with the reward model alone as the reward: a 3-member
    ensemble (mean - std), bounded shaping and a length penalty, an audit model, and a
    preference round at step 2 labelled by the simulated annotator.

    The reference is the actor with its adapters off, so the first step's rollouts (B = 0: the
    adapted policy is the SFT one) have a KL of exactly 0. A worker killed at step 3 resumes from
    step 2's checkpoint, which holds the adapters and their optimizer state (not the frozen
    base) and the round's reward and audit weights: nothing is labelled twice, and the resumed
    run continues at the next prompt batch, the one an unbroken run uses. After each sync
    (streamed over gloo, each weight merged with its adapters as it is sent: no merged copy of
    the model) the engine's greedy answers are the trainer's; the saved model is a plain one,
    which vLLM loads and answers as the trainer's last weights did."""
    tok = load_tokenizer(demo["sft"])
    prompts = demo["prompts"][:64]
    ensemble = reward_model_from_base(demo["sft"], seed=1, num_members=3).eval()
    raw = score_members(ensemble, tok, prompts, [str(i % 200).zfill(3) for i in range(len(prompts))], 32)  # (3, B)
    members = [reward_stats(m) for m in raw]
    save_reward_model(ensemble, tok, tmp_path / "rm", reward_stats(raw.mean(0)),
                      extra={"member_stats": [[m.mean, m.std] for m in members]})
    save_reward_model(reward_model_from_base(demo["sft"], seed=2).eval(), tok, tmp_path / "rm" / "audit",
                      reward_stats(raw[0]))
    cfg = PolicyConfig.model_validate(CFG.model_dump() | {
        "num_workers": 2, "learning_rate": 1e-3, "reward_model_weight": 1.0, "verifiable_reward_weight": 0.0,
        "lora": {"enabled": True, "rank": 8, "alpha": 16.0}, "gradient_checkpointing": True, "precision": "bf16",
        "rollout": {"weight_sync": "stream", "check_sync": True},
        "shaping": {"aggregate": "mean_minus_std", "bounded": True, "length_penalty": 0.1},
        "rounds": {"enabled": True, "every": 2, "prompts": 32, "audit_share": 0.5, "epochs": 1},
    })
    killed = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"kill:policy:step3:rank1={killed}")
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    result = train_policy(demo["prompts"], demo["eval_prompts"], demo["eval_answers"], demo["sft"], tmp_path / "rm",
                          cfg, StageSite(tmp_path / "policy", tmp_path / "ray", "policy", sink),
                          replay_pairs=[{"prompt": p, "chosen": "1", "rejected": "2"} for p in prompts],
                          )
    check_finite_run(result, cfg)
    assert killed.exists() and result.run.attempts == 2 and result.run.resumed_from_step == 2
    assert result.run.consumed == [prompt_indices(len(demo["prompts"]), 8, s, cfg.seed) for s in range(cfg.steps)]

    # LoRA: the reference is the adapters-off actor, and the policy moves away from it
    kls = [m["policy/kl"] for m in result.run.metrics_history]
    assert abs(kls[0]) < 1e-6 and max(kls) > 1e-4, kls
    for check in result.sync_checks:
        assert check["engine"] == check["hf"]
    assert result.sync_checks[-1]["hf"] != result.sync_checks[-1]["sft"], "the policy should have moved"
    [module_file] = (Path(result.run.checkpoint_path) / "actor").glob("*model_states.pt")
    saved_module = torch.load(module_file, weights_only=False)["module"]
    assert saved_module and all(".lora_" in k for k in saved_module), sorted(saved_module)[:5]
    assert json.loads((result.path / "rlhf_meta.json").read_text())["precision"] == "bf16"
    saved = load_policy(result.path)
    assert type(saved).__name__ == "LlamaForCausalLM"
    assert set(saved.state_dict()) == set(load_policy(demo["sft"]).state_dict())  # merged: no adapter keys
    assert not any(p.name.startswith("adapter") for p in result.path.iterdir())

    # the ensemble, the audit model, the shaping and the round
    history = {m["step"]: m for m in result.run.metrics_history}
    for step, m in history.items():
        assert m["policy/ensemble_disagreement"] > 0 and math.isfinite(m["policy/audit_score_mean"])
        assert m["policy/shaped_reward_mean"] < 1  # a sigmoid, less a length penalty
        assert ("rounds/asked" in m) == (step == 2)  # a round at step 2; none after the last step
    r = history[2]
    assert r["rounds/asked"] + r["rounds/identical"] == 32
    assert r["rounds/labelled"] + r["rounds/tie"] == r["rounds/asked"]
    assert r["rounds/labelled"] == r["rounds/new_pairs"] + r["rounds/contract_dropped"]
    assert r["rounds/proxy_pairs"] + r["rounds/audit_pairs"] == r["rounds/new_pairs"]
    assert result.labels_asked == r["rounds/asked"]  # the resumed attempt did not ask again
    assert result.round_pairs == r["rounds/proxy_pairs"]
    assert (result.path / "audit" / "rlhf_meta.json").exists() == (r["rounds/audit_pairs"] > 0)

    # what is registered and served: vLLM loads the saved directory as it is, and answers as
    # the trainer's last weights did
    from rlhf_core.rollout.vllm_engine import RolloutEngine

    prompts = demo["eval_prompts"][:len(result.sync_checks[-1]["hf"])]
    engine = RolloutEngine(result.path, dtype="float32", seed=0, max_model_len=64, max_num_seqs=16)
    try:
        served = [r.response_text for r in engine.generate(prompts, n=1, temperature=0.0, max_tokens=cfg.max_new_tokens)]
    finally:
        engine.close()
    assert served == result.sync_checks[-1]["hf"]


@pytest.mark.slow
def test_a_stop_requested_through_mlflow_stops_after_the_step_with_a_checkpoint_and_the_run_resumes(
        ray_cluster, demo, tmp_path):
    """A stop requested on the stage's MLflow run (what the receiver does for a `stop` alert)
    reaches both ranks after step 1: the stage saves step 1's checkpoint, though its
    `checkpoint_every` is 2, and ends with `StageStopped` naming it. Run again, the stage
    resumes from that checkpoint and draws every step's prompts as an uninterrupted run would."""
    from mlflow.tracking import MlflowClient

    from monitoring.stop import StopRequests, request_stop

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("policy")).info.run_id
    request_stop(uri, run_id, "GPU 3 reported XID error 79", "alertmanager:rlhf-receiver")
    cfg = CFG.model_copy(update={"num_workers": 2})
    site = StageSite(tmp_path / "policy", tmp_path / "ray", "policy", stop_requested=StopRequests(uri, run_id, 0.0))
    with pytest.raises(StageStopped) as stopped:
        train_policy(demo["prompts"], demo["eval_prompts"], demo["eval_answers"], demo["sft"], demo["rm"], cfg, site)
    assert stopped.value.step == 1 and stopped.value.checkpoint_path is not None
    assert "stopped on request after step 1 (GPU 3 reported XID error 79 (requested by alertmanager:rlhf-receiver))" \
        in str(stopped.value)
    assert not (tmp_path / "policy" / "model.safetensors").exists()  # stopped, not finished
    result = run(demo, tmp_path, cfg)
    assert result.run.resumed_from_step == 1
    assert result.run.consumed == [prompt_indices(len(demo["prompts"]), 8, s, cfg.seed) for s in range(cfg.steps)]
    check_finite_run(result, cfg)
