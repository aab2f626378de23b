"""The simulated users' labels follow the answer key, with the configured noise."""
import random

import pytest

from rlhf_core.feedback.simulated_users import UsersConfig, _label, closeness, fresh_prompts, main, simulate


def test_closeness_ranks_the_right_sum_then_nearer_numbers_then_text():
    assert closeness("046", "046") == 0 > closeness("047", "046") > closeness("146", "046") > closeness("x", "046")
    assert closeness("0x6", "046") > closeness("0xx", "046") > closeness("xxx", "046") == closeness("", "046")


def test_thumbs_follow_the_answer_key_and_noise_flips_that_share():
    rng = random.Random(0)
    clean = UsersConfig(label_noise=0.0)
    assert _label(["046"], "046", clean, rng) == {"rating": "up"}
    assert _label([" 036"], "046", clean, rng) == {"rating": "down"}
    noisy = UsersConfig(label_noise=0.2)
    downs = sum(_label(["046"], "046", noisy, rng)["rating"] == "down" for _ in range(5000))
    assert abs(downs / 5000 - 0.2) < 4 * (0.2 * 0.8 / 5000) ** 0.5


def test_choices_prefer_the_right_or_nearer_sum_and_skip_ties():
    rng, clean = random.Random(0), UsersConfig(label_noise=0.0)
    assert _label(["036", "046"], "046", clean, rng) == {"preferred": 1}
    assert _label(["045", "056"], "046", clean, rng) == {"preferred": 0}
    assert _label(["045", "047"], "046", clean, rng) is None
    assert _label(["046", "999"], "046", UsersConfig(unhappy=True, label_noise=0.0), rng) == {"preferred": 1}
    assert _label(["046"], "046", UsersConfig(unhappy=True, label_noise=0.0), rng) == {"rating": "down"}


def test_fresh_prompts_never_ask_an_excluded_prompt():
    prompts = fresh_prompts(random.Random(0), 500, 9, exclude={"1+1=", "2+3="})
    assert len(prompts) == 500 and not {"1+1=", "2+3="} & set(prompts)


def test_the_command_line_takes_every_setting(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr("rlhf_core.feedback.simulated_users.simulate",
                        lambda url, key, cfg, exclude, user_secret: seen.update(url=url, cfg=cfg, secret=user_secret)
                        or {})
    key, user_secret = tmp_path / "k", tmp_path / "s"
    key.write_text("secret\n")
    user_secret.write_text("signing\n")
    main(["--base-url", "http://x/v1", "--api-key-file", str(key), "--user-secret-file", str(user_secret),
          "--users", "3", "--unhappy", "--label-noise", "0"])
    assert seen["cfg"] == UsersConfig(users=3, unhappy=True, label_noise=0.0) and seen["secret"] == "signing"


def test_simulated_users_sign_their_ids_and_the_gateway_takes_their_ratings(tmp_path):
    """The users against the gateway (in process, a stand-in for vLLM behind it), which refuses
    unsigned feedback: every rating is accepted, under its own user."""
    import openai
    from starlette.testclient import TestClient

    from rlhf_core.feedback.store import FeedbackStore, hash_user, sqlite_url
    from rlhf_core.serving.gateway import Gateway
    from rlhf_core.serving.user_auth import UserAuth
    from tests.rlhf_core.serving.fake_upstream import fake_upstream

    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    gateway = Gateway(store, tmp_path / "serving", "key", "salt", users=UserAuth("signing-secret"))
    cfg = UsersConfig(users=2, requests_per_user=3, choice_share=0.0)
    with fake_upstream(tmp_path / "serving"), TestClient(gateway.app(), base_url="http://gw") as client:
        counts = simulate("http://gw/v1", "key", cfg, user_secret="signing-secret", http_client=client)
        with pytest.raises(openai.AuthenticationError, match="x-user-signature"):
            simulate("http://gw/v1", "key", cfg, user_secret="not-the-secret", http_client=client)
    rated = counts.get("thumbs_up", 0) + counts.get("thumbs_down", 0)
    assert counts["requests"] == 6 and rated == 6 and not [k for k in counts if k.startswith("refused")], counts
    ratings, _ = store.feedback_between(0, 1e12)
    assert {r["user_hash"] for r in ratings} == {hash_user(f"sim-user-0-{u}", "salt") for u in range(2)}
    store.close()
