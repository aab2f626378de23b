"""The deploy's smoke completion asks a chat model through its chat template, and any other
model with the raw prompt."""
from __future__ import annotations

import json

import pytest

from rlhf_core.config import ServingConfig
from rlhf_core.serving.client import complete, has_chat_template
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.server import smoke
from rlhf_core.serving.state import Endpoint
from tests.rlhf_core.serving.fake_upstream import fake_upstream


@pytest.mark.parametrize(("files", "chat"), [
    ({"chat_template.jinja": "{{ messages }}"}, True),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}, True),
    ({"tokenizer_config.json": json.dumps({"model_max_length": 64})}, False),
    ({"tokenizer_config.json": "not json"}, False),
    ({}, False),
])
def test_a_chat_template_is_found_where_transformers_keeps_it(tmp_path, files, chat):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert has_chat_template(tmp_path) is chat


def test_the_smoke_asks_in_a_chat_when_the_served_model_has_a_template(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    cfg = ServingConfig(smoke_prompt="What is 2 plus 3?", smoke_max_tokens=8)
    with fake_upstream(tmp_path / "state") as fake:
        endpoint = Endpoint(url=fake.url, host="127.0.0.1", port=0, pid=0, served_model_name="policy-v1",
                            version="1", model_dir=str(model), log_path="", started_at="")
        plain = smoke(endpoint, None, cfg)
        (model / "chat_template.jinja").write_text("{{ messages }}")
        chat = smoke(endpoint, None, cfg)
    assert plain == chat == "046"
    assert [path for _, path, _ in fake.completions()] == ["/v1/completions", "/v1/chat/completions"]


def test_a_chat_answer_without_content_is_one_clear_error(tmp_path):
    with fake_upstream(tmp_path / "state") as fake:
        fake.completion_status, fake.completion_error = 500, "engine died"
        with pytest.raises(ServingError, match=r"POST http://127.0.0.1:\d+/v1/chat/completions: HTTP 500: engine died"):
            complete(fake.url, None, "policy-v1", "Hi", chat=True)
