"""The CPU list the rollout engine binds vLLM's worker to (VLLM_CPU_OMP_THREADS_BIND syntax)."""
import pytest

from rlhf_core.rollout.cpu_engine import cpu_list


@pytest.mark.parametrize(("cpus", "expected"), [
    ({0}, "0"),
    ({0, 1}, "0-1"),
    ({3, 0, 1, 2}, "0-3"),
    ({0, 2}, "0,2"),
    ([0, 2, 3, 4, 7, 8], "0,2-4,7-8"),
    ({5, 1, 2, 9}, "1-2,5,9"),
])
def test_cpu_list_is_ranges_in_order(cpus, expected):
    assert cpu_list(cpus) == expected
