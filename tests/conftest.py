"""Shared fixtures. Expensive components are started once per session and torn down after."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from flows.cli import quiet_telemetry  # noqa: E402
from rlhf_core.testing.configs import tiny_config_dict
from rlhf_core.testing.ports import free_ports as free_ports_

quiet_telemetry()
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

REPO = Path(__file__).resolve().parents[1]
SLOW_TIMEOUT_S = 600  # a slow test's limit, its module's pipeline run or cluster start included


def pytest_collection_modifyitems(items):
    """The slow tests get SLOW_TIMEOUT_S; the others keep the suite's default (pyproject.toml).
    The `gpu` tests are skipped where torch sees no CUDA device (torch is imported only if there are any)."""
    no_cuda = None
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        if item.get_closest_marker("gpu"):
            if no_cuda is None:
                import torch

                no_cuda = not torch.cuda.is_available()
            if no_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def tiny_config_factory():
    """`tiny_config_dict` for fixtures wider than one test (module-scoped pipeline runs)."""
    return tiny_config_dict


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path)))
    return path


@pytest.fixture(scope="session")
def free_ports():
    """`free_ports(n)`: `n` distinct free loopback ports, for servers a test starts."""
    return free_ports_


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
    the local clusters it starts (`LOCAL_CLUSTER_ENV`), on loopback as they are."""
    import ray

    from rlhf_core.distributed.cluster import LOCAL_CLUSTER_ENV, start_local_ray

    saved = {key: os.environ.get(key) for key in LOCAL_CLUSTER_ENV}
    os.environ.update(LOCAL_CLUSTER_ENV)
    start_local_ray(num_cpus=4)
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
        pytest.fail("PostgreSQL's initdb and pg_ctl are not installed: run `make test-tools` "
                    "(Debian: apt-get install postgresql)")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="rlhf-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", free_ports_(1)[0]
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
