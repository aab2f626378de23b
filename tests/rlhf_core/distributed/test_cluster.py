"""`ray_session`: the pipeline's training stages share one local Ray cluster, started with
the Ray Train settings for a single node, listening on loopback only, and shut down once at the
end. Run in a fresh Python process: the test session's own cluster (tests/conftest.py) would be
joined instead."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import ipaddress, json, os, subprocess, sys, time, urllib.request
import psutil, ray
from rlhf_core.distributed.cluster import connect_ray, ray_session

@ray.remote
def worker_pid():
    return os.getpid()

@ray.remote
def raylet_pid():
    return os.environ["RAY_RAYLET_PID"]

seen = {}
with ray_session():
    seen["up"] = ray.is_initialized()
    time.sleep(2)  # the autoscaler monitor opens its metrics server after it connects
    seen["workers_before_work"] = sum(  # starting (default_worker.py) or started (ray::IDLE)
        p.name() == "ray::IDLE" or (p.name() != "raylet" and "default_worker.py" in " ".join(p.cmdline()))
        for p in psutil.Process().children(recursive=True))
    # a process of the cluster that will miss its raylet's exit, as a Train controller once did
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                              env={**os.environ, "RAY_RAYLET_PID": ray.get(raylet_pid.remote())})
    seen["stage_started_its_own"] = connect_ray()  # what each stage calls: joins the session's cluster
    seen["env"] = {k: os.environ.get(k) for k in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
    seen["workers"] = len(set(ray.get([worker_pid.remote() for _ in range(4)])))
    me = psutil.Process()
    listening = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline())[:120]
            addrs = [c.laddr for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        for a in addrs:
            listening[f"{a.ip}:{a.port}"] = name
    seen["listening"] = len(listening)
    seen["beyond_loopback"] = {k: v for k, v in listening.items()
                               if not ipaddress.ip_address(k.rsplit(":", 1)[0].removeprefix("::ffff:")).is_loopback}
    metrics = ray.experimental.internal_kv._internal_kv_get("AutoscalerMetricsAddress")
    seen["monitor"] = metrics.decode() if metrics else None
    if metrics:  # the one server that answers without Ray's token, on loopback
        seen["monitor_answers"] = urllib.request.urlopen(f"http://{seen['monitor']}/metrics", timeout=5).status
seen["up_after"] = ray.is_initialized()
seen["orphan_ended"] = orphan.poll() is not None
orphan.kill()
print(json.dumps(seen))
"""


def test_what_outlives_a_local_cluster_is_ended_and_nothing_else():
    """`end_orphans`: processes of the raylet's environment started since its start, the ones
    that ignore SIGTERM killed; another cluster's, and an older process's, left alone."""
    from rlhf_core.distributed.cluster import end_orphans

    def start(raylet: str, ignore_term: bool = False, seconds: float = 300) -> subprocess.Popen:
        code = ("import signal, sys, time\nif " + repr(ignore_term) + ": signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('up', flush=True)\ntime.sleep(" + repr(seconds) + ")")
        proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "RAY_RAYLET_PID": raylet})
        assert proc.stdout.readline() == "up\n"  # running, its SIGTERM handler set
        return proc

    older = start("4242")
    time.sleep(0.05)  # start times count in 10 ms ticks
    marker = start("0")  # started after `older`, before the rest: its start time is the sweep's `since`
    since = psutil.Process(marker.pid).create_time()
    time.sleep(0.05)  # start times count in 10 ms ticks
    stubborn, plain, leaving, other = start("4242", ignore_term=True), start("4242"), start("4242", seconds=0.2), start("4343")
    try:
        ended = end_orphans(4242, since, grace_s=0.5)  # `leaving` leaves within the grace
        assert sorted(int(e.split()[0]) for e in ended) == sorted((stubborn.pid, plain.pid)), ended
        # (the sweep reaped its own children, so their exit codes are lost: SIGTERM could not end `stubborn`)
        assert all(proc.poll() is not None for proc in (stubborn, plain, leaving))
        assert older.poll() is None and other.poll() is None
    finally:
        for proc in (older, marker, stubborn, plain, leaving, other):
            proc.kill()
            proc.wait()


@pytest.mark.slow  # starts a Ray cluster of its own
def test_one_local_cluster_for_the_stages_with_single_node_train_settings_a_user_setting_wins():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_TRAIN_")}
    env |= {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["up"] and not seen["stage_started_its_own"] and not seen["up_after"] and seen["orphan_ended"]
    assert seen["env"] == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    # GCS, raylet (2), runtime-env agent, autoscaler monitor, the driver's and each worker's servers
    assert seen["workers"] >= 1 and seen["listening"] >= 6, seen
    assert seen["workers_before_work"] == 0, seen  # no idle workers started ahead of any work
    assert seen["beyond_loopback"] == {}, seen
    assert seen["monitor"].startswith("127.0.0.1:") and seen["monitor_answers"] == 200, seen


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


def _listening_sockets_beyond_loopback_and_ray() -> dict:
    """In a Ray Train worker, after an all-reduce: every socket this process listens on that is
    neither on loopback nor Ray's own worker server; gathered from all ranks onto rank 0."""
    import ipaddress
    import os

    import psutil
    import ray
    import torch
    import torch.distributed as dist
    from ray.core.generated.common_pb2 import Address

    t = torch.ones(1)
    dist.all_reduce(t)  # gloo's connections are up
    worker = ray._private.worker.global_worker
    ray_port = Address.FromString(worker.core_worker.get_owner_address(ray.put(0))).port
    open_ = [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(os.getpid()).net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port != ray_port
             and not ipaddress.ip_address(c.laddr.ip).is_loopback]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "open": open_, "sum": t.item(),
                                      "store_port": os.environ.get("MASTER_PORT")})
    return {"ranks": gathered}


# the helper actors StageTrainer can leave out (the coordinator: one a cluster, made by its first fit)
HELPERS = ("DatasetManager", "PlacementGroupCleaner", "_AutoscalingCoordinatorActor")


def _fit(trainer_cls, torch_config, tmp_path, name):
    """The ranks' findings, and the class names of the HELPERS actors the fit started, one per actor."""
    import ray
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig

    def helpers() -> dict[str, str]:
        return {a: info["ActorClassName"] for a, info in ray._private.state.actors().items()
                if info["ActorClassName"] in HELPERS}

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    before = helpers()
    trainer = trainer_cls(_listening_sockets_beyond_loopback_and_ray, torch_config=torch_config,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name=name, storage_path=str(tmp_path)))
    ranks = trainer.fit().return_value["ranks"]
    return ranks, sorted(name for actor, name in helpers().items() if actor not in before)


@pytest.mark.slow  # a Ray Train fit
def test_the_training_process_group_listens_on_loopback_only(ray_cluster, tmp_path):
    """With the pipeline's set-up (`torch_trainer`: `StageTrainer` and `LoopbackTorchConfig`) two
    workers on one node rendezvous and talk over loopback: no socket of theirs beyond Ray's own
    server is reachable from another host; and a fit given no Ray Dataset, on a cluster this
    process started, starts no dataset manager, no placement-group cleaner and no autoscaling
    coordinator. Ray Train's default set-up, the control, opens the store on every interface
    and starts one of each."""
    from ray.train.torch import TorchConfig, TorchTrainer

    from rlhf_core.distributed.cluster import StageTrainer
    from rlhf_core.distributed.rendezvous import LoopbackTorchConfig

    ours, helpers = _fit(StageTrainer, LoopbackTorchConfig(), tmp_path, "loopback")
    assert [r["sum"] for r in ours] == [2.0, 2.0]  # the group works
    assert [r["open"] for r in ours] == [[], []], ours
    assert helpers == []

    default, helpers = _fit(TorchTrainer, TorchConfig(), tmp_path, "default")
    assert any(r["open"] for r in default), default  # the control: the check sees an open store
    assert any(addr.endswith(f":{default[0]['store_port']}") for addr in default[0]["open"]), default
    assert helpers == sorted(HELPERS), helpers  # the control: the actor table shows the helpers Ray Train starts


def test_a_stage_trainer_leaves_out_the_dataset_manager_without_datasets_and_more_on_its_own_cluster(
        tmp_path, monkeypatch):
    """What `StageTrainer` relies on in Ray Train (the default callbacks, among them
    DatasetsCallback and PlacementGroupCleanerCallback; the controller's scaling policy): a Ray
    upgrade that moves it fails here, not in a fit. On a cluster this process did not start (one
    it joined), the cleaner and Ray Train's scaling policy stay."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy, ResizeDecision, create_scaling_policy
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from rlhf_core.distributed import cluster
    from rlhf_core.distributed.cluster import LocalScalingPolicy, StageTrainer, torch_trainer

    trainer = torch_trainer(lambda: None, num_workers=1, use_gpu=False, placement_strategy="PACK", run_name="r",
                            storage_path=tmp_path, max_failures=0, env={})
    with_data = StageTrainer(lambda: None, datasets={"train": lambda: None})
    assert isinstance(trainer, StageTrainer)

    def ours_and_theirs(t) -> tuple[list[type], list[type]]:
        return [type(c) for c in t._create_default_callbacks()], [type(c) for c in TorchTrainer._create_default_callbacks(t)]

    controllers = []  # the scaling policy each (stubbed) controller would be given
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller",
                        lambda self, **kwargs: controllers.append(kwargs["scaling_policy"]))

    def policy_given(t):
        t._initialize_and_run_controller(scaling_policy=create_scaling_policy(t.scaling_config), callbacks=[])
        return controllers[-1]

    monkeypatch.setattr(cluster, "_own_raylet", lambda: None)  # joined a cluster
    ours, theirs = ours_and_theirs(trainer)
    assert DatasetsCallback in theirs and PlacementGroupCleanerCallback in theirs
    assert ours == [t for t in theirs if t is not DatasetsCallback]
    assert ours_and_theirs(with_data)[0] == ours_and_theirs(with_data)[1]
    assert type(policy_given(trainer)) is FixedScalingPolicy

    monkeypatch.setattr(cluster, "_own_raylet", lambda: (1234, 0.0))  # connected to a cluster it started
    ours, theirs = ours_and_theirs(trainer)
    assert ours == [t for t in theirs if t not in (DatasetsCallback, PlacementGroupCleanerCallback)]
    ours, theirs = ours_and_theirs(with_data)
    assert ours == [t for t in theirs if t is not PlacementGroupCleanerCallback]
    policy = policy_given(trainer)
    assert type(policy) is LocalScalingPolicy and policy.scaling_config is trainer.scaling_config
    # it decides as Ray Train's does, with no coordinator to ask (Ray Train's would need one: the control)
    policy.after_controller_start(None)
    decision = policy.make_decision_for_non_running_worker_group()
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 1
    with pytest.raises(AssertionError):
        FixedScalingPolicy(trainer.scaling_config).make_decision_for_non_running_worker_group()


@pytest.mark.parametrize(("built", "available", "nodes", "use_gpu", "expected"), [
    (True, True, 1, None, True),  # a CUDA torch that sees the GPUs: use them
    (False, False, 1, None, False),  # a CPU build on a GPU machine: CPUs, and say why
    (True, False, 1, None, False),  # a CUDA build that sees no device here (CUDA_VISIBLE_DEVICES="")
    (True, False, 2, None, True),  # a multi-node cluster: the workers' torch sees their GPUs, not the driver's
    (True, True, 1, False, False),  # asked for CPUs
    (False, False, 1, True, "use_gpu is true but this torch"),
])
def test_gpus_are_used_only_where_torch_can_drive_them(monkeypatch, capsys, built, available, nodes, use_gpu, expected):
    import ray
    import torch

    from rlhf_core.distributed.cluster import check_cluster

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{}] * nodes)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            check_cluster("policy", 2, use_gpu)
        return
    assert check_cluster("policy", 2, use_gpu) is expected
    said = capsys.readouterr().out
    assert ("training runs on CPUs" in said) == (use_gpu is None and not expected), said
    if not built and use_gpu is None:
        assert "CPU build" in said and "policy.use_gpu: false" in said
