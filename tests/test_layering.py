"""rlhf_core/ holds the algorithms; Prefect and MLflow never appear in it."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_CORE = {"prefect", "mlflow"}
# Heavy engines are allowed only in the modules whose job is to drive them.
ENGINE_MODULES = {"deepspeed", "vllm", "ray"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_core_module_imports_prefect_or_mlflow():
    offenders = {
        str(p.relative_to(REPO)): sorted(imported_roots(p) & FORBIDDEN_IN_CORE)
        for p in (REPO / "rlhf_core").rglob("*.py")
        if imported_roots(p) & FORBIDDEN_IN_CORE
    }
    assert offenders == {}


def test_engines_are_confined_to_their_driver_modules():
    allowed_dirs = {"distributed", "rollout"}
    offenders = {
        str(p.relative_to(REPO)): sorted(imported_roots(p) & ENGINE_MODULES)
        for p in (REPO / "rlhf_core").rglob("*.py")
        if imported_roots(p) & ENGINE_MODULES and not allowed_dirs & set(p.relative_to(REPO).parts)
    }
    assert offenders == {}


def test_the_checker_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import mlflow.tracking\nfrom prefect import flow\nimport os\n")
    assert imported_roots(probe) == {"mlflow", "prefect", "os"}
