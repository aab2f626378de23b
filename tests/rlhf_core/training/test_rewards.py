import pytest
import torch

from rlhf_core.config import ConfigError, PolicyConfig, parse_config
from rlhf_core.data.demo_task import addition_exact_match, addition_target
from rlhf_core.data.synthetic import answer_for, prompt_for
from rlhf_core.models.reward import RewardStats
from rlhf_core.training.rewards import combine_rewards
from rlhf_core.training.verifiable import (
    VERIFIABLE_REWARDS, resolve_verifiable_reward, score_verifiable, takes_answers,
)


def test_addition_target_is_the_demo_answer_for_every_width():
    for a, b, width in [(7, 48, 2), (0, 0, 2), (99, 99, 2), (5, 3, 1), (123, 877, 3)]:
        assert addition_target(prompt_for(a, b, width)) == answer_for(a + b, width)
    with pytest.raises(ValueError, match="not an addition prompt"):
        addition_target("what is 2+2?")


def test_exact_match_reward_is_one_only_for_the_padded_sum():
    reward = resolve_verifiable_reward("addition_exact_match")
    assert reward is addition_exact_match
    prompts = ["07+48=", "07+48=", "07+48=", "07+48=", "19+01="]
    responses = ["055", " 055\n", "55", "045", "020"]
    assert reward(prompts, responses).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward(prompts[:2], responses[:1])


def test_unknown_verifiable_reward_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown verifiable reward 'regex'; registered: addition_exact_match"):
        resolve_verifiable_reward("regex")


def test_verifiable_reward_resolves_a_registered_name_a_module_function_and_none():
    assert set(VERIFIABLE_REWARDS) == {"addition_exact_match", "answer_exact_match", "last_number_match",
                                       "answer_in_response", "holds_answer", "not_refused"}
    for name in VERIFIABLE_REWARDS:  # every registered path imports
        assert callable(resolve_verifiable_reward(name))
    assert resolve_verifiable_reward("rlhf_core.data.demo_task:addition_exact_match") is addition_exact_match
    assert resolve_verifiable_reward(None) is None
    with pytest.raises(ValueError, match="'rlhf_core.data.demo_task:nothing' cannot be imported"):
        resolve_verifiable_reward("rlhf_core.data.demo_task:nothing")
    with pytest.raises(ValueError, match="'no_such_module_xyz:f' cannot be imported"):
        resolve_verifiable_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="'rlhf_core.data.demo_task:_ADDITION' is not a function"):
        resolve_verifiable_reward("rlhf_core.data.demo_task:_ADDITION")
    with pytest.raises(ValueError, match="expected module:function"):
        resolve_verifiable_reward(":addition_exact_match")


def test_answer_exact_match_scores_against_each_prompts_answer():
    fn = resolve_verifiable_reward("answer_exact_match")
    assert takes_answers(fn) and not takes_answers(addition_exact_match)
    got = score_verifiable(fn, ["a", "b", "c"], [" 4 ", "5", "x"], {"a": "4", "b": "6", "c": "x"})
    assert got.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="1 prompts have no answer, e.g. 'd'"):
        score_verifiable(fn, ["a", "d"], ["4", "4"], {"a": "4"})
    # a reward without answers is called as before
    assert score_verifiable(addition_exact_match, ["07+48="], ["055"], {"07+48=": "ignored"}).tolist() == [1.0]


def _policy_config_problems(policy: dict) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config({"policy": policy})
    return exc.value.problems


def test_the_default_reward_is_the_reward_model_alone():
    """The defaults describe no task: a user's run learns from its reward model and no answer
    checker of the demo's is switched on behind its back."""
    cfg = PolicyConfig()
    assert (cfg.reward_model_weight, cfg.verifiable_reward_weight, cfg.verifiable_reward) == (1.0, 0.0, None)


def test_policy_config_names_its_verifiable_reward():
    assert PolicyConfig(verifiable_reward="addition_exact_match").verifiable_reward == "addition_exact_match"
    assert PolicyConfig(verifiable_reward="rlhf_core.data.demo_task:addition_exact_match").verifiable_reward
    assert PolicyConfig(verifiable_reward=None, verifiable_reward_weight=0.0).verifiable_reward is None
    [problem] = _policy_config_problems({"verifiable_reward": "regex"})
    assert problem.startswith("policy.verifiable_reward: unknown verifiable reward 'regex'; registered: "
                              "addition_exact_match"), problem
    [problem] = _policy_config_problems({"verifiable_reward": "no_such_module_xyz:f"})
    assert problem.startswith("policy.verifiable_reward: verifiable reward 'no_such_module_xyz:f' cannot be imported")
    [problem] = _policy_config_problems({"verifiable_reward": None, "verifiable_reward_weight": 1.0})
    assert problem.startswith("policy: verifiable_reward is null but verifiable_reward_weight is 1.0"), problem


def test_combine_normalises_the_reward_model_and_weights_both_terms():
    rm = torch.tensor([1.0, 3.0, 5.0])
    stats = RewardStats(mean=3.0, std=2.0)
    verifiable = torch.tensor([0.0, 1.0, 1.0])
    torch.testing.assert_close(combine_rewards(rm, stats, None, 1.0, 0.0), torch.tensor([-1.0, 0.0, 1.0]))
    torch.testing.assert_close(combine_rewards(None, None, verifiable, 0.0, 2.0), torch.tensor([0.0, 2.0, 2.0]))
    torch.testing.assert_close(combine_rewards(rm, stats, verifiable, 0.5, 1.0), torch.tensor([-0.5, 1.0, 1.5]))


def test_combine_refuses_a_weighted_term_that_is_missing():
    with pytest.raises(ValueError, match="reward-model scores"):
        combine_rewards(None, None, torch.ones(2), 1.0, 1.0)
    with pytest.raises(ValueError, match="needs verifiable rewards"):
        combine_rewards(torch.ones(2), RewardStats(0.0, 1.0), None, 1.0, 1.0)
    with pytest.raises(ValueError, match="no reward"):
        combine_rewards(torch.ones(2), RewardStats(0.0, 1.0), torch.ones(2), 0.0, 0.0)
