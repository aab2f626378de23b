"""The whole pipeline on a user's own model and data: a locally made pretrained Qwen2 (not the
demo's Llama) with a chat template, conversational preference pairs, a prompt-only RL set and
an eval set saved with `datasets`, through validate → (SFT skipped) → reward model → GRPO →
gates → registry → deployment, then a chat completion through the `openai` client."""
from __future__ import annotations

import json

import datasets
import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.pipeline import rlhf_pipeline
from rlhf_core.chat import render_prompt
from rlhf_core.config import DemoDataConfig, load_config
from rlhf_core.data.formats import as_conversational
from rlhf_core.data.schema import read_table, write_jsonl
from rlhf_core.data.synthetic import generate_demo_data
from rlhf_core.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_server")

ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LOOSE_GATES = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
               "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
               "max_degenerate_rate": 1.0, "max_kl": 1000.0, "max_generation_failure_rate": 1.0}


def user_data(tmp):
    """The demo task's rows in the ecosystem's formats: conversational pairs (JSONL), a prompt
    set with answers (Parquet), an eval set written by `save_to_disk`."""
    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=200, n_eval=24), tmp / "demo")
    pairs = [as_conversational(r) for r in read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")]
    evals = [as_conversational(r) for r in read_table(files.eval)[["prompt", "answer"]].to_dict("records")]
    write_jsonl(pairs, tmp / "pairs.jsonl")
    datasets.Dataset.from_list(evals).save_to_disk(str(tmp / "eval"))
    prompts = [{"prompt": r["prompt"], "answer": r["chosen"][0]["content"]} for r in pairs[:64]]
    datasets.Dataset.from_list(prompts).to_parquet(str(tmp / "prompts.parquet"))
    return tmp / "pairs.jsonl", tmp / "eval", tmp / "prompts.parquet"


@pytest.fixture(scope="module")
def own_run(tmp_path_factory, tiny_config_factory, make_pretrained, free_ports):
    from rlhf_core.serving import server

    tmp = tmp_path_factory.mktemp("own")
    pairs, evals, prompts = user_data(tmp)
    texts = [json.dumps(r) for r in read_table(pairs).to_dict("records")][:50]
    model_dir, _ = make_pretrained(tmp, "qwen2", chat_template=ZEPHYR, texts=texts + ["<|user|> <|assistant|>"])
    raw = tiny_config_factory(tmp)
    raw["data"] = {"preferences_path": str(pairs), "eval_path": str(evals), "prompts_path": str(prompts)}
    raw["model"] = {"pretrained": str(model_dir)}
    raw["sft"] = {"enabled": False}
    raw["reward"].update(max_length=96)
    # the reward model, and exact match against the prompt set's answer column
    raw["policy"].update(verifiable_reward="answer_exact_match", verifiable_reward_weight=1.0, reward_model_weight=1.0)
    raw["gates"] = LOOSE_GATES
    raw["serving"] = {"ports": free_ports(2), "smoke_prompt": "Hello"}
    config = tmp / "own.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    state_dir = server.state_dir_for(cfg.serving, cfg.output_dir)
    try:
        summary = rlhf_pipeline(str(config))
        yield cfg, state_dir, summary
    finally:
        server.stop(state_dir)


@pytest.mark.slow
def test_a_pretrained_qwen2_on_conversational_data_goes_through_every_stage(own_run):
    _, _, summary = own_run
    stages = summary["stages"]
    assert summary["status"] == "completed", summary.get("error")
    assert stages["pretrained"]["model_type"] == "qwen2"
    assert stages["sft"]["status"] == "skipped"
    assert stages["policy"]["status"] == "completed" and stages["policy"]["accuracy_before"] is not None
    assert stages["deploy"]["status"] == "serving"
    client = MlflowClient(summary["mlflow_tracking_uri"])
    [policy_run] = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and tags.stage = 'policy'")
    assert "policy/verifiable_reward_mean" in policy_run.data.metrics and "policy/rm_score_mean" in policy_run.data.metrics


@pytest.mark.slow
def test_the_served_model_answers_a_chat_rendered_as_in_training(own_run):
    from openai import OpenAI

    from rlhf_core.serving import server

    cfg, state_dir, summary = own_run
    current = server.current_endpoint(state_dir)
    key = server.resolve_api_key(cfg.serving, state_dir)
    [model] = server.list_models(current.url, key)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+34="}]
    reply = OpenAI(base_url=f"{current.url}/v1", api_key=key).chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0.0)
    assert isinstance(reply.choices[0].message.content, str)
    # the server's rendering of the conversation, token for token, is the trainer's
    served = httpx.post(f"{current.url}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                        json={"model": model, "messages": messages, "add_generation_prompt": True}).json()["tokens"]
    tokenizer = load_tokenizer(summary["stages"]["policy"]["model_path"])
    assert served == tokenizer(render_prompt(tokenizer, messages))["input_ids"]
    assert reply.usage.prompt_tokens == len(served)
