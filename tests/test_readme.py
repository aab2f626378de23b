"""The README is the first thing a user reads: keep its config reference complete."""
from pathlib import Path

from pydantic import BaseModel

from rlhf_core.config import PipelineConfig

REPO = Path(__file__).resolve().parents[1]


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += leaf_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def test_every_config_key_is_in_the_readme_reference():
    readme = (REPO / "README.md").read_text()
    missing = [k for k in leaf_keys(PipelineConfig) if f"`{k}`" not in readme]
    assert missing == []


def test_readme_shows_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
