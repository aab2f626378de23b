"""`train_context.one_process`: a world of one in this process, standing in for Ray Train's worker
context, and what it commits. (The stages' own loops run in it in `tests/test_gpu_check.py`.)"""
from __future__ import annotations

import pytest
import torch

from rlhf_core.distributed import train_context


def test_a_world_of_one_commits_checkpoints_whole_and_resumes_from_the_latest(tmp_path):
    part = tmp_path / "part"
    part.mkdir()
    with train_context.one_process(tmp_path / "storage", use_gpu=False) as here:
        assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
        assert train_context.place() == (0, 1, 1)
        rows = [1, 2, 3]
        assert train_context.fetch(train_context.share(rows)) is rows  # nothing crosses a process
        with pytest.raises(RuntimeError, match="already has a process group"):
            with train_context.one_process(tmp_path / "other", use_gpu=False):
                pass
        with here.running("run-a"):
            with train_context.latest_checkpoint() as latest:
                assert latest is None  # a fresh run
            for step in (1, 2):
                (part / "state.txt").write_text(f"step {step}")
                train_context.report({"loss": 0.5}, part, step, rank=0)
            # a copy a kill cut short is never the latest
            (here.run_dir / "checkpoint_00000003.partial").mkdir()
            with train_context.latest_checkpoint() as latest:
                assert latest.name == "checkpoint_00000002" and (latest / "state.txt").read_text() == "step 2"
        with here.running("run-b"):  # another run's name: its own checkpoints
            with train_context.latest_checkpoint() as latest:
                assert latest is None
    assert train_context.in_one_process() is None and not torch.distributed.is_initialized()
