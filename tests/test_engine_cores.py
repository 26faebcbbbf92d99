"""vLLM engines on CPU bound to cores (``daskllm.engine.cpu-cores``): the cores a setting names,
the engine core's environment they give, and LocalLLMCluster's split of a machine's cores
between its workers (pure logic; ``tests/test_vllm_cluster.py`` checks a real engine core)."""

from __future__ import annotations

import types

import dask
import pytest

from daskllm.cluster import LocalLLMCluster
from daskllm.engines.vllm import cpu_environment, parse_cores


def test_core_lists_parse_ranges_and_lists_and_reject_the_rest():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores([2, 5]) == [2, 5]
    assert parse_cores(None) == [] and parse_cores("") == []
    with pytest.raises(ValueError, match="cpu-cores: 'one' is not a list of cores"):
        parse_cores("one")


def test_an_engine_bound_to_cores_gets_one_thread_each_and_an_unbound_one_its_thread_count():
    with dask.config.set({"daskllm.engine.cpu-cores": "2-3"}):
        env = cpu_environment(8)
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "2,3")
    with dask.config.set({"daskllm.engine.cpu-cores": None}):
        env = cpu_environment(3)
    assert env["OMP_NUM_THREADS"] == "3" and "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_several_workers_get_disjoint_cores_and_a_restarted_one_its_slot_s(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    cluster = types.SimpleNamespace(cpu_shares=2, worker_spec={})
    cores = [LocalLLMCluster._with_cores(cluster, {i: {"options": {}}})[i]["options"]["config"]["daskllm"]["engine"]
             ["cpu-cores"] for i in (0, 1, 2)]
    assert cores == ["0,1", "2,3", "0,1"]  # two cores each (the fifth unused); a third worker shares slot 0's
    alone = types.SimpleNamespace(cpu_shares=0, worker_spec={})
    assert LocalLLMCluster._with_cores(alone, {0: {"options": {}}}) == {0: {"options": {}}}  # one worker: unbound
