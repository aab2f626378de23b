"""A byte-level BPE tokenizer trained locally with `tokenizers` (no hub).

Digits are always split into single tokens: a BPE that merges "12" into one token makes
arithmetic needlessly hard for a tiny model. Encoding prepends `<s>`; completions end with
`</s>`, which is the stop token for both Hugging Face `generate` and vLLM.

The tokenizer carries `DEMO_CHAT_TEMPLATE`, so a model trained from scratch chats through
vLLM's `/v1/chat/completions` (and the feedback gateway) like any other model. Such a model is
trained on plain text only (conversational data needs `model.pretrained`), so the template
writes a conversation as that text, with no role markers:

- a user message is its content, as it stands: one user message `12+34=` is the demo prompt
  `12+34=`, and the generation prompt adds nothing;
- an assistant message is its content followed by `</s>`, as every completion ends in
  training; the turns of a longer conversation follow one another with nothing in between;
- a system (or developer) message is left out: the model cannot follow instructions, and a
  client's default system prompt in front of `12+34=` would only hide the problem it knows;
- any other role (a tool's answer) is a template error, which vLLM answers with a 400.

The template writes `<s>` first, and the text a policy continues is the rest
(`rlhf_core.chat.render_prompt` gives `12+34=`): vLLM encodes a chat's text without adding
special tokens, while training and completions encode text with the `<s>` the tokenizer adds.
So a chat of one user message feeds the model the very ids it was trained on.

The template changes no encoding, and the pipeline renders only conversational data through
it (plain-text prompts and answers pass through `rlhf_core.chat` untouched): the demo's
training sees the same ids with or without it (tested).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, EOS]

DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] not in ('system', 'developer') %}"
    "{{ raise_exception('this model chats in user and assistant messages (a system message is left out); "
    "it cannot render a ' ~ message['role'] ~ ' message') }}"
    "{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, chat_template: str | None = DEMO_CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained on `texts`, carrying `chat_template` (None: none)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """The tokenizer of a model directory (the demo's or any family's), with a pad token: the
    EOS token when the tokenizer names none, as is common for pretrained causal LMs."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
