"""The HTTP calls serving makes to a vLLM server: health, the models it serves, one completion,
the requests it has in hand."""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from rlhf_core.serving.errors import ServingError


def health(url: str, timeout: float = 5) -> bool:
    try:
        with _client(timeout) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def list_models(url: str, api_key: str | None) -> list[str]:
    with _client(30) as client:
        r = client.get(f"{url}/v1/models", headers=_auth(api_key))
    if r.status_code != 200:
        raise ServingError(f"GET {url}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
    return [m["id"] for m in r.json()["data"]]


def complete(url: str, api_key: str | None, model: str, prompt: str, max_tokens: int = 8, chat: bool = False) -> str:
    """One greedy (temperature 0) completion; its text. With `chat`, `prompt` is the user's turn
    of a `/v1/chat/completions` request (the model's chat template renders it); else it is the
    raw text of a `/v1/completions` request."""
    path, field = ("/v1/chat/completions", "message.content") if chat else ("/v1/completions", "text")
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    with _client(120) as client:
        r = client.post(f"{url}{path}", headers=_auth(api_key), json=body)
    if r.status_code != 200:
        raise ServingError(f"POST {url}{path}: HTTP {r.status_code}: {r.text[:200]}")
    try:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ServingError(f"POST {url}{path}: no choices[0].{field} in {r.text[:200]!r}") from e
    if not isinstance(text, str):
        raise ServingError(f"POST {url}{path}: choices[0].{field} is {type(text).__name__}, not a string")
    return text


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the model directory carries a chat template (in tokenizer_config.json or a
    chat_template.jinja beside it): vLLM then answers /v1/chat/completions with it."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def requests_in_flight(url: str) -> float:
    """Requests the server at `url` is answering or has queued, from its /metrics (0 when it
    does not answer: nothing left to wait for)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    try:
        with _client(5) as client:
            r = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return 0.0
    if r.status_code != 200:
        return 0.0
    return sum(sample.value for family in text_string_to_metric_families(r.text) for sample in family.samples
               if sample.name in IN_FLIGHT)


def _client(timeout: float) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)  # trust_env=False: no proxies for loopback


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
