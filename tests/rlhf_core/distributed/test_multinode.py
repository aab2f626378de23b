"""A training stage on a two-node Ray cluster (`ray start --head` + `ray start --address`,
both on loopback): the stage joins the cluster named by RAY_ADDRESS and its workers land on
both nodes. The cluster is this module's own (its own temp dir and ports) and is torn down
process by process, so the session's local cluster is untouched."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).parent / "ray")

TRAIN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from monitoring.prometheus import JobExporter
    from rlhf_core.config import DemoDataConfig, ModelConfig, RewardConfig
    from rlhf_core.data.schema import read_table
    from rlhf_core.data.synthetic import generate_demo_data
    from rlhf_core.distributed.reward_trainer import train_reward_model
    from rlhf_core.training.stage_types import StageSite
    from rlhf_core.models.llama import build_policy, save_pretrained_atomic
    from rlhf_core.tokenizer import train_tokenizer

    tmp = Path(sys.argv[1])
    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=200, n_eval=10), tmp / "data")
    pairs = read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)], vocab_size=64)
    model = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    base = save_pretrained_atomic(build_policy(model, tok, seed=0), tok, tmp / "base")
    exporter = JobExporter("multinode", "reward")
    cfg = RewardConfig(num_workers=2, micro_batch_size=8, epochs=1, checkpoint_every=4, min_eval_accuracy=0.0,
                       warmup_steps=1)
    result = train_reward_model(pairs[:180], pairs[180:], base, cfg,
                                StageSite(tmp / "rm", tmp / "shared", "multinode", exporter.sink()))
    exporter.close()
    import ray  # still connected to the cluster it joined: its actor table holds finished actors too
    helpers = [a["ActorClassName"] for a in ray._private.state.actors().values()
               if a["ActorClassName"] in ("PlacementGroupCleaner", "_AutoscalingCoordinatorActor")]
    print("RESULT " + json.dumps({"workers": exporter.workers, "steps": result.steps, "helpers": sorted(helpers)}))
""")


def run(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def cluster_processes(marker: str) -> list[psutil.Process]:
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                procs.append(p)
        except psutil.Error:
            pass
    return procs


TOKEN = secrets.token_hex(32)


def cluster_env() -> dict[str, str]:
    """Ray 2.60 clusters started with `ray start` authenticate with a token: the head, the
    second node and the driver all get this module's."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def two_nodes(free_ports):
    (port,) = free_ports(1)
    temp_dir = f"/tmp/raymn{port}"  # short: Ray's unix socket paths must stay under 107 characters
    env = cluster_env()
    env.pop("RAY_ADDRESS", None)
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"]
    try:
        run(RAY, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
            *common, env=env)
        run(RAY, "start", f"--address=127.0.0.1:{port}", *common, env=env)
        yield f"127.0.0.1:{port}", env
    finally:
        # `ray stop` would stop every Ray process on the machine; stop only this cluster's
        for marker in (temp_dir, f"127.0.0.1:{port}", f"gcs_server_port={port}"):
            for proc in cluster_processes(marker):
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        time.sleep(1)
        shutil.rmtree(temp_dir, ignore_errors=True)  # the head's sessions and logs


def test_a_training_stage_joins_the_cluster_and_spreads_its_workers(two_nodes, tmp_path):
    address, env = two_nodes
    env = {**env, "RAY_ADDRESS": address}
    done = run(sys.executable, "-c", TRAIN, str(tmp_path), env=env, cwd=Path(__file__).resolve().parents[3])
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    workers = result["workers"]
    assert set(workers) == {"0", "1"} and result["steps"] > 0
    # on a cluster it joined, the stage keeps Ray Train's placement-group cleaner and autoscaling coordinator
    assert result["helpers"] == ["PlacementGroupCleaner", "_AutoscalingCoordinatorActor"], result["helpers"]
    nodes = {w["node"] for w in workers.values()}
    print(f"\nworkers: {workers}")
    assert len(nodes) == 2, f"both workers ran on one node: {workers}"
