import pytest
import torch

from rlhf_core.data.synthetic import answer_for, prompt_for
from rlhf_core.models.reward import RewardStats
from rlhf_core.training.rewards import VERIFIABLE_REWARDS, addition_target, combine_rewards


def test_addition_target_is_the_demo_answer_for_every_width():
    for a, b, width in [(7, 48, 2), (0, 0, 2), (99, 99, 2), (5, 3, 1), (123, 877, 3)]:
        assert addition_target(prompt_for(a, b, width)) == answer_for(a + b, width)
    with pytest.raises(ValueError, match="not an addition prompt"):
        addition_target("what is 2+2?")


def test_exact_match_reward_is_one_only_for_the_padded_sum():
    reward = VERIFIABLE_REWARDS["addition_exact_match"]
    prompts = ["07+48=", "07+48=", "07+48=", "07+48=", "19+01="]
    responses = ["055", " 055\n", "55", "045", "020"]
    assert reward(prompts, responses).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward(prompts[:2], responses[:1])


def test_unknown_verifiable_reward_names_the_known_ones():
    with pytest.raises(KeyError, match="addition_exact_match"):
        VERIFIABLE_REWARDS["regex"]


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
