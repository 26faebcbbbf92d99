"""The placement plugin on a multi-process cluster with real engines: what needs processes and
models (end-to-end cache hits, a worker that gets a model, a killed worker, the CLI scheduler
preload). Placement decisions alone are tested in process, in test_placement_logic.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest
from distributed import Client, get_task_stream
from distributed.utils_test import poll_for

import daskllm
from daskllm.runtime.submit import plan as lowered
from daskllm.worker.results import RESULTS
from daskllm.runtime.view import ModelNotServedError
from daskllm.worker import EngineHost, engine_stats, reset_prefix_caches, resident_models
from helpers import cold_start, scheduler_address, set_policy

SYSTEMS = [f"System prompt {n}: you are assistant number {n}. Answer in one short sentence and cite the module. " * 3
           for n in range(3)]
QUESTIONS = [f"Question {i}: how do I use feature {i} of the standard library well?" for i in range(24)]
NAIVE = {"passes": [], "granularity": "query", "result_cache": False}


CLUSTER = dict(n_workers=2, threads_per_worker=6, engine_options={"kv_cache_tokens": 8192})


@pytest.fixture(scope="module")
def shared_client(llm_cluster, tiny_model_dir):
    with llm_cluster(**CLUSTER) as client:
        resident_models(client)  # engines loaded: counters exist whichever test runs first
        yield client


@pytest.fixture
def client(shared_client):
    """The module's cluster, from cold and with the default policy."""
    cold_start(shared_client)
    set_policy(shared_client, "cache_aware")
    return shared_client


def workload(max_tokens: int = 4, questions: int = len(QUESTIONS)):
    return [daskllm.generate(daskllm.prompt(system + "{q}\nAnswer:", q=QUESTIONS[:questions]), max_tokens=max_tokens)
            for system in SYSTEMS]


def ran_on(stream) -> dict[str, str]:
    return {t["key"]: t["worker"] for t in stream.data}


def test_decode_follows_its_prefill_and_prefixes_spread(client):
    nodes = workload()
    graph = lowered(nodes).graph  # before computing: afterwards the result cache would serve it all
    with get_task_stream(client) as stream:
        daskllm.compute(*nodes)
    where = ran_on(stream)
    pairs = 0
    for layer in graph.layers.values():
        for key, task in layer.items():
            if key.startswith("decode-"):
                for dep in task.dependencies:
                    if dep.startswith("prefill-"):
                        assert where[key] == where[dep]
                        pairs += 1
    assert pairs >= len(SYSTEMS)
    assert len({where[k] for k in where if k.startswith("decode-")}) == 2  # both workers used


def test_cache_aware_beats_round_robin_on_hits_without_worse_balance(client):
    results = {}
    for policy in ("round_robin", "cache_aware"):
        cold_start(client)
        set_policy(client, policy)
        before = client.run(engine_stats)
        with daskllm.usage() as usage:
            # One task per call and no prefill tasks: what differs is placement alone.
            values = daskllm.compute(*workload(), passes=["cse"], granularity="query")
        after = client.run(engine_stats)
        computed = [after[w]["tiny"]["prefill_tokens_computed"] - before[w]["tiny"]["prefill_tokens_computed"]
                    + after[w]["tiny"]["decode_tokens"] - before[w]["tiny"]["decode_tokens"] for w in after]
        results[policy] = (usage.prefill_tokens_cached / usage.prefill_tokens, max(computed) / (sum(computed) / 2),
                           values)
    assert results["cache_aware"][2] == results["round_robin"][2]  # placement never changes outputs
    assert results["cache_aware"][0] > results["round_robin"][0], {p: r[:2] for p, r in results.items()}
    assert results["cache_aware"][1] <= max(results["round_robin"][1], 1.3)


def test_the_policy_places_a_plan_run_as_parts(client):
    """With every pass on, a small plan runs as parts (a worker task per shard of calls): the
    policy still decides where, so a shared prefix is computed on fewer workers when cache-aware."""
    nodes = workload(questions=16)  # 48 calls: within parts-calls-per-worker (32) x 2 workers
    assert lowered(nodes).report["parts"]["tasks"] == 2 * len(SYSTEMS)  # each system's calls: a shard per worker
    results = {}
    for policy in ("round_robin", "cache_aware"):
        cold_start(client)
        set_policy(client, policy)
        with daskllm.usage() as usage:
            values = daskllm.compute(*nodes)
        results[policy] = (usage.prefill_tokens_cached / usage.prefill_tokens, values)
    assert results["cache_aware"][1] == results["round_robin"][1]
    assert results["cache_aware"][0] > results["round_robin"][0], {p: r[0] for p, r in results.items()}


def test_tasks_for_a_model_run_only_where_it_is(client, tiny_model_dir, tmp_path):
    """One worker gets a second model (a copy of tiny, so the same tokens); its tasks go only there."""
    model_b = tmp_path / "tiny-b"
    shutil.copytree(tiny_model_dir, model_b)
    workers = sorted(client.scheduler_info()["workers"])
    other = workers[1]

    async def add_engine(dask_worker):
        await dask_worker.plugin_add(EngineHost(["tiny", str(model_b)], kv_cache_tokens=4096),
                                     name="daskllm-engines")

    client.run(add_engine, workers=[other])
    try:
        def advertised():
            return client.run_on_scheduler(
                lambda dask_scheduler, w: list(dask_scheduler.workers[w].metrics.get("daskllm", {})
                                               .get("models", {}).get("llm", [])), w=other)

        poll_for(lambda: "tiny-b" in advertised(), timeout=15)
        node = daskllm.generate(daskllm.prompt("Model B, question {q}", q=QUESTIONS), max_tokens=3, model=str(model_b))
        with get_task_stream(client) as stream:
            on_b = node.compute()
        assert {w for k, w in ran_on(stream).items() if k.startswith("decode-")} == {other}
        assert on_b == daskllm.generate(daskllm.prompt("Model B, question {q}", q=QUESTIONS), max_tokens=3,
                                        model="tiny").compute()  # same weights: same tokens
    finally:
        async def restore(dask_worker):
            await dask_worker.plugin_add(EngineHost(["tiny"], kv_cache_tokens=8192), name="daskllm-engines")

        client.run(restore, workers=[other])
        poll_for(lambda: all(m == ["tiny"] for m in resident_models(client).values()), timeout=15)
        poll_for(lambda: advertised() == ["tiny"], timeout=15)  # as the scheduler sees it


def test_a_model_no_worker_holds_fails_at_submission(client, tiny_model_dir, tmp_path):
    # (A graph that reaches the scheduler anyway fails there: test_placement_logic.py.)
    copy = tmp_path / "tiny-copy"
    shutil.copytree(tiny_model_dir, copy)
    node = daskllm.generate("hello", model=str(copy), max_tokens=2)
    with pytest.raises(ModelNotServedError, match=r"no worker serves the llm model '\S*tiny-copy'.*tiny \(2 workers\)"):
        client.compute(node)  # at submission, before anything runs
    assert daskllm.generate("hello", max_tokens=2).compute()  # the cluster carries on


def test_killing_a_worker_loses_nothing(llm_cluster, tiny_model_dir):
    expected_nodes = workload(max_tokens=24)
    with llm_cluster(**CLUSTER) as client:
        expected = daskllm.compute(*expected_nodes, **NAIVE)
        RESULTS.clear()
        client.run(reset_prefix_caches)
        futures = client.compute(workload(max_tokens=24))
        poll_for(lambda: sum(map(bool, client.processing().values())) == 2, timeout=60)  # under way on both
        victim = sorted(client.scheduler_info()["workers"])[0]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        assert client.gather(futures, errors="raise") == list(expected)
        re_placed = [e[1] for e in client.get_events("daskllm-placement") if e[1].get("action") == "re-placed"]
        assert re_placed and all(e["worker"] == victim for e in re_placed)


@pytest.mark.slow
def test_scheduler_preload_with_cli_workers(tmp_path, tiny_model_dir):
    repo = pathlib.Path(__file__).resolve().parents[1]
    bin_dir = pathlib.Path(sys.executable).parent
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = subprocess.Popen([bin_dir / "dask", "scheduler", "--scheduler-file", scheduler_file, "--port", "0",
                                  "--dashboard-address", "127.0.0.1:0", "--host", "127.0.0.1", "--preload",
                                  repo / "plugins" / "scheduler.py", "--daskllm-placement", "least_loaded"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        address = scheduler_address(scheduler_file, scheduler)
        worker = subprocess.Popen([bin_dir / "dask", "worker", address, "--nthreads", "4", "--no-dashboard",
                                   "--preload", repo / "plugins" / "worker.py", "--daskllm-model", "tiny"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            policy = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["daskllm-placement"].policy)
            assert policy == "least_loaded"
            node = daskllm.generate(daskllm.prompt("Q: {q}", q=QUESTIONS[:3]), max_tokens=3)
            got = client.compute(node).result(timeout=120)
            decisions = client.run_on_scheduler(
                lambda dask_scheduler: dict(dask_scheduler.plugins["daskllm-placement"].decisions))
            # The preload also adds the dashboard's LLM page and its JSON route; the job's
            # tokens show there with the worker's next heartbeat.
            dashboard = f"http://127.0.0.1:{client.scheduler_info()['services']['dashboard']}"

            def snapshot():
                with urllib.request.urlopen(dashboard + "/llm/metrics.json", timeout=10) as response:
                    return json.loads(response.read())

            poll_for(lambda: sum(w["engines"].get("tiny", {}).get("decode_tokens", 0) for w in snapshot()["workers"].values()) >= 9,
                     timeout=30)
            [held] = snapshot()["workers"].values()
            with urllib.request.urlopen(dashboard + "/llm", timeout=10) as response:
                assert response.status == 200
        assert len(got) == 3 and sum(decisions.values()) >= 1
        assert held["models"]["llm"] == ["tiny"]
    finally:
        for proc in (worker, scheduler):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
