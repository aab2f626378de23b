"""Shared fixtures. Expensive components are started once per session and torn down after."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest
import yaml

from flows.cli import quiet_telemetry  # noqa: E402

quiet_telemetry()
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

REPO = Path(__file__).resolve().parents[1]


def tiny_config_dict(tmp: Path) -> dict:
    """A pipeline config small enough to run every stage in seconds (accuracy is not the point).

    It sets every key that configs/demo.yaml sets (the bars off), so that the demo config with
    these values as overrides is this config: the deployment tests run it that way."""
    return {
        "name": "test",
        "output_dir": str(tmp / "runs"),
        "data": {"demo": {"seed": 0, "n_sft": 240, "n_pairs": 200, "n_eval": 24}},
        # head size 32: the smallest that vLLM's CPU attention supports
        "model": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
                  "initializer_range": 0.02},
        "sft": {"epochs": 1, "batch_size": 32, "warmup_steps": 2, "min_eval_accuracy": 0.0},
        # one reward model, no audit, no defences, no rounds, the answer key in the reward: the
        # tests that want them set them
        "reward": {"num_workers": 2, "micro_batch_size": 16, "epochs": 1, "checkpoint_every": 4,
                   "min_eval_accuracy": 0.0, "warmup_steps": 2, "ensemble_size": 1, "audit_share": 0.0},
        "policy": {"algorithm": "grpo", "num_workers": 1, "precision": "fp32", "steps": 2, "prompts_per_step": 8,
                   "max_new_tokens": 4,
                   "minibatch_size": 32, "micro_batch_size": 32, "eval_every": 2, "checkpoint_every": 2,
                   "min_accuracy_gain": 0.0, "reward_model_weight": 0.25, "verifiable_reward_weight": 1.0,
                   "kl_coef": 0.02, "shaping": {"aggregate": "mean", "bounded": False, "length_penalty": 0.0},
                   "rounds": {"enabled": False, "every": 10, "prompts": 64, "learning_rate": 1e-4},
                   "grpo": {"group_size": 4, "scale_by_std": True}},
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests"},
    }


@pytest.fixture(scope="session")
def tiny_config_factory():
    """`tiny_config_dict` for fixtures wider than one test (module-scoped pipeline runs)."""
    return tiny_config_dict


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path)))
    return path


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to `bind(port 0)` and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago, below the kernel's ephemeral
    range. A port from `bind(port 0)` comes from that range, so any process of the run (a Ray
    worker, a vLLM engine, a client's connection) may be handed the same port by the kernel
    before the test's server binds it; a port below the range only goes to who asks for it."""
    low = min(_ephemeral_range()[0], 32768)
    candidates = random.Random().sample(range(20000, low), min(400, low - 20000))
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free loopback ports between 20000 and {low}")


@pytest.fixture(scope="session")
def free_ports():
    """`free_ports(n)`: `n` distinct free loopback ports, for servers a test starts."""
    return _free_ports


@pytest.fixture(scope="session")
def prefect_server():
    """A real, temporary Prefect API server (SQLite, loopback) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def ray_cluster():
    """A local cluster with 4 logical CPUs (more than this machine's cores: enough for 2
    workers plus the too-many-workers check), with the Ray Train settings the pipeline gives
    the local clusters it starts (`LOCAL_CLUSTER_ENV`).

    Not loopback-only, and Ray 2.60 offers no way to make it so: it turns a node address of
    127.0.0.1 into the machine's reachable address (`services.resolve_ip_for_localhost`),
    and its GCS, raylet and worker servers listen on every interface."""
    import ray

    from rlhf_core.distributed.cluster import LOCAL_CLUSTER_ENV

    saved = {key: os.environ.get(key) for key in LOCAL_CLUSTER_ENV}
    os.environ.update(LOCAL_CLUSTER_ENV)
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key)
        else:
            os.environ[key] = value


@pytest.fixture(name="make_pretrained", scope="session")
def make_pretrained_fixture():
    """`make_pretrained(tmp, family, ...)`: a random-weight model directory of `family`
    (tests/pretrained_models.py)."""
    import importlib.util  # tests/ is not a package: load the helper module by path

    spec = importlib.util.spec_from_file_location("pretrained_models", REPO / "tests" / "pretrained_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_pretrained


def _postgres_bin(name: str) -> str | None:
    """PostgreSQL's server programs: on PATH, or where Debian's packages put them."""
    import glob
    import shutil

    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server on a loopback port, in a temporary directory, for the session:
    yields `new_database()`, a SQLAlchemy URL of a fresh, empty database each call. As root
    (the CI machine) the server runs as the `postgres` user, which PostgreSQL insists on."""
    import pwd
    import shutil
    import subprocess
    import tempfile
    import time

    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL's initdb and pg_ctl are not installed (Debian: apt-get install postgresql)")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="rlhf-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", _free_ports(1)[0]
    try:
        subprocess.run([*as_user, initdb, "-D", str(data), "-U", "rlhf", "--auth=trust", "--no-sync"],
                       check=True, capture_output=True)
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
                        "-o", f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root}"
                              " -c fsync=on",
                        "start"], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL did not start: {e.stderr.decode()}{log}") from e
    import sqlalchemy

    admin = sqlalchemy.create_engine(f"postgresql+psycopg://rlhf@127.0.0.1:{port}/postgres",
                                     isolation_level="AUTOCOMMIT")
    made = iter(range(10**6))

    def new_database() -> str:
        name = f"t{next(made)}_{int(time.time())}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://rlhf@127.0.0.1:{port}/{name}"

    try:
        yield new_database
    finally:
        admin.dispose()
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
