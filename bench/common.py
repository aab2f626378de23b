"""Shared by the benchmarks: model sizes, the machine's description, result files, tables."""
from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NO_DEMO_RUN = "no demo run with its own SFT policy and reward model under runs/: run `make demo` first"

# The two sizes the targets are stated at: the demo policy (fixed overheads dominate) and a
# Llama of about 25M parameters (compute dominates); "100m" for the weight-sync curve.
SIZES = {
    "demo": dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=4),
    "25m": dict(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=8),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_layers=14, num_heads=12, num_kv_heads=12),
}


def machine(engine: bool = True) -> dict:
    """The machine a result was measured on; `engine`: with vLLM's version (a GPU check's machine has no vLLM)."""
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem, 1), "python": platform.python_version(),
            "torch": torch.__version__, "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if engine:
        import vllm  # noqa: PLC0415

        info["vllm"] = vllm.__version__
    return info


def newest_demo_run() -> Path | None:
    """The newest `runs/demo-*` with its own SFT policy and reward model (a run whose SFT stage
    was cached has no models/sft of its own), or None."""
    runs = sorted(p for p in (REPO / "runs").glob("demo-*")
                  if (p / "models" / "reward").is_dir() and (p / "models" / "sft" / "config.json").is_file())
    return runs[-1] if runs else None


def demo_policy_inputs(run_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """The policy stage's inputs from a demo run, as the pipeline passes them: the training
    prompts (SFT and preference prompts, deduplicated in order) and the held-out prompts and
    answers."""
    from rlhf_core.data.schema import read_table  # noqa: PLC0415

    data = run_dir / "data"
    prompts = list(dict.fromkeys(list(read_table(data / "sft.jsonl")["prompt"])
                                 + list(read_table(data / "preferences.jsonl")["prompt"])))
    evals = read_table(data / "eval.jsonl")
    return prompts, list(evals["prompt"]), list(evals["answer"])


def demo_grpo_steps(steps: int, run_name: str) -> tuple[Path, list[dict[str, float]]] | None:
    """The demo's GRPO stage run for `steps` steps from the newest demo run's SFT policy and
    reward model (configs/demo.yaml, 2 Ray workers): (the demo run, its per-step metrics), or
    None when there is no demo run (said)."""
    from rlhf_core.config import load_config  # noqa: PLC0415
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    run_dir = newest_demo_run()
    if run_dir is None:
        print(f"\nno real-step figure: {NO_DEMO_RUN}")
        return None
    cfg = load_config(REPO / "configs" / "demo.yaml").policy
    cfg = cfg.model_copy(update={"steps": steps, "eval_every": steps, "min_accuracy_gain": -1.0})
    prompts, eval_prompts, eval_answers = demo_policy_inputs(run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        r = train_policy(prompts, eval_prompts, eval_answers, run_dir / "models" / "sft", run_dir / "models" / "reward",
                         cfg, StageSite(Path(tmp) / "policy", Path(tmp) / "ray", run_name))
    return run_dir, r.run.metrics_history


def step_seconds(metrics: dict[str, float]) -> float:
    """A policy step's wall time: its slowest worker's."""
    return max(v for k, v in metrics.items() if k.startswith("policy/step_time_s/"))


def defences_off(cfg, answer_key: bool = False):
    """`cfg` with every over-optimisation defence off, whatever it sets: one reward model and no
    audit, the default KL coefficient, no reward shaping, no preference rounds, GRPO's
    advantages divided by the group's std. With `answer_key`, the reward is the task's
    exact-match reward plus 0.25 x the reward model's score (the mix the DPO comparison ran)."""
    from rlhf_core.config import RewardShapingConfig, RoundsConfig  # noqa: PLC0415

    reward = cfg.reward.model_copy(update={"ensemble_size": 1, "audit_share": 0.0})
    policy = cfg.policy.model_copy(update={
        "kl_coef": 0.02, "shaping": RewardShapingConfig(), "rounds": RoundsConfig(),
        "grpo": cfg.policy.grpo.model_copy(update={"scale_by_std": True}),
        **({"reward_model_weight": 0.25, "verifiable_reward_weight": 1.0,
            "verifiable_reward": "addition_exact_match"} if answer_key else {})})
    return cfg.model_copy(update={"reward": reward, "policy": policy})


def gates_vs_reference(cfg, policy_dir: Path, sft_dir: Path, reward_dir: Path, prompts: list[str],
                       answers: list[str], seed: int, suites=()):
    """The pipeline's promotion gates on the candidate against its SFT policy (a fresh machine
    has no champion), as the evaluate stage computes them (`gate_models.evaluate_on`, on the CPU,
    the answers from serving's kind of engine): under the reward model and the audit (the
    policy's, kept current by preference rounds, else the reward stage's), on intervals at
    `cfg.gates.confidence`, with the regression `suites` (`load_suites`; none: their checks are
    left out), looking at more of `prompts` while a call is open (`gates.max_eval_prompts`), KL
    sampled with `seed`. -> (the decision, the `EvalResult`)."""
    import torch  # noqa: PLC0415

    from rlhf_core.eval.gate_models import GateModels, evaluate_on  # noqa: PLC0415
    from rlhf_core.eval.gates import gate  # noqa: PLC0415
    from rlhf_core.models.reward import current_audit_dir  # noqa: PLC0415

    gates = cfg.gates if suites else cfg.gates.model_copy(update={"regression_suites": []})
    cfg = cfg.model_copy(update={"gates": gates, "policy": cfg.policy.model_copy(update={"seed": seed})})
    models = GateModels(policy_dir, sft_dir, reward_dir, audit=current_audit_dir(policy_dir, reward_dir))
    result = evaluate_on(torch.device("cpu"), models, prompts, answers, cfg, suites)
    return gate(result.candidate.figures, result.reference.figures, None, gates), result


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def save(name: str, payload: dict) -> Path:
    return write_json(RESULTS / f"{name}.json", {"machine": machine(), **payload})


def write_json(path: Path, payload: dict) -> Path:
    """`payload` as indented JSON at `path`, written atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns), "-|-".join("-" * widths[c] for c in columns)]
    lines += [" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return "" if x is None else str(x)


def mean_sd(values: list[float], digits: int = 3, sign: bool = False) -> str:
    """`mean ± sd` of the values (sd 0 for one value), to `digits` decimals; `sign`: +/- on the mean."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):{'+' if sign else ''}.{digits}f} ± {sd:.{digits}f}"


class PeakMemory:
    """Peak RSS of this process and every descendant, by role (`ROLES`, plus `driver`: the
    marker of the driver's command line), sampled in a thread."""

    def __init__(self, every: float = 0.5, driver: str = "pretrained_scale"):
        self.every, self.peaks, self.roles, self._stop = every, {}, {}, threading.Event()
        self.markers = {**ROLES, driver: "driver"}
        self.first_seen: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for proc in [me, *me.children(recursive=True)]:
                try:
                    rss, label = proc.memory_info().rss, role(proc, self.markers)
                except psutil.Error:
                    continue
                self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), rss)
                self.first_seen.setdefault(proc.pid, time.monotonic())
                if label in self.markers.values() or proc.pid not in self.roles:  # Ray workers start as ray::IDLE
                    self.roles[proc.pid] = label
            self._stop.wait(self.every)

    def by_role(self) -> list[dict]:
        rows = [{"process": f"{self.roles[pid]} (pid {pid})", "peak_rss_gib": round(v / 2**30, 2)}
                for pid, v in self.peaks.items() if v > 200 * 2**20]
        return sorted(rows, key=lambda r: -r["peak_rss_gib"])


ROLES = {"RayTrainWorker": "Ray Train worker", "EngineCore": "vLLM engine core", "VLLM::Worker": "vLLM worker",
         "TrainController": "Ray Train controller", "raylet": "raylet", "gcs_server": "Ray GCS"}


def role(proc: psutil.Process, markers: dict[str, str] = ROLES) -> str:
    name = " ".join(proc.cmdline())[:200]
    return next((label for marker, label in markers.items() if marker in name or marker in proc.name()), proc.name())
