import ast
from pathlib import Path

import pytest
import torch

import rlhf_core.algos as algos
from rlhf_core.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, register_advantage


@pytest.mark.parametrize(
    "registry,expected",
    [
        (ADVANTAGE_ESTIMATORS, {"gae", "grpo", "grpo_no_std"}),
        (KL_ESTIMATORS, {"k1", "k2", "k3"}),
        (POLICY_LOSSES, {"ppo", "grpo"}),
    ],
)
def test_unknown_name_lists_the_valid_names(registry, expected):
    assert expected <= set(registry)
    with pytest.raises(KeyError) as err:
        registry["no-such-thing"]
    for name in expected:
        assert name in str(err.value)


def test_register_advantage_adds_and_refuses_duplicates():
    try:
        @register_advantage("test_zero")
        def zero(token_rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0):
            return torch.zeros_like(token_rewards), torch.zeros_like(token_rewards)

        assert ADVANTAGE_ESTIMATORS["test_zero"] is zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_zero")(zero)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_zero", None)


def test_every_exported_name_exists():
    for name in algos.__all__:
        assert hasattr(algos, name), name


ALLOWED_IMPORTS = {"__future__", "collections", "math", "typing", "torch", "rlhf_core"}


def test_algos_import_only_torch_and_the_standard_library():
    package = Path(algos.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED_IMPORTS, f"{path.name} imports {roots - ALLOWED_IMPORTS}"
