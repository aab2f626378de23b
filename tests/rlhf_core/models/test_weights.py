"""`unreadable_weights`: what stops a model directory's safetensors weights from loading, read
from their headers alone."""
from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

from rlhf_core.models.weights import unreadable_weights, weight_files


def saved(path, **tensors):
    save_file({k: np.arange(v, dtype=np.float32) for k, v in tensors.items()}, str(path))
    return path


def test_whole_files_read(tmp_path):
    saved(tmp_path / "model.safetensors", a=6, b=4)
    assert unreadable_weights(tmp_path) is None
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]


def test_a_truncated_copy_is_named_with_the_reason(tmp_path):
    data = saved(tmp_path / "model.safetensors", a=6, b=4).read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # the last two floats lost
    problem = unreadable_weights(tmp_path)
    assert problem == f"{tmp_path / 'model.safetensors'} cannot be read: Error while deserializing header: " \
                      "incomplete metadata, file not fully covered"


def test_a_header_that_does_not_parse_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"{not json!!}")
    assert "model.safetensors cannot be read: Error while deserializing header" in unreadable_weights(tmp_path)


def test_a_shard_the_index_names_must_exist(tmp_path):
    saved(tmp_path / "model-00001-of-00002.safetensors", a=6)
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert unreadable_weights(tmp_path) == \
        "model-00002-of-00002.safetensors is missing (model.safetensors.index.json names it)"
    saved(tmp_path / "model-00002-of-00002.safetensors", b=4)
    assert unreadable_weights(tmp_path) is None


def test_an_index_that_does_not_parse_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{")
    assert unreadable_weights(tmp_path).startswith(f"{tmp_path / 'model.safetensors.index.json'} cannot be read: ")


def test_other_formats_are_left_to_the_loader(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"whatever a loader makes of it")
    assert unreadable_weights(tmp_path) is None and weight_files(tmp_path) == []
