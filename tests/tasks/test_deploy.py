"""`rlhf serving ensure`'s choice (what `make demo-loop` starts from): the rule over the states."""
import pytest

from tasks.deploy import serving_plan


@pytest.mark.parametrize(
    "serving, champion, action, message",
    [
        ("2", "2", "none", "policy v2 serves"),
        ("1", "2", "none", "policy v1 serves"),  # not the champion, but it serves: `serving status` tells
        ("1", None, "none", "policy v1 serves"),
        (None, "2", "deploy", "nothing serves; deploying the champion, policy v2"),  # after `rlhf serving stop`
        (None, None, "demo", "nothing serves and there is no champion: running the demo to train one"),
    ],
)
def test_serving_plan(serving, champion, action, message):
    plan = serving_plan(serving, champion)
    assert (plan.action, plan.message) == (action, message)
