"""Two pipeline runs started together (a scheduled one and a manual one) on one MLflow store and
one serving state: both finish, or the one that lost the race to promote is refused with a
message that says so; afterwards the registry's champion is what serves. Meanwhile every
socket their processes listen on is sampled: nothing of the project's listens beyond loopback."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

import pytest
import yaml
from mlflow.tracking import MlflowClient


REPO = Path(__file__).resolve().parents[2]


def loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also written as IPv4 in IPv6 (`::ffff:127.0.0.1`, how a server
    listening on IPv6 sockets shows a loopback-only bind)."""
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


class Listeners(threading.Thread):
    """Every listening TCP socket of the processes under `roots` (their descendants included:
    Ray's daemons and workers, the served model), sampled every 0.3 s until `stop()`.

    A process is named by the longest command line any sample read: one first sampled while it
    exits reads as empty (the kernel frees its memory before its files), and its parent's
    command line, kept beside, still tells a Ray worker (raylet starts them) from the rest."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.seen, self._done = roots, {}, threading.Event()  # pid -> (cmdline, {addr})
        self.parents: dict[int, str] = {}  # pid -> the parent's command line

    def run(self) -> None:
        while not self._done.wait(0.3):
            for root in self.roots:
                try:
                    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for proc in procs:
                    try:
                        socks = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
                        cmdline = " ".join(proc.cmdline())
                        parent = proc.parent()
                        parent_cmdline = " ".join(parent.cmdline()) if parent else ""
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
                    self.record(proc.pid, cmdline, parent_cmdline, {f"{a.ip}:{a.port}" for a in socks})

    def record(self, pid: int, cmdline: str, parent_cmdline: str, addrs: set[str]) -> None:
        known, seen_addrs = self.seen.get(pid, ("", set()))
        self.seen[pid] = (max(known, cmdline, key=len), seen_addrs | addrs)
        if len(parent_cmdline) > len(self.parents.get(pid, "")):
            self.parents[pid] = parent_cmdline

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def beyond_loopback(self) -> dict[int, tuple[str, list[str]]]:
        """Every process that listened beyond loopback, with what it listened on. Ray's servers
        count too: the local cluster a run starts listens on loopback only."""
        found = {}
        for pid, (cmdline, addrs) in self.seen.items():
            wide = sorted(a for a in addrs if not loopback(a.rsplit(":", 1)[0]))
            if wide:
                found[pid] = (cmdline[:200] or f"(exited; parent {self.parents.get(pid, '')[:120]})", wide)
        return found


def test_the_sampler_finds_every_listener_beyond_loopback():
    """The rules on made-up samples: the test below relies on them and cannot show them fail."""
    sampler = Listeners([])
    raylet = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node_ip_address=127.0.0.1"
    sampler.record(1, "ray::IDLE", raylet, {"127.0.0.1:4001"})  # a worker's gRPC server
    sampler.record(2, raylet, "python -m flows.cli run", {"127.0.0.1:4003", "::1:4004", "::ffff:127.0.0.1:4005"})
    sampler.record(3, "ray::RayTrainWorker", raylet, {"127.0.0.1:29500"})  # the store on loopback
    sampler.record(4, "python -m vllm.entrypoints.openai.api_server", "python -m flows.cli run", {"127.0.0.1:8000"})
    assert sampler.beyond_loopback() == {}
    sampler.record(1, "", raylet, {":::4001", "::ffff:10.0.0.2:4002"})  # a Ray server on every interface counts
    sampler.record(5, "", "python -m flows.cli run", {"0.0.0.0:4006"})  # an unknown exiting child of the driver
    sampler.record(4, "python -m vllm.entrypoints.openai.api_server", "python -m flows.cli run", {"0.0.0.0:8001"})
    assert sorted(sampler.beyond_loopback()) == [1, 4, 5]
    assert sampler.beyond_loopback()[5][0].startswith("(exited; parent python -m flows.cli run")
    sampler.record(6, "", raylet, set())
    sampler.record(6, "ray::IDLE", raylet, set())  # a later sample names it; the name stays
    sampler.record(6, "", raylet, set())
    assert sampler.seen[6][0] == "ray::IDLE"


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_two_runs_started_together_leave_one_champion_that_serves(tmp_path, tiny_config_factory, free_ports):
    from prefect.settings import PREFECT_API_URL

    from rlhf_core.serving import server

    raw = tiny_config_factory(tmp_path)
    raw["gates"] = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
                    "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
                    "max_degenerate_rate": 1.0, "max_kl": 1000.0}
    raw["serving"] = {"ports": free_ports(2), "smoke_prompt": "12+34="}
    config = tmp_path / "both.yaml"
    config.write_text(yaml.safe_dump(raw))
    state_dir = tmp_path / "runs" / "serving"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLHF_FAULT_KILL_AT")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=REPO,
                                  env=env, stdout=open(tmp_path / f"run{i}.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True) for i in range(2)]
        listeners = Listeners([p.pid for p in procs])
        listeners.start()
        codes = [p.wait(1200) for p in procs]
        listeners.stop()
        logs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
        summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("test-*/summary.json"))]
        assert len(summaries) == 2, logs  # two runs, two output directories

        completed = [s for s in summaries if s["status"] == "completed"]
        refused = [s for s in summaries if s["status"] != "completed"]
        assert completed and sorted(codes) == sorted([0] * len(completed) + [1] * len(refused)), (codes, logs)
        for s in refused:  # lost the race: told which champion it found and what to do
            assert s["failed_stage"] == "register", s
            assert "as expected (another run or a person moved it meanwhile)" in s["error"], s
            assert "rlhf evaluate" in s["error"]

        client = MlflowClient(raw["tracking"]["tracking_uri"])
        champion = str(client.get_registered_model("policy").aliases["champion"])
        assert champion in {str(s["stages"]["register"]["version"]) for s in completed}
        current = server.current_endpoint(state_dir)
        assert current is not None and current.version == champion and server.health(current.url)
        assert not (state_dir / "starting.json").exists()
        exp = client.get_experiment_by_name("tests").experiment_id
        assert not client.search_runs([exp], "attributes.status = 'RUNNING'")
        assert current.pid in listeners.seen, "the sampler never saw the served model"
        assert any(("default_worker.py" in cmd or cmd.startswith("ray::")) and any(a.startswith("127.0.0.1:") for a in addrs)
                   for cmd, addrs in listeners.seen.values()), "nor a training worker's rendezvous"
        assert any("gcs_server" in cmd and addrs for cmd, addrs in listeners.seen.values()), "nor Ray's GCS"
        assert listeners.beyond_loopback() == {}, listeners.beyond_loopback()
        print("\nexit codes", codes, "| champion v" + champion, "| outcomes",
              [(s["status"], s.get("stages", {}).get("register", {}).get("version")) for s in summaries])
    finally:
        server.stop(state_dir)
