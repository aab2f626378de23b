"""Every stage's model code on three families that transformers and vLLM both run, each made
locally with random weights and a chat template: Llama (tied embeddings, grouped-query
attention), Qwen2 (tied, GQA) and Mistral (untied). SFT of the pretrained model on rendered
conversations, reward-model scoring on its backbone, and a vLLM rollout engine that loads it,
takes new weights in place and then answers as the trainer's weights do, and renders a chat
token for token as in training (vLLM's chat renderer, the one its OpenAI server uses).

The OpenAI server itself answers a chat on Mistral here (`SERVED`); on Qwen2 in
tests/flows/test_tracking_server.py, and on the demo's Llama in every pipeline test's deploy: a
server per family would start vLLM a second time to check what the engine already loaded."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.chat import render_pairs
from rlhf_core.config import PipelineConfig
from rlhf_core.models.llama import load_policy
from rlhf_core.models.pretrained import materialise
from rlhf_core.models.reward import reward_model_from_base, score
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.base_policy import make_base_policy

ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
QUESTIONS = [f"{a}+{b}=" for a in range(8) for b in range(8)]
SERVED = {"mistral"}  # the family whose chat also goes through vLLM's OpenAI server here (see above)


def conversations():
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = [[{"role": "assistant", "content": str(eval(q[:-1]))}] for q in QUESTIONS]  # noqa: S307 - our own sums
    return prompts, answers


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_sft_reward_scoring_a_synced_engine_and_a_chat_run_on_the_family(family, tmp_path, make_pretrained,
                                                                          free_ports):
    from rlhf_core.rollout.vllm_engine import RolloutEngine
    from rlhf_core.rollout.weight_sync import SafetensorsFileTransport
    from rlhf_core.rollout.weight_transfer import GLOO_BACKEND, StreamingTransport

    src, _ = make_pretrained(tmp_path, family, chat_template=ZEPHYR, texts=QUESTIONS + ["<|user|> <|assistant|>"])
    base = materialise(str(src), tmp_path / "base")
    tokenizer = load_tokenizer(base)
    prompts, completions = render_pairs(tokenizer, *conversations())
    cfg = PipelineConfig.model_validate({"sft": {"epochs": 2, "batch_size": 16, "warmup_steps": 1}})
    sft = make_base_policy(prompts, completions, [], [], [], cfg, tmp_path / "sft", pretrained=base)
    assert sft.sft_steps == 8 and sft.sft_final_loss == sft.sft_final_loss  # trained, finite

    reward = reward_model_from_base(sft.path)
    scores = score(reward, tokenizer, prompts[:8], completions[:8], max_length=64)
    assert scores.shape == (8,) and torch.isfinite(scores).all()

    policy = load_policy(sft.path).eval()
    stream, file = StreamingTransport(GLOO_BACKEND, timeout_s=120), SafetensorsFileTransport(timeout_s=120)
    engine = RolloutEngine(sft.path, max_model_len=128, max_num_seqs=16, transport=stream)
    try:
        # the engine's log-probabilities of its own samples are the trainer's, before and after a sync
        samples = engine.generate(prompts[:8], n=2, temperature=1.0, max_tokens=6, seed=0)
        assert engine_vs_trainer(samples, policy) < 1e-3
        for engine.transport in (file, stream):  # each way of syncing, the tied head's included
            with torch.no_grad():  # a different policy: the engine must follow it
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            assert engine_vs_trainer(samples, policy) > 1e-2  # the change is visible
            engine.sync_weights(policy.state_dict())
            samples = engine.generate(prompts[:8], n=2, temperature=1.0, max_tokens=6, seed=0)
            assert engine_vs_trainer(samples, policy) < 1e-3, type(engine.transport).__name__
        engine_chat_is_rendered_as_in_training(engine, tokenizer)
    finally:
        engine.close()  # closes the stream, the engine's transport now
        file.close()
    if family in SERVED:
        served_chat_is_rendered_as_in_training(sft.path, tokenizer, free_ports(2), tmp_path / "serving")


def engine_chat_is_rendered_as_in_training(engine, tokenizer) -> None:
    """vLLM renders a chat with the model's template as the trainer does, token for token, and
    answers it."""
    from vllm import SamplingParams

    from rlhf_core.chat import render_prompt

    messages = [{"role": "user", "content": "3+4="}]
    [out] = engine.llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert out.prompt_token_ids == tokenizer(render_prompt(tokenizer, messages))["input_ids"]
    assert isinstance(out.outputs[0].text, str) and out.outputs[0].token_ids


def served_chat_is_rendered_as_in_training(model_dir, tokenizer, ports, state_dir) -> None:
    """vLLM's OpenAI server on the model answers a chat through the `openai` client, and its
    rendering of the conversation is the trainer's, token for token."""
    import httpx
    from openai import OpenAI

    from rlhf_core.chat import render_prompt
    from rlhf_core.config import ServingConfig
    from rlhf_core.serving import server

    cfg = ServingConfig(ports=tuple(ports), smoke_prompt="1+2=")
    deployed = server.deploy(model_dir, "1", cfg, state_dir)
    try:
        url, key = deployed.endpoint.url, server.resolve_api_key(cfg, state_dir)
        messages = [{"role": "user", "content": "3+4="}]
        reply = OpenAI(base_url=f"{url}/v1", api_key=key).chat.completions.create(
            model="policy-v1", messages=messages, max_tokens=4, temperature=0.0)
        assert isinstance(reply.choices[0].message.content, str)
        served = httpx.post(f"{url}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                            json={"model": "policy-v1", "messages": messages, "add_generation_prompt": True}).json()
        assert served["tokens"] == tokenizer(render_prompt(tokenizer, messages))["input_ids"]
        assert reply.usage.prompt_tokens == len(served["tokens"])
    finally:
        server.stop(state_dir)


@torch.no_grad()
def engine_vs_trainer(rollouts, model) -> float:
    """Largest |engine log-prob - trainer log-prob| over the sampled tokens."""
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([r.prompt_token_ids + r.response_token_ids])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # (L-1, V): predicts token t+1
        n = len(r.prompt_token_ids)
        ours = logp[n - 1:, :].gather(-1, ids[0, n:, None]).squeeze(-1)
        worst = max(worst, (ours - torch.tensor(r.logprobs)).abs().max().item())
    return worst
