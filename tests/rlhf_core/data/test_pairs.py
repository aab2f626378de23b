import itertools

import pytest
import torch

from rlhf_core.data.pairs import (
    OverlengthError,
    collate_pairs,
    encode_pair_text,
    epoch_permutation,
    rank_step_indices,
    shard,
    split_by_prompt,
    tokenize_pairs,
)
from rlhf_core.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=300)


def pair(i, prompt, chosen, rejected):
    return {"id": f"pair-{i}", "prompt": prompt, "chosen": chosen, "rejected": rejected}


def test_pair_text_is_bos_prompt_response_eos(tok):
    ids = encode_pair_text(tok, "12+7=", "19")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "12+7=19"
    assert len(ids) == 1 + 7 + 1  # digits are single tokens


def test_tokenize_pads_right_and_keeps_lengths(tok):
    rows = [pair(0, "1+2=", "3", "4"), pair(1, "12+19=", "31", "21")]
    t = tokenize_pairs(rows, tok, max_length=32)
    assert t.truncated == 0 and len(t) == 2
    assert list(t.chosen_lengths) == [len(encode_pair_text(tok, "1+2=", "3")), len(encode_pair_text(tok, "12+19=", "31"))]
    assert (t.chosen_ids[0, t.chosen_lengths[0] :] == tok.pad_token_id).all()
    batch = collate_pairs(t, [1, 0])
    assert batch.num_pairs == 2 and batch.input_ids.shape == (4, int(max(t.chosen_lengths.max(), t.rejected_lengths.max())))
    assert batch.input_ids[0].tolist()[: t.chosen_lengths[1]] == encode_pair_text(tok, "12+19=", "31")
    assert batch.input_ids[2].tolist()[: t.rejected_lengths[1]] == encode_pair_text(tok, "12+19=", "21")
    assert batch.attention_mask.sum(1).tolist() == [
        t.chosen_lengths[1], t.chosen_lengths[0], t.rejected_lengths[1], t.rejected_lengths[0]
    ]
    assert (batch.input_ids[batch.attention_mask == 0] == tok.pad_token_id).all()


def test_truncate_cuts_to_max_length_and_counts_pairs(tok):
    rows = [pair(0, "1+2=", "3", "4"), pair(1, "12+19=", "31", "21"), pair(2, "11+11=", "22", "2222")]
    # lengths: row 0: 7/7, row 1: 10/10, row 2: 10/12
    t = tokenize_pairs(rows, tok, max_length=9)
    assert t.truncated == 2  # a pair counts once even when both sides are cut
    assert t.chosen_lengths.max() == 9 and t.rejected_lengths.max() == 9
    assert t.chosen_ids[1].tolist() == encode_pair_text(tok, "12+19=", "31")[:9]


def test_reject_names_how_many_rows_and_which(tok):
    rows = [pair(i, "1+2=", "3", "4") for i in range(3)] + [pair(i, "12+19=", "31", "21") for i in range(3, 11)]
    with pytest.raises(OverlengthError) as err:
        tokenize_pairs(rows, tok, max_length=9, on_overlength="reject")
    msg = str(err.value)
    assert "8 of 11 preference pairs exceed max_length=9" in msg
    assert "id=pair-3 (10 tokens)" in msg and "id=pair-7" in msg and "id=pair-8" not in msg
    assert "and 3 more" in msg and "on_overlength=truncate" in msg


def test_reject_falls_back_to_line_then_position(tok):
    rows = [{"prompt": "12+19=", "chosen": "31", "rejected": "21", "_line": 7}, {"prompt": "12+19=", "chosen": "31", "rejected": "21"}]
    with pytest.raises(OverlengthError, match=r"line 7 \(10 tokens\), row 1 \(10 tokens\)"):
        tokenize_pairs(rows, tok, max_length=9, on_overlength="reject")


def test_split_by_prompt_has_no_leakage_and_is_deterministic():
    rows = [pair(i, f"{i % 40}+1=", str(i % 40 + 1), "0") for i in range(200)]  # 40 prompts, 5 rows each
    train, held = split_by_prompt(rows, eval_share=0.25, seed=3)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert len({r["prompt"] for r in held}) == 10 and len(train) + len(held) == 200
    assert split_by_prompt(rows, 0.25, 3) == (train, held)
    assert split_by_prompt(list(reversed(rows)), 0.25, 3)[1] == list(reversed(held))  # row order does not matter
    assert split_by_prompt(rows, 0.25, 4)[1] != held


def test_split_keeps_both_sides_non_empty():
    rows = [pair(0, "1+1=", "2", "3"), pair(1, "1+2=", "3", "4")]
    train, held = split_by_prompt(rows, eval_share=0.01, seed=0)
    assert len(train) == 1 and len(held) == 1


@pytest.mark.parametrize("n,world", [(10, 1), (10, 2), (10, 3), (7, 4), (3, 4), (0, 2)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(n, world):
    shards = [shard(n, r, world) for r in range(world)]
    assert all(len(s) == n // world for s in shards)
    for a, b in itertools.combinations(shards, 2):
        assert not set(a) & set(b)
    assert sorted(itertools.chain(*shards)) == list(range(n - n % world))


def test_epoch_plan_equal_steps_per_rank_and_each_step_is_a_contiguous_slice_of_the_epoch_order():
    n, world, b = 23, 2, 3  # global batch 6: 3 steps, 5 pairs dropped this epoch
    plans = [rank_step_indices(n, seed=1, epoch=2, rank=r, world_size=world, per_rank_batch=b) for r in range(world)]
    assert [len(p) for p in plans] == [3, 3] and all(len(s) == b for p in plans for s in p)
    order = epoch_permutation(n, seed=1, epoch=2)
    for step in range(3):
        assert sorted(plans[0][step] + plans[1][step]) == sorted(order[step * 6 : (step + 1) * 6])
    assert epoch_permutation(n, 1, 2) == order and epoch_permutation(n, 1, 3) != order


def test_collate_handles_rejected_wider_than_chosen(tok):
    t = tokenize_pairs([pair(0, "1+2=", "3", "44444")], tok, max_length=32)
    batch = collate_pairs(t, [0])
    assert batch.input_ids.shape == (2, 11) and batch.attention_mask[0].sum() == 7
    assert torch.equal(batch.input_ids[0, 7:], torch.full((4,), tok.pad_token_id))
