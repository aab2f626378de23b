"""The process-CPU benchmark's classification of processes, and its sampling of a real child."""
import subprocess
import sys

from bench.process_cpu import TICKS, by_kind, kind, sample_while, top_processes


def test_ray_and_vllm_processes_are_known_by_the_names_they_give_themselves():
    assert kind("ray::TrainController.run", "ray::TrainContr") == "Ray: TrainController"
    assert kind("ray::RayTrainWorker.run_train_fn", "ray::RayTrainWo") == "Ray Train: worker"
    assert kind("ray::EngineActor.generate", "ray::EngineActo") == "Ray: actor EngineActor"
    assert kind("VLLM::Worker", "VLLM::Worker") == "vLLM: Worker"
    assert kind("", "ray::IDLE") == "Ray: IDLE"  # the command line already gone: the name decides


def test_other_processes_are_known_by_their_command_line():
    python = "/repo/.venv/bin/python"
    assert kind(f"{python} -m vllm.entrypoints.openai.api_server --model m", "python") == "vLLM server: API process"
    assert kind(f"{python} -m flows.cli run --config c.yaml", "python") == "rlhf run (CLI)"
    assert kind(f"{python} -m flows.cli gateway --set x=1", "python") == "rlhf, other commands"
    assert kind(f"{python} -m huey.bin.huey_consumer mlflow.server.jobs", "python") == "MLflow server: job consumers"
    assert kind("postgres: rlhf t0 127.0.0.1 idle", "postgres") == "PostgreSQL"
    assert kind(f"{python} -c pass", "python") == "other Python"


def test_a_child_that_computes_is_counted_with_its_cpu_time():
    code = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    start, seen = sample_while(proc, every_s=0.05)
    [(key, (ticks, cmdline, _))] = [(k, v) for k, v in seen.items() if k[0] == proc.pid]
    used = (ticks - start.get(key, 0)) / TICKS  # what it used after the first reading
    assert cmdline.endswith("pass") and 0.5 <= used < 2.0, (used, cmdline)
    assert any(r["kind"] == "other Python" and r["cpu_s"] >= round(used, 1) for r in by_kind(start, seen))  # 0.1 s rows


def test_the_top_processes_name_each_one_by_its_command_most_cpu_first():
    start = {(10, 1): 0, (11, 1): 5 * TICKS}
    seen = {(10, 1): (3 * TICKS, "/v/bin/python -c work", "python"), (11, 1): (5 * TICKS, "VLLM::Worker", "VLLM::Worker"),
            (12, 1): (7 * TICKS, "/v/bin/python -m flows.cli run --config c.yaml", "python")}  # started after the first reading
    assert top_processes(start, seen, n=5) == [
        {"cpu_s": 7.0, "kind": "rlhf run (CLI)", "command": "/v/bin/python -m flows.cli run --config c.yaml"},
        {"cpu_s": 3.0, "kind": "other Python", "command": "/v/bin/python -c work"},
    ]  # the worker used nothing since the first reading: not listed
