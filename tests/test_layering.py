"""The layers of the architecture (docs/pipeline.md, and the table of folders in the README), checked on
every import statement:

- `rlhf_core/` holds the algorithms: no Prefect, no MLflow, and none of the layers above it
  (`tasks`, `flows`, `monitoring`); Ray, DeepSpeed and vLLM only in the modules that drive them.
- `tasks/` are the I/O adapters: they may import everything.
- `flows/` compose tasks: Prefect, `tasks` and the typed config, nothing that computes (no
  torch, transformers, engines, MLflow or Great Expectations, no other `rlhf_core` module).
  The command line (`flows/cli.py`) also answers three commands that need no flow: `serving`
  (status and stop of the serving process), `make-demo-data`, and `check-config` (with the
  regression suites' power calculation, plain arithmetic).
- In `rlhf_core/`, the rollout engine (`rollout/`) sits below the trainers (`distributed/`,
  `training/`) and the evaluation: the trainer hands it what it needs (a weight source, the
  resources it reserved), it never imports them.
- `monitoring/` is where metrics leave the process: it never imports `flows` or `tasks`.
- Nothing outside `tests/` imports the tests; what tests and benchmarks share is in
  `rlhf_core.testing`.
- No two project modules import each other at load time, directly or round a longer loop.
"""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("rlhf_core", "tasks", "flows", "monitoring")
FORBIDDEN_IN_CORE = {"prefect", "mlflow", "tasks", "flows", "monitoring"}
# Heavy engines are allowed only in the modules whose job is to drive them.
ENGINE_MODULES = {"deepspeed", "vllm", "ray"}
COMPUTE_LIBRARIES = {"torch", "transformers", "deepspeed", "vllm", "ray", "mlflow", "great_expectations", "numpy",
                     "pandas"}
CORE_MODULES_FOR_FLOWS = {"rlhf_core.config", "rlhf_core.config.default"}
CORE_MODULES_FOR_THE_CLI = CORE_MODULES_FOR_FLOWS | {"rlhf_core.serving.server", "rlhf_core.serving",
                                                     "rlhf_core.data.synthetic", "rlhf_core.eval.sequential"}
COMMAND_LINE_MODULES = {"cli.py", "launch.py", "serving_commands.py", "config_view.py"}  # flows/: the `rlhf` command's own


def imported_modules(path: Path) -> set[str]:
    """Every absolute module an import statement names, anywhere in the file (function bodies too);
    `from a import b` counts as `a` and, when `b` may be a module, `a.b`."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def imported_roots(path: Path) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(path)}


def offenders(folder: str, bad) -> dict[str, list[str]]:
    found = {}
    for p in sorted((REPO / folder).rglob("*.py")):
        wrong = sorted(m for m in imported_modules(p) if bad(p, m))
        if wrong:
            found[str(p.relative_to(REPO))] = wrong
    return found


def test_no_core_module_imports_prefect_mlflow_or_a_layer_above():
    assert offenders("rlhf_core", lambda p, m: m.split(".")[0] in FORBIDDEN_IN_CORE) == {}


# In rlhf_core/, a package never imports those above it in this order (lowest first).
CORE_ORDER = (("models",), ("rollout",), ("eval", "training", "distributed"))


def test_the_rollout_engine_sits_below_the_trainers():
    def above(path: Path, module: str) -> bool:
        parts = path.relative_to(REPO / "rlhf_core").parts
        if not module.startswith("rlhf_core.") or len(parts) < 2:
            return False
        level = {pkg: i for i, group in enumerate(CORE_ORDER) for pkg in group}
        here, there = level.get(parts[0]), level.get(module.split(".")[1])
        return here is not None and there is not None and there > here
    assert offenders("rlhf_core/rollout", above) == {}
    # one exception: the GGUF import command checks its conversion against the engine's greedy answers
    assert offenders("rlhf_core/models", above) == {
        "rlhf_core/models/gguf_import.py": ["rlhf_core.rollout.greedy", "rlhf_core.rollout.greedy.vllm_greedy"]}


def test_the_trainers_open_their_engine_through_the_front_door_only():
    # rollout.factory.open_engine decides the engine, its transport and its sleep; rollout.pipeline
    # runs an engine opened there on a thread of its own; rollout.sync_check judges what an
    # engine's `probe` answers
    door = {"rlhf_core.rollout", "rlhf_core.rollout.factory", "rlhf_core.rollout.pipeline", "rlhf_core.rollout.sync_check"}
    assert offenders("rlhf_core/distributed", lambda p, m: m.startswith("rlhf_core.rollout")
                     and not any(m == d or m.startswith(d + ".") for d in door - {"rlhf_core.rollout"})
                     and m != "rlhf_core.rollout") == {}


def test_engines_are_confined_to_their_driver_modules():
    allowed_dirs = {"distributed", "rollout"}
    assert offenders("rlhf_core", lambda p, m: m.split(".")[0] in ENGINE_MODULES
                     and not allowed_dirs & set(p.relative_to(REPO).parts)) == {}


def _not_for_flows(path: Path, module: str) -> bool:
    root = module.split(".")[0]
    if root in COMPUTE_LIBRARIES:
        return True
    if root != "rlhf_core" or module == "rlhf_core":
        return False
    allowed = CORE_MODULES_FOR_THE_CLI if path.name in COMMAND_LINE_MODULES else CORE_MODULES_FOR_FLOWS
    return not any(module == a or module.startswith(a + ".") for a in allowed)


def test_flows_import_prefect_tasks_and_the_config_only():
    assert offenders("flows", _not_for_flows) == {}


def test_monitoring_never_imports_flows_or_tasks():
    assert offenders("monitoring", lambda p, m: m.split(".")[0] in {"flows", "tasks"}) == {}


def test_the_checker_sees_imports_anywhere_in_a_file(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import mlflow.tracking\nfrom prefect import flow\nimport os\n"
                     "def f():\n    from rlhf_core.models import llama\n")
    assert imported_roots(probe) == {"mlflow", "prefect", "os", "rlhf_core"}
    assert "rlhf_core.models.llama" in imported_modules(probe)
    assert _not_for_flows(probe, "rlhf_core.models.llama") and _not_for_flows(probe, "torch.nn")
    assert not _not_for_flows(probe, "rlhf_core.config") and not _not_for_flows(probe, "tasks.data")


def test_benchmarks_and_the_package_never_import_the_tests():
    """The tests may test a benchmark's code, so nothing the tests import may import them back:
    what both need lives in `rlhf_core.testing`."""
    for folder in ("bench", "rlhf_core", "tasks", "flows", "monitoring"):
        assert offenders(folder, lambda p, m: m.split(".")[0] == "tests") == {}, folder


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports() -> dict[str, set[str]]:
    """module -> the project modules its top-level statements import (what runs when it is
    first imported; imports inside functions run later and cannot make a cycle at load time)."""
    files = {_module_name(p): p for folder in PROJECT_PACKAGES for p in (REPO / folder).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in files:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                edges |= submodules or {node.module}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_project_modules():
    graph = load_time_imports()
    assert "tasks.data_contract" in graph["tasks.data"]  # the graph sees the project's imports
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_loop_of_three_and_ignores_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
