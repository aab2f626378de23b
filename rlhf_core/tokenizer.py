"""A byte-level BPE tokenizer trained locally with `tokenizers` (no hub).

Digits are always split into single tokens: a BPE that merges "12" into one token makes
arithmetic needlessly hard for a tiny model. Encoding prepends `<s>`; completions end with
`</s>`, which is the stop token for both Hugging Face `generate` and vLLM.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """The tokenizer of a model directory (the demo's or any family's), with a pad token: the
    EOS token when the tokenizer names none, as is common for pretrained causal LMs."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
