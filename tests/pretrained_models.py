"""Pretrained-format model directories of several families, made locally with random weights
and a locally trained tokenizer that carries a chat template."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from rlhf_core.tokenizer import train_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=128)
# Three families and the features that tell them apart: tied embeddings, grouped-query attention.
FAMILIES = {
    "llama": lambda: LlamaConfig(**SMALL, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
}


# Zephyr's layout: a turn ends with the EOS token, the template writes the BOS token.
ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_pretrained(tmp_path, family: str, *, chat_template: bool | str = True, pad_is_eos: bool = False,
                    shards: bool = False, texts: list[str] | None = None):
    """(directory, model) of a random-weight `family` model saved as Hugging Face writes one,
    with a tokenizer trained on `texts` carrying `chat_template` (True: ChatML)."""
    tok = train_tokenizer(texts or ["hello there, general kenobi", "what colour is the sky"], vocab_size=300,
                          chat_template=None)  # a family model brings its own template, or none
    if chat_template:
        tok.chat_template = CHATML if chat_template is True else chat_template
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    config = FAMILIES[family]()
    config.vocab_size = len(tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path / family
    model.save_pretrained(str(out), max_shard_size="100KB" if shards else "5GB")
    tok.save_pretrained(str(out))
    return out, model

