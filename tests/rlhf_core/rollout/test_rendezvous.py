"""Where an engine's executor puts its worker's rendezvous file (vLLM's `vllm_dist_<hex>`)."""
import tempfile
from pathlib import Path

import pytest
from vllm.v1.executor import multiproc_executor, uniproc_executor

from rlhf_core.rollout.cpu_engine import rendezvous_in

EXECUTORS = (multiproc_executor, uniproc_executor)


def test_while_an_engine_starts_its_executors_meet_their_worker_in_the_given_directory(tmp_path):
    default = f"file://{tempfile.gettempdir()}/vllm_dist_"
    with rendezvous_in(tmp_path):
        methods = [executor.get_file_store_init_method() for executor in EXECUTORS]
        again = multiproc_executor.get_file_store_init_method()
    for method in methods:
        assert method.startswith(f"file://{tmp_path}/vllm_dist_"), method
        assert Path(method.removeprefix("file://")).parent == tmp_path
    assert again not in methods  # a new file for each engine
    for executor in EXECUTORS:  # put back once it has started
        assert executor.get_file_store_init_method().startswith(default)
    with rendezvous_in(None):  # no directory of its own (VLLM_RPC_BASE_PATH set outside): vLLM's default
        assert multiproc_executor.get_file_store_init_method().startswith(default)


def test_a_failed_start_puts_the_executors_back(tmp_path):
    with pytest.raises(RuntimeError), rendezvous_in(tmp_path):
        raise RuntimeError("the engine did not start")
    assert all(e.get_file_store_init_method().startswith(f"file://{tempfile.gettempdir()}/") for e in EXECUTORS)
