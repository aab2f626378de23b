"""`ray_session`: the pipeline's training stages share one local Ray cluster, started with
the Ray Train settings for a single node, and shut down once at the end. Run in a fresh
Python process: the test session's own cluster (tests/conftest.py) would be joined instead."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os, ray
from rlhf_core.distributed.cluster import connect_ray, ray_session
seen = {}
with ray_session():
    seen["up"] = ray.is_initialized()
    seen["stage_started_its_own"] = connect_ray()  # what each stage calls: joins the session's cluster
    seen["env"] = {k: os.environ.get(k) for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
seen["up_after"] = ray.is_initialized()
print(json.dumps(seen))
"""


def test_one_local_cluster_for_the_stages_with_single_node_train_settings_a_user_setting_wins():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_TRAIN_")}
    env |= {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["up"] and not seen["stage_started_its_own"] and not seen["up_after"]
    assert seen["env"] == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def test_rays_token_is_kept_from_other_users(tmp_path):
    """Ray writes ~/.ray/auth_token with the umask's mode (0644 here): the directory becomes
    0700 before Ray starts and the token 0600 after."""
    import stat

    from rlhf_core.distributed.cluster import protect_ray_token

    directory = tmp_path / ".ray"
    protect_ray_token(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (directory / "auth_token").write_text("token")
    os.chmod(directory / "auth_token", 0o644)
    os.chmod(directory, 0o755)
    protect_ray_token(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "auth_token").stat().st_mode) == 0o600
