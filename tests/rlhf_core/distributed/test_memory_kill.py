"""A real kill by Ray's memory monitor, through `fit_stage`.

A separate Python process starts its own local Ray cluster (`fit_stage` starts it) whose raylet
kills workers once the machine's used memory passes what it used at the start plus
`MARGIN_GIB` (`RAY_memory_usage_threshold`, read by the raylet when it starts; the monitor looks
every 50 ms). The stage's two workers allocate memory until they are killed, so the failure is
whatever Ray 2.60 raises for a real kill, turned into the stage's error by `fit_stage`. (On a
machine whose other processes grow meanwhile, the monitor may kill another process of the
cluster first, the Train controller say: still a memory kill, told in the same block.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MARGIN_GIB = 2.5  # above the machine's use at the start: room for Ray's own processes
HOG_GIB = 3.0  # each worker stops there (two workers: well past the margin) if nothing kills it

SCRIPT = """
import json, os, sys, time
from dataclasses import dataclass
from pathlib import Path

import psutil

vm = psutil.virtual_memory()
used_then = vm.total - vm.available + {margin} * 2**30
os.environ["RAY_memory_usage_threshold"] = f"{{min(used_then / vm.total, 0.95):.4f}}"
os.environ["RAY_memory_monitor_refresh_ms"] = "50"

from rlhf_core.config import RewardConfig
from rlhf_core.distributed.memory_failure import StageOutOfMemory
from rlhf_core.distributed.stage import StageSite, fit_stage


@dataclass(frozen=True)
class Loop:
    cfg: RewardConfig


def hog(loop):
    held = []
    while len(held) * 100 < {hog} * 1024:
        block = bytearray(100 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
        held.append(block)
        time.sleep(0.02)
    time.sleep(10)


cfg = RewardConfig(num_workers=2, micro_batch_size=8, max_length=16, max_failures=0, use_gpu=False,
                   placement_strategy="PACK")
try:
    fit_stage("reward", lambda runtime: Loop(cfg), hog, cfg, StageSite(Path(sys.argv[1]) / "rm", Path(sys.argv[1]), "oom"))
    print(json.dumps({{"error": None}}))
except StageOutOfMemory as exc:
    print(json.dumps({{"error": str(exc), "cause": type(exc.__cause__).__name__}}))
"""


@pytest.mark.slow
def test_a_stage_killed_by_ray_s_memory_monitor_fails_with_one_block(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, never the suite's
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(margin=MARGIN_GIB, hog=HOG_GIB), str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    block = result["error"]
    assert block is not None, "the workers were not killed"
    lines = block.splitlines()
    assert lines[0].startswith("reward: out of memory: Ray's memory monitor killed "), block
    assert "training worker" in lines[0] and "when the node used " in lines[0]
    # the workers' figures when the report has them: on a busy machine the monitor may act before they start
    assert lines[1].startswith("training workers' memory at the kill: "), block
    assert any(line.startswith("this machine at the stage's start: ") and "GiB total" in line
               and "GiB available" in line for line in lines), block
    assert lines[-1].startswith("to use less: reward.num_workers=2 (") and "reward.micro_batch_size=8" in lines[-1]
    assert "reward.max_length=16" in lines[-1]
    assert len(lines) <= 5 and len(block) < 1500, block
    for dump in ("Traceback", "Object store memory usage", "Refer to the documentation", "Worker info", "lease ID"):
        assert dump not in block
    assert result["cause"] in ("WorkerGroupError", "OutOfMemoryError", "ControllerError")
