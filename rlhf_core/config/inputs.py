"""The configs of what a run starts from: its data and its model.

Either the embedded demo (a task generated locally, a tokenizer trained on it and a tiny
Llama built from `model`'s sizes) or the user's own: preference data in any of the formats
`rlhf_core.data.formats` reads, and a pretrained Hugging Face model (`model.pretrained`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rlhf_core.training.verifiable import check_verifiable_reward


def _resolves(name: str | None) -> str | None:
    check_verifiable_reward(name)  # raises ValueError naming the registered ones
    return name


# An answer checker's name (rlhf_core.training.verifiable.VERIFIABLE_REWARDS, or module:function),
# checked when the config is: a typo fails before any stage starts.
Checker = Annotated[str, AfterValidator(_resolves)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DemoDataConfig(_Strict):
    """The synthetic arithmetic task that the embedded demo generates locally.

    Prompts are `07+48=` with operands in [0, max_operand], zero-padded to its width; the
    answer is the sum padded to one more digit (`055`). The SFT
    corpus teaches a plausible systematic mistake, adding digit by digit without carrying,
    in `wrong_share` of its examples, so the SFT policy is clearly imperfect and RL has a
    real gain to find. Preference pairs always prefer the correct sum.
    """

    seed: int = Field(0, description='Seed of the generator: the same seed writes the same files.')
    max_operand: int = Field(99, ge=9, le=9999,
        description='Largest operand of the addition prompts (operands are in [0, max_operand]).')
    n_sft: int = Field(8000, ge=10, description='Examples in the SFT corpus.')
    n_pairs: int = Field(3000, ge=10, description='Preference pairs (prompt, chosen, rejected).')
    n_eval: int = Field(200, ge=10,
        description='Held-out eval prompts with their answers; none of them appears in training.')
    n_eval_reserve: int = Field(0, ge=0, description=(
        'Further held-out rows after them in the eval file, from problems that no split uses: the rows the gates '
        'look at when a call on the first n_eval is undecided (gates.max_eval_prompts). The other splits are '
        'the same bytes whatever this is.'))
    wrong_share: float = Field(0.6, ge=0.0, le=1.0,
        description='Share of SFT answers that forget to carry: the flaw RL must fix.')
    near_miss_share: float = Field(0.1, ge=0.0, le=1.0,
        description='Share of pairs on problems without a carry, whose rejected answer carries where nothing carries '
                    '(half of them) or is off by ±1 or ±10, rather than carry problems answered with the no-carry mistake.')


class DataConfig(_Strict):
    """Where preference data comes from. Without paths, the demo generator writes them."""

    preferences_path: str | None = Field(
        None, description=(
            'Preference data: a JSONL or Parquet file, a directory written by datasets\' save_to_disk, or a hub '
            'dataset "org/name" (split "train"; "org/name:split" picks another). Standard, conversational or '
            'implicit-prompt rows (docs/own-model-and-data.md). null: generate the demo task.'))
    eval_path: str | None = Field(
        None, description='Held-out eval set (prompt, optional answer) for the gates, accuracy and the leakage check; '
        'read like preferences_path, which it needs.')
    sft_path: str | None = Field(
        None, description="SFT corpus (prompt, completion; text or messages); null: SFT on the preference pairs' "
        "chosen responses. Needs preferences_path.")
    prompts_path: str | None = Field(
        None, description="Prompt-only set for RL (prompt, optional answer for verifiable rewards); null: the "
        "prompts of the SFT corpus and the pairs. Needs preferences_path.")
    on_overlength: Literal["reject", "drop"] = Field(
        "reject", description="A prompt of prompts_path or eval_path whose rendered tokens plus "
        "policy.max_new_tokens exceed the model's context: fail naming the rows (reject) or leave it out (drop). "
        "Pairs longer than reward.max_length follow reward.on_overlength.")
    answer_checker: Checker | None = Field(
        None, description="How held-out accuracy judges an answer against the eval set's `answer`: null, the "
        "exact text (white space stripped); or a checker registered in rlhf_core.training.verifiable."
        "VERIFIABLE_REWARDS (last_number_match: the last number in a sentence) or module:function.")
    demo: DemoDataConfig = DemoDataConfig()

    @model_validator(mode="after")
    def _eval_needs_preferences(self) -> "DataConfig":
        if self.preferences_path is None and (self.eval_path or self.sft_path or self.prompts_path):
            raise ValueError("eval_path, sft_path or prompts_path is set but preferences_path is not")
        return self


class ValidationConfig(_Strict):
    """Thresholds of the preference-data contract (Great Expectations suite)."""

    min_rows: int = Field(100, ge=1, description='Fewest preference rows accepted.')
    min_chars: int = Field(1, ge=1, description='Shortest prompt, chosen or rejected text accepted, in characters.')
    max_chars: int = Field(4000, ge=1, description='Longest prompt, chosen or rejected text accepted, in characters.')
    max_duplicate_prompt_share: float = Field(0.5, ge=0.0, le=1.0,
        description='Largest share of rows that may repeat an earlier prompt.')
    check_eval_leakage: bool = Field(
        True, description='Fail when a preference prompt is also in the eval set (whitespace-insensitive).')
    sample_rows: int = Field(5, ge=1, le=100, description='Offending rows shown per failed check in the report.')

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "ValidationConfig":
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) must be <= max_chars ({self.max_chars})")
        return self


class TokenizerConfig(_Strict):
    """The tokenizer trained locally for the run's models (not used with model.pretrained)."""

    vocab_size: int = Field(320, ge=32, le=65536, description='Vocabulary size of the tokenizer trained for the run.')


class ModelConfig(_Strict):
    """The policy's model: a pretrained Hugging Face model (`pretrained`), or else a tiny
    Llama-architecture causal LM built locally from the sizes below (which `pretrained` ignores)."""

    pretrained: str | None = Field(None, description=(
        "A local Hugging Face causal-LM directory (config, safetensors, tokenizer) or a hub id (org/name) that "
        "every model of the run starts from: base and reference policy, critic, reward backbone. null: build the "
        "tiny demo model and train its tokenizer."))
    chat_template: str | None = Field(None, description=(
        "Jinja chat template (the text, or a path to a file holding it) that renders conversations in every "
        "stage and in serving; null: the tokenizer's own. Conversational data needs one of the two."))

    hidden_size: int = Field(128, ge=8, description='Width of the residual stream.')
    intermediate_size: int = Field(384, ge=8, description="Width of the MLP's hidden layer.")
    num_layers: int = Field(4, ge=1, description='Transformer blocks.')
    num_heads: int = Field(4, ge=1, description='Attention heads; must divide hidden_size.')
    num_kv_heads: int = Field(4, ge=1, description='Key/value heads (grouped-query attention); must divide num_heads.')
    max_position_embeddings: int = Field(64, ge=16, description='Longest sequence the model handles, in tokens.')
    initializer_range: float = Field(0.02, gt=0, le=1, description=(
        "Std of the initial weights (Hugging Face's initializer_range). At 0.02 a tiny model's attention "
        "starts near uniform and escapes that saddle at a step that moves with the seed and the CPU; a "
        "larger scale escapes it early."))

    @field_validator("pretrained")
    @classmethod
    def _home_expanded(cls, source: str | None) -> str | None:
        """`~/models/x` is the user's directory, as a shell would read it; a hub id is kept as written."""
        return str(Path(source).expanduser()) if source is not None and source.startswith("~") else source

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self
