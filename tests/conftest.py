"""Shared fixtures. Expensive components are started once per session and torn down after."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from flows import quick_exit
from flows.cli import quiet_telemetry  # noqa: E402
from rlhf_core.testing.configs import tiny_config_dict
from tests.lanes import lane_scheduler, longest_modules_first, module_seconds
from rlhf_core.testing.ports import free_ports as free_ports_

quiet_telemetry()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # an xdist worker, which holds the model stack and the tests, ends 6-8 s sooner once its session
    # finished: the controller waits for it. The exit handlers registered before this one are
    # logging's (which quick_exit runs) and execnet's, for gateways a worker does not open.
    quick_exit.arm()
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

REPO = Path(__file__).resolve().parents[1]
SLOW_TIMEOUT_S = 600  # a slow test's limit, its module's pipeline run or cluster start included


COLLECTED = pytest.StashKey[frozenset]()  # every test id this session collected, before -m/-k deselect any


@pytest.hookimpl(tryfirst=True)  # before pytest's own hooks deselect by -m, -k or --deselect
def pytest_collection_modifyitems(config, items):
    """The slow tests get SLOW_TIMEOUT_S; the others keep the suite's default (pyproject.toml).
    The `gpu` tests are skipped where torch sees no CUDA device (torch is imported only if there are any).
    The slowest modules run first (`longest_modules_first`). What was collected is kept for
    tests/test_collection.py."""
    config.stash[COLLECTED] = frozenset(item.nodeid for item in items)
    longest_modules_first(items, module_seconds())
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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s scheduling: each worker its lane first (`lane_scheduler`)."""
    return lane_scheduler(config, log)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        quick_exit.finish(int(exitstatus))


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made, once a session. MLflow's migrations take
    1.3-2 s to make a new store's tables; a copy of this one takes a tenth of a second."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def _copy_store(template: Path, path: Path) -> str:
    import shutil

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def mlflow_store(tmp_path, empty_mlflow_store) -> str:
    """The URI of a new, empty MLflow store in this test's directory (tmp_path/m.db)."""
    return _copy_store(empty_mlflow_store, tmp_path / "m.db")


@pytest.fixture(scope="session")
def tiny_config_factory(empty_mlflow_store):
    """`tiny_config_dict` for fixtures wider than one test (module-scoped pipeline runs), its
    MLflow store already made."""

    def factory(tmp: Path) -> dict:
        raw = tiny_config_dict(tmp)
        _copy_store(empty_mlflow_store, tmp / "mlflow.db")
        return raw

    return factory


@pytest.fixture
def tiny_config(tmp_path, tiny_config_factory) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_factory(tmp_path)))
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

    from rlhf_core.distributed.cluster import LOCAL_CLUSTER_ENV, shutdown_ray, start_local_ray

    saved = {key: os.environ.get(key) for key in LOCAL_CLUSTER_ENV}
    os.environ.update(LOCAL_CLUSTER_ENV)
    start_local_ray(num_cpus=4)
    yield ray
    shutdown_ray()
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


# --- a team's MLflow: a tracking server on PostgreSQL with its artifacts in S3 (moto) ------

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# As infra/k8s/mlflow.yaml runs it: without MLflow's server-side jobs (GenAI scorers, trace
# rollups), which the pipeline never uses; on they are 7 more processes a server.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# Clients (not the server) decide whether a file goes in parts and how big the parts are: small
# here, so that a tiny model's weights take several. Real S3 wants parts of at least 5 MiB; moto
# is told to take small ones (S3_UPLOAD_PART_MIN_SIZE).
MULTIPART_ENV = {"MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "true",
                 "MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE": str(64 * 1024),
                 "MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE": str(32 * 1024)}


def _stop_group(proc) -> None:
    """SIGTERM to the process group `proc` leads (started with start_new_session), then SIGKILL."""
    import signal
    import subprocess

    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for_http(url: str, proc, log: Path, timeout_s: float) -> None:
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    _stop_group(proc)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                            region_name=S3_ENV["AWS_DEFAULT_REGION"])


@dataclass(frozen=True)
class TrackingServer:
    url: str
    artifacts_destination: str  # s3://bucket/prefix
    backend_store_uri: str
    log: Path
    client_env: dict  # what a client process sets (MULTIPART_ENV); no S3 credentials


    @property
    def bucket(self) -> str:
        return self.artifacts_destination.removeprefix("s3://").split("/", 1)[0]

    @property
    def prefix(self) -> str:
        return self.artifacts_destination.removeprefix("s3://").split("/", 1)[1]


def _moto_server(tmp_path_factory, **extra_env):
    """An S3-compatible server (moto, in its own process) on a loopback port, until closed."""
    import subprocess
    import sys

    port = free_ports_(1)[0]
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    env = {**os.environ, **S3_ENV, "S3_UPLOAD_PART_MIN_SIZE": "1024", **extra_env}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/moto-api/", proc, log, 60)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        _stop_group(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An S3-compatible server (moto) for the session: any key is accepted."""
    yield from _moto_server(tmp_path_factory)


@pytest.fixture(scope="session")
def s3_server_checking_keys(tmp_path_factory):
    """An S3-compatible server that checks access keys as AWS does (moto's IAM checks on from the
    first request) and knows none: it refuses every key, as S3 refuses an expired or revoked one."""
    yield from _moto_server(tmp_path_factory, INITIAL_NO_AUTH_ACTION_COUNT="0")


@pytest.fixture(scope="session")
def start_mlflow_server(postgres_server, s3_server, tmp_path_factory):
    """`start(artifacts_destination, s3=None)`: an `mlflow server` on loopback with a new
    PostgreSQL database as its backend store and `artifacts_destination` (s3://bucket/prefix on
    `s3`, default `s3_server`) as its artifact store, proxied (`--serve-artifacts`: clients need no S3
    credentials); ready once /health answers. Every server started is stopped at the end."""
    import subprocess
    import sys

    started = []

    def start(artifacts_destination: str, s3: S3Server | None = None) -> TrackingServer:
        port = free_ports_(1)[0]
        log = tmp_path_factory.mktemp("mlflow-server") / "server.log"
        backend = postgres_server()
        env = {**os.environ, **S3_ENV, **MULTIPART_ENV, **SERVER_ENV, "MLFLOW_S3_ENDPOINT_URL": (s3 or s3_server).endpoint}
        env.pop("MLFLOW_TRACKING_URI", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", backend, "--artifacts-destination", artifacts_destination, "--serve-artifacts"],
            env=env, cwd=log.parent, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        _wait_for_http(f"http://127.0.0.1:{port}/health", proc, log, 180)
        return TrackingServer(f"http://127.0.0.1:{port}", artifacts_destination, backend, log, dict(MULTIPART_ENV))

    try:
        yield start
    finally:
        for proc in started:
            _stop_group(proc)


@pytest.fixture(scope="session")
def mlflow_server(start_mlflow_server, s3_server) -> TrackingServer:
    """The session's shared tracking server: PostgreSQL, artifacts in s3://rlhf-mlflow/mlflow."""
    s3_server.client().create_bucket(Bucket="rlhf-mlflow")
    return start_mlflow_server("s3://rlhf-mlflow/mlflow")
