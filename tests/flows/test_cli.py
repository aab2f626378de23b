import subprocess
import sys

from flows.cli import main


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "demo", "validate", "check-config", "make-demo-data"):
        assert command in out.stdout


def test_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rate: -1\n")
    assert main(["check-config", str(bad)]) == 2
    assert "sft.learning_rate: must be > 0, got -1" in capsys.readouterr().err
    assert main(["run", "--config", str(bad)]) == 2


def test_validate_of_a_missing_file_is_a_usage_error(capsys):
    assert main(["validate", "/nonexistent/prefs.jsonl"]) == 2
    assert "no such file: /nonexistent/prefs.jsonl" in capsys.readouterr().err
