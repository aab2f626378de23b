"""`rlhf env` (a bug report's block, secrets kept out) and `rlhf validate --show N --set ...`
(rows as the trainer sees them, with no YAML file needed)."""
from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from flows.cli import main
from rlhf_core.config import load_config
from rlhf_core.data.schema import read_table, write_jsonl
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks import environment
from tasks.inspect_data import show_rows

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SECRET = "hunter2-7f3a"


@pytest.fixture
def secrets(monkeypatch):
    """A secret-looking variable, one that only the config names as a secret, and a URL password."""
    monkeypatch.setenv("RLHF_TEST_SECRET", SECRET)
    monkeypatch.setenv("RLHF_SERVING_CREDENTIAL", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"postgresql://mlflow:{SECRET}@db:5432/mlflow")
    return ["--set", "serving.api_key_env=RLHF_SERVING_CREDENTIAL"]


def test_env_prints_versions_machine_and_settings_but_no_secret(capsys, secrets):
    assert main(["env", *secrets]) == 0
    out = capsys.readouterr().out
    assert f"- torch: {torch.__version__}" in out and f", {os.cpu_count()} cores" in out
    assert "- CUDA available: no" in out or "- CUDA available: yes" in out
    for name in environment.PACKAGES:
        assert re.search(rf"^- {name}: \S", out, re.M), name
    assert f"- config: {DEFAULT_CONFIG}" in out
    assert SECRET not in out
    assert "RLHF_TEST_SECRET=<set, hidden>" in out and "RLHF_SERVING_CREDENTIAL=<set, hidden>" in out
    assert "- MLFLOW_TRACKING_URI: postgresql://mlflow:***@db:5432/mlflow" in out


def test_env_json_has_every_section_and_no_secret(capsys, secrets):
    assert main(["env", "--json", *secrets]) == 0
    out = capsys.readouterr().out
    info = json.loads(out)
    assert set(info) == {"rlhf_pipeline", "python", "platform", "cpu", "memory", "torch", "packages", "settings",
                         "environment"}
    assert info["torch"]["version"] == torch.__version__ and info["cpu"]["cores"] == os.cpu_count()
    assert info["torch"]["cuda_available"] == torch.cuda.is_available()
    assert info["memory"]["total_gib"] >= info["memory"]["available_gib"] > 0
    assert set(info["packages"]) == {"vllm", "ray", "deepspeed", "transformers", "peft", "prefect", "mlflow",
                                     "great_expectations"}
    assert info["rlhf_pipeline"]["version"] == "0.1.0" and re.fullmatch(r"[0-9a-f]{40}",
                                                                       info["rlhf_pipeline"]["git_commit"])
    assert set(info["settings"]) >= {"config", "tracking_uri", "PREFECT_API_URL", "MLFLOW_TRACKING_URI",
                                     "RAY_ADDRESS"}
    assert info["settings"]["tracking_uri"] == "postgresql://mlflow:***@db:5432/mlflow"
    assert SECRET not in out


def test_env_reports_a_config_it_cannot_load_instead_of_failing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rate: -1\n")
    assert main(["env", "--config", str(bad)]) == 0
    assert "- config error: " in capsys.readouterr().out


def test_the_cuda_devices_are_listed_with_their_memory(monkeypatch):
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30),
             SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    info = environment.collect_environment(DEFAULT_CONFIG, environ={})
    assert info["torch"]["devices"] == [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 80.0}] * 2
    assert ("- CUDA available: yes, 2 devices: NVIDIA H100 80GB HBM3 (80.0 GiB); NVIDIA H100 80GB HBM3 (80.0 GiB)"
            in environment.format_environment(info))


def test_urls_keep_everything_but_their_secrets():
    assert environment.redact_url("https://u:p@host:8/api?x=1&token=abc") == "https://u:***@host:8/api?x=1&token=***"
    assert environment.redact_url("http://127.0.0.1:4200/api") == "http://127.0.0.1:4200/api"
    assert environment.redact_url("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert environment.shown_override(f"tracking.tracking_uri=postgresql://a:{SECRET}@h/db") == \
        "tracking.tracking_uri=postgresql://a:***@h/db"


def test_the_tracking_uri_is_the_one_runs_use(tmp_path, monkeypatch):
    from tasks.tracking import resolve_tracking_uri

    monkeypatch.chdir(tmp_path)
    for env in ({}, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}):
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for overrides in ([], ["tracking.tracking_uri=http://other:5000"]):
            cfg = load_config(DEFAULT_CONFIG, overrides)
            assert environment.tracking_uri(cfg, env) == resolve_tracking_uri(cfg)


# -- rlhf validate --show N, --set ---------------------------------------------------------------


def _shown_rows(out: str) -> list[str]:
    return re.findall(r"^row \d+ \(line \d+\).*$", out, re.M)


def test_validate_shows_demo_rows_with_their_token_counts(tmp_path, capsys):
    assert main(["make-demo-data", str(tmp_path / "data")]) == 0
    prefs = tmp_path / "data" / "preferences.jsonl"
    first = read_table(prefs).iloc[0]
    capsys.readouterr()
    assert main(["validate", str(prefs), "--show", "2", "--set", f"output_dir={tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    assert _shown_rows(out) == ["row 1 (line 1)", "row 2 (line 2)"]
    assert f"    | {first['prompt']}\n" in out and f"    | {first['chosen']}\n" in out
    # the demo's tokenizer splits digits: <s> + one token a character; an answer ends with </s>
    assert f"  prompt: {len(first['prompt']) + 1} tokens" in out
    scored = len(first["prompt"]) + 1 + len(first["chosen"]) + 1
    assert (f"  chosen: {len(first['chosen']) + 1} tokens, {scored} scored with the prompt, "
            "within reward.max_length=32") in out
    assert "validate: PASSED  3000 rows" in out
    assert main(["validate", str(prefs), "--show", "1", "--set", "reward.max_length=8",
                 "--set", f"output_dir={tmp_path / 'runs'}"]) == 0
    assert f"{scored - 8} cut at reward.max_length=8: " in capsys.readouterr().out


def _chat_rows(n: int = 120) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
             "chosen": [{"role": "assistant", "content": str(2 * i)}],
             "rejected": [{"role": "assistant", "content": str(2 * i + 1)}]} for i in range(n)]


def test_validate_renders_and_shows_conversations_with_a_model_set_on_the_command_line(
        tmp_path, capsys, make_pretrained):
    model, _ = make_pretrained(tmp_path, "qwen2", chat_template=CHATML)
    write_jsonl(_chat_rows(), tmp_path / "chat.jsonl")
    common = ["validate", str(tmp_path / "chat.jsonl"), "--set", f"output_dir={tmp_path / 'runs'}"]
    assert main(common) == 1  # conversations need a chat template: no model, no rendering
    assert "model.pretrained" in capsys.readouterr().out

    assert main([*common, "--set", f"model.pretrained={model}"]) == 0  # no YAML file needed
    [rendered] = (tmp_path / "runs").glob("validate-*/data/preferences.jsonl")
    assert rendered.read_text().startswith('{"prompt": "<|im_start|>user\\nWhat is 0 plus 0?<|im_end|>\\n')
    capsys.readouterr()

    assert main([*common, "--set", f"model.pretrained={model}", "--set", "reward.max_length=8", "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert _shown_rows(out) == ["row 1 (line 1): rendered by the chat template",
                                "row 2 (line 2): rendered by the chat template"]
    assert "    | <|im_start|>user\n    | What is 1 plus 1?<|im_end|>\n    | <|im_start|>assistant\n" in out
    [(prompt, chosen, scored, cut)] = re.findall(
        r"^  prompt: (\d+) tokens.*\n(?:    \|.*\n)+  chosen: (\d+) tokens, (\d+) scored with the prompt, (\d+) cut at "
        r"reward\.max_length=8: '", out.split("row 2")[1], re.M)
    assert int(scored) - 8 == int(cut) > 0 and int(chosen) > 0
    assert f"  prompt: {prompt} tokens, reward.max_length=8 or more: the reward model sees none of the answers" in out
    assert "2 of 2 rows shown are longer than reward.max_length=8" in out

    pd.DataFrame(_chat_rows()).to_parquet(tmp_path / "chat.parquet")  # messages come back as numpy arrays
    shown = show_rows(load_config(DEFAULT_CONFIG, [f"model.pretrained={model}"]), tmp_path / "chat.parquet", 1)
    assert "row 1 (line 1): rendered by the chat template" in shown and "    | What is 0 plus 0?<|im_end|>" in shown


def test_rows_that_cannot_be_shown_say_why_and_the_validation_still_names_the_row(tmp_path, capsys):
    write_jsonl(_chat_rows(), tmp_path / "chat.jsonl")
    assert main(["validate", str(tmp_path / "chat.jsonl"), "--show", "2",
                 "--set", f"output_dir={tmp_path / 'runs'}"]) == 1
    out = capsys.readouterr().out
    assert f"cannot show the rows of {tmp_path / 'chat.jsonl'}: conversational data is rendered by a chat " \
           "template: set model.pretrained" in out
    assert "validate: FAILED" in out and not _shown_rows(out)

