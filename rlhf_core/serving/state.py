"""Blue/green state of serving, kept in one directory: `current.json` (the `Endpoint` that
serves: the single source of truth clients read), `deployments.jsonl` (one line per deploy,
failure and stop), `deploy.lock` (one deploy or stop at a time), `starting.json` (the deploy
in progress, see `rlhf_core.serving.server`) and `logs/`."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from rlhf_core.config import ServingConfig
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.process import is_server

STARTING = "starting.json"  # the deploy in progress: its endpoint, written before its server starts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """One running server, as recorded in current.json."""

    url: str  # "http://127.0.0.1:8100"
    host: str
    port: int
    pid: int  # also its process group id (the server leads its own session)
    served_model_name: str  # "policy-v3"
    version: str  # the registry version it serves, "3"
    model_dir: str
    log_path: str
    started_at: str  # ISO 8601, UTC

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Endpoint":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def state_dir_for(cfg: ServingConfig, output_dir: Path) -> Path:
    """`cfg.state_dir`, else `<output_dir>/serving`; absolute, so the records stay valid from any cwd."""
    return (Path(cfg.state_dir) if cfg.state_dir is not None else Path(output_dir) / "serving").resolve()


def recorded_endpoint(state_dir: Path) -> Endpoint | None:
    """The endpoint in <state_dir>/current.json, its server running or not; None if there is none."""
    path = Path(state_dir) / "current.json"
    try:
        return Endpoint.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ServingError(f"{path} is unreadable ({e!r}); inspect it, then stop the server by hand") from e


def current_endpoint(state_dir: Path) -> Endpoint | None:
    """The endpoint in <state_dir>/current.json; None if there is none or its server is gone."""
    path = Path(state_dir) / "current.json"
    endpoint = recorded_endpoint(state_dir)
    if endpoint is None:
        return None
    if not is_server(endpoint.pid, endpoint.port):
        log.warning(
            "%s records %s (pid %d, port %d) but that server is no longer running (pid gone or reused)",
            path, endpoint.served_model_name, endpoint.pid, endpoint.port,
        )
        return None
    return endpoint


def next_port(ports: tuple[int, int], current: Endpoint | None) -> int:
    """Blue/green: the port of `ports` that the current endpoint does not use."""
    if current is None or current.port not in ports:
        return ports[0]
    return ports[1] if current.port == ports[0] else ports[0]


def url_for(host: str, port: int) -> str:
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


@contextlib.contextmanager
def deploy_lock(state_dir: Path) -> Iterator[None]:
    with open(state_dir / "deploy.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another deploy holds %s; waiting for it", state_dir / "deploy.lock")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def deploy_lock_held(state_dir: Path) -> bool:
    """Whether a deploy or a stop holds `<state_dir>/deploy.lock` now. Probes with a shared lock,
    released at once, and creates nothing; a deploy that asks for the lock in that instant waits
    for the probe."""
    try:
        with open(Path(state_dir) / "deploy.lock") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except FileNotFoundError:
        return False
    except BlockingIOError:
        return True
    return False


@dataclass(frozen=True)
class DeployRecord:
    """The intent record of a deploy that has not finished (`starting.json`)."""

    version: str
    since: str  # when the deploy started, ISO 8601
    pid: int  # the server it starts; 0 until started
    under_way: bool  # False: the deploy that wrote it died or failed to stop its server

    def __str__(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "its server not started yet"
        if self.under_way:
            return f"a deploy is under way (version {self.version}, since {self.since}, {pid})"
        return (f"a deploy of version {self.version} did not finish (since {self.since}, {pid}); "
                "the next deploy or `rlhf serving stop` stops what it left")


def deploy_under_way(state_dir: Path) -> DeployRecord | None:
    """The deploy recorded in `<state_dir>/starting.json`, if any: under way while a deploy holds
    the lock, else left by one that died."""
    path = Path(state_dir) / STARTING
    try:
        d = json.loads(path.read_text())
        record = DeployRecord(str(d["version"]), str(d["started_at"]), int(d["pid"]), under_way=False)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        record = DeployRecord("?", "?", 0, under_way=False)
    held = deploy_lock_held(state_dir)
    if not held and not path.exists():
        return None  # it finished between the two looks
    return replace(record, under_way=held)


def ensure_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # clients may read it; it holds no secret
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def announce(state_dir: Path, *, url: str, served_model_name: str, version: str, model_dir: str) -> Endpoint:
    """Write `current.json` for a server this project did not start (on Kubernetes the pod's
    vLLM, announced to the feedback gateway beside it): `pid` 0, no log."""
    split = urlsplit(url)
    endpoint = Endpoint(url=url, host=split.hostname, port=split.port, pid=0, served_model_name=served_model_name,
                        version=str(version), model_dir=model_dir, log_path="",
                        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(state_dir) / "current.json", endpoint.to_dict())
    return endpoint


def append_history(state_dir: Path, event: str, endpoint: Endpoint, previous: Endpoint | None, **extra) -> None:
    line = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "event": event,  # deployed | failed | stopped
        "endpoint": endpoint.to_dict(),
        "replaced": previous.to_dict() if previous is not None and event == "deployed" else None,
        **extra,
    }
    with open(state_dir / "deployments.jsonl", "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
