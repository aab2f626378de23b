"""The check after every weight sync, its arithmetic against closed forms (the runs that break a
sync on purpose are in test_policy_trainer.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rlhf_core.rollout.sync_check import PROBE_ROWS, Verdict, prob_gap, probe_of, verdict


@dataclass
class Row:
    prompt_token_ids: list[int]
    response_token_ids: list[int]


def test_the_gap_is_the_mean_absolute_difference_of_the_probabilities_over_all_tokens():
    a = [[math.log(0.5), math.log(0.25)], [math.log(0.9)]]
    b = [torch.tensor([math.log(0.4), math.log(0.25)]), torch.tensor([math.log(0.6)])]
    assert prob_gap(a, b) == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert prob_gap(a, a) == 0.0
    assert math.isnan(prob_gap([[float("nan")]], [[0.0]]))
    with pytest.raises(ValueError):  # rows of different lengths: not the same tokens
        prob_gap([[0.0, 0.0]], [[0.0]])


def test_the_probe_is_the_first_rows_that_have_a_response_and_leave_the_engine_a_token():
    rows = [Row([1, 2], []), *[Row([1, k], [k, k + 1]) for k in range(10)]]
    probe = probe_of(rows)
    assert len(probe.rows) == PROBE_ROWS and probe.rows[0] is rows[1]
    assert probe.prompt_ids[0] == [1, 0] and probe.response_ids[0] == [0, 1] and probe.tokens == 2 * PROBE_ROWS
    full = [Row([1, 2, 3], [4, 5, 6]), Row([1, 2], [3, 4])]  # 6 tokens fill an engine of 6; 4 leave it two
    assert probe_of(full, room=6).rows == [full[1]] and probe_of(full[:1], room=6).rows == []


def test_the_worst_engine_of_a_group_decides_and_the_least_moved_one():
    lp = [[math.log(0.5)]]
    trainer = [torch.tensor([math.log(0.5)])]
    found = verdict([lp, [[math.log(0.3)]]], trainer, None, None)
    assert found.gap == pytest.approx(0.2) and found.moved is None
    # first sync: engine 1 moved with the trainer (0.4 -> 0.5), engine 0 never left 0.5
    moved = verdict([lp, lp], trainer, [lp, [[math.log(0.4)]]], [torch.tensor([math.log(0.4)])])
    assert moved.moved == pytest.approx(0.0) and moved.trainer_moved == pytest.approx(0.1)
    assert moved.noise == pytest.approx(0.1)  # engine 0 already said 0.5 where the trainer said 0.4


@pytest.mark.parametrize("found, expected", [
    pytest.param(Verdict(0.004), None, id="in-parity"),
    pytest.param(Verdict(0.01), None, id="at-the-bound"),
    pytest.param(Verdict(0.02), "differ from the trainer's by 0.02 on average over 16 probe tokens, above 0.01",
                 id="above"),
    pytest.param(Verdict(float("nan")), "are not numbers (NaN)", id="nan"),
    pytest.param(Verdict(0.001, 0.003, 0.004, 1e-7), None, id="moved-with-the-trainer"),
    pytest.param(Verdict(0.001, 0.0, 0.004, 1e-7), "moved 0 on average over 16 probe tokens, the trainer's 0.004",
                 id="stayed-on-the-sft-weights"),
    pytest.param(Verdict(0.001, 0.0, 0.0), None, id="neither-moved"),
    pytest.param(Verdict(0.003, 0.0, 0.004, 0.003), None, id="a-move-within-the-precisions-noise-tells-nothing"),
])
def test_a_verdict_fails_on_a_gap_above_the_bound_or_an_engine_left_behind(found, expected):
    failed = found.failure(0.01, 16)
    assert (failed is None) == (expected is None)
    if expected is not None:
        assert expected in failed, failed


def test_an_engine_still_asleep_after_the_sync_fails_the_check_twice_and_stops_the_stage(monkeypatch):
    """A colocated engine on a GPU sleeps through the update and wakes in the sync: a sync that
    never reached it leaves it asleep, its weights released. The check says so without asking it
    (vLLM would read memory it no longer maps), syncs again, and stops the stage when it still sleeps."""
    from types import SimpleNamespace

    from rlhf_core.config import PolicyConfig
    from rlhf_core.distributed import policy_sync

    monkeypatch.setattr(policy_sync, "trainer_logprobs", lambda w, probe: [torch.zeros(2)])

    class Asleep:
        asleep = True

        def probe(self, prompt_ids, response_ids):
            raise AssertionError("a sleeping engine was asked for log-probs")

    resyncs = []
    w = SimpleNamespace(rank=0, world=1, engine=Asleep(), cfg=PolicyConfig(), device=torch.device("cuda", 0))
    check = policy_sync.SyncCheck(probe_of([Row([1, 2], [3, 4])]))
    metrics, block = check.run(w, 0.01, lambda: resyncs.append(1))
    assert resyncs == [1] and math.isnan(metrics["rollout/verify_gap"])
    assert block.splitlines()[0] == "weight sync failed: the rollout engine does not serve the trainer's weights " \
                                    "after the sync"
    assert "check:     the engine still sleeps after the sync: no weights woke it" in block
    assert "transport: policy.rollout.weight_sync=auto (stream, colocated engine)" in block
