"""Engines resident on Dask workers: a real multi-process LocalLLMCluster."""

from __future__ import annotations

import multiprocessing
import os
import threading

import dask

import pytest
from distributed import Client, get_worker
from distributed.utils_test import poll_for

from daskllm.cluster import LocalLLMCluster, discover_gpus
from daskllm.engines import EngineSpec, SamplingParams
from daskllm.models import ModelNotFoundError
from daskllm.worker import EngineHost, EngineLoadError, get_engine, resident_models

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [f"A shared instruction for every request. Question {i}: {'why ' * (i % 5)}?" for i in range(24)]


def generate_on_worker(prompt: str) -> tuple[list[int], str, int]:
    engine = get_engine("tiny")
    completion = engine.submit(prompt, PARAMS).result()
    return completion.token_ids, get_worker().address, id(engine)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """What an in-process engine generates: the multi-process cluster must match it exactly."""
    with EngineSpec(model=str(tiny_model_dir), name="tiny").load(kv_cache_tokens=4096) as engine:
        return [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(n_workers=2, threads_per_worker=8, engine_options={"kv_cache_tokens": 4096}) as client:
        yield client


def test_every_worker_holds_the_model(client):
    assert resident_models(client) == {w: ["tiny"] for w in client.scheduler_info()["workers"]}
    workers = set(client.scheduler_info()["workers"])
    poll_for(lambda: {e[1]["worker"] for e in client.get_events("daskllm")} >= workers, timeout=10)
    assert all(list(e[1]["models"]["llm"]) == ["tiny"] for e in client.get_events("daskllm"))
    assert resident_models(client, kind="embed") == {w: ["all-MiniLM-L6-v2"] for w in workers}
    assert resident_models(client, kind="rerank") == {w: ["all-MiniLM-L6-v2"] for w in workers}


@pytest.mark.bits
def test_tasks_share_one_engine_per_worker_and_match_in_process_output(client, expected):
    futures = client.map(generate_on_worker, PROMPTS, pure=False)
    results = client.gather(futures)
    assert [tokens for tokens, _, _ in results] == expected
    engines_per_worker: dict[str, set[int]] = {}
    for _, worker, engine_id in results:
        engines_per_worker.setdefault(worker, set()).add(engine_id)
    assert all(len(ids) == 1 for ids in engines_per_worker.values())

    # Concurrent tasks on one worker fed the same engine's batch.
    stats = client.run(lambda dask_worker: dask_worker.plugins["daskllm-engines"].engines["llm"]["tiny"].stats())
    assert max(s.max_batch_size for s in stats.values()) > 1
    assert sum(s.requests_finished for s in stats.values()) >= len(PROMPTS)


def test_workers_advertise_models_in_heartbeats(client):
    def advertised(dask_scheduler):
        return {addr: ws.metrics.get("daskllm", {}).get("models") for addr, ws in dask_scheduler.workers.items()}

    def all_advertise():
        return all(m and list(m["llm"]) == ["tiny"] for m in client.run_on_scheduler(advertised).values())

    poll_for(all_advertise, timeout=10)  # from the first heartbeat: what they were configured with

    def engines():  # from the first heartbeat after the engines loaded (in the background)
        return client.run_on_scheduler(lambda dask_scheduler: [
            ws.metrics["daskllm"]["engines"]["llm"].get("tiny") for ws in dask_scheduler.workers.values()])

    poll_for(lambda: all(engines()), timeout=60)
    assert all("prefill_tokens_computed" in e and "cache_blocks_total" in e for e in engines())


def test_get_engine_names_what_is_missing(client):
    with pytest.raises(LookupError, match=r"'nope' is not resident.*\['tiny'\]"):
        client.submit(get_engine, "nope", pure=False).result()


def test_failed_plugin_setup_leaves_no_half_configured_engines(client, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(EngineLoadError, match="broken-model"):
        client.register_plugin(EngineHost([str(tiny_model_dir), str(broken)]), name="daskllm-engines")
    with pytest.raises(EngineLoadError, match="broken-model"):
        client.submit(get_engine, "tiny", pure=False).result()
    assert client.submit(sum, [1, 2], pure=False).result() == 3  # the workers are alive
    # Registering a good configuration brings the engines back.
    client.register_plugin(EngineHost(["tiny"], kv_cache_tokens=4096), name="daskllm-engines")
    assert all(m == ["tiny"] for m in resident_models(client).values())


def test_unknown_model_fails_before_any_worker_starts():
    started = threading.active_count()
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LocalLLMCluster(models=["no-such-model"], dashboard_address="127.0.0.1:0")
    assert threading.active_count() <= started + 1


@pytest.fixture
def restore_dask_config():
    """GPU clusters make later workers non-daemonic (vLLM needs that); undo it after the test."""
    saved = dask.config.get("distributed.worker.daemon")
    yield
    dask.config.set({"distributed.worker.daemon": saved})


@pytest.mark.slow  # worker processes
def test_one_worker_per_gpu_with_its_own_visible_device(tiny_model_dir, monkeypatch, restore_dask_config):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert discover_gpus() == ["0", "1"]
    with LocalLLMCluster(models=["tiny"], dashboard_address="127.0.0.1:0", threads_per_worker=1,
                         engine_options={"kv_cache_tokens": 1024}) as cluster, Client(cluster) as client:
        visible = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(visible.values()) == ["0", "1"]
        names = {w["name"] for w in client.scheduler_info()["workers"].values()}
        assert names == {"0", "1"}
        # vLLM's engine core is a child process: GPU workers must not be daemonic
        assert set(client.run(lambda: multiprocessing.current_process().daemon).values()) == {False}
        with pytest.raises(ValueError, match=r"GPUs \['0', '1'\] are visible"):
            cluster.scale(3)


@pytest.mark.slow  # worker processes
def test_two_workers_share_a_gpu_and_split_its_memory(tiny_model_dir, restore_dask_config):
    with LocalLLMCluster(models=["tiny"], embedders=(), rerankers=(), gpus=["0"], n_workers=2,
                         dashboard_address="127.0.0.1:0", threads_per_worker=1,
                         engine_options={"kv_cache_tokens": 1024}) as cluster, Client(cluster) as client:
        assert cluster.workers_per_gpu == 2
        client.wait_for_workers(2, timeout=120)
        names = {w["name"] for w in client.scheduler_info()["workers"].values()}
        assert names == {"0#0", "0#1"}
        assert set(client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"]).values()) == {"0"}
        shares = client.run(lambda: dask.config.get("daskllm.engine.gpu-memory-utilization"))
        assert sorted(shares.values()) == [0.45, 0.45]
        assert all(m == ["tiny"] for m in resident_models(client).values())
        with pytest.raises(ValueError, match="each group taken by 2 worker"):
            cluster.scale(3)
    with pytest.raises(ValueError, match=r"1 worker\(s\) per 1 GPU\(s\) \(workers_per_gpu="):
        LocalLLMCluster(models=["tiny"], gpus=["0"], workers_per_gpu=1, n_workers=2)


def test_llm_engines_of_a_worker_split_its_gpu_share(monkeypatch):
    """Two LLMs in one worker each take half its gpu-memory-utilization; one takes it whole
    (from the config); embedders and rerankers are not given a share."""
    import importlib

    host_module = importlib.import_module("daskllm.worker.host")

    loaded = {}
    monkeypatch.setattr(EngineSpec, "load", lambda self, **options: loaded.setdefault((self.kind, self.model), options))
    monkeypatch.setattr(EngineSpec, "resolved_backend", lambda self: "torch")
    with dask.config.set({"daskllm.engine.gpu-memory-utilization": 0.8}):
        host_module._load_all(EngineSpec.expand(["tiny", "small"], ["all-MiniLM-L6-v2"], []), {})
        assert loaded[("llm", "tiny")]["gpu_memory_utilization"] == loaded[("llm", "small")]["gpu_memory_utilization"] == 0.4
        assert "gpu_memory_utilization" not in loaded[("embed", "all-MiniLM-L6-v2")]
        loaded.clear()
        host_module._load_all(EngineSpec.expand(["tiny"], [], []), {})
        assert "gpu_memory_utilization" not in loaded[("llm", "tiny")]


@pytest.mark.slow  # worker processes
def test_tensor_parallel_models_get_a_group_of_gpus_per_worker(tiny_model_dir, restore_dask_config):
    with LocalLLMCluster(models=["tiny"], embedders=(), rerankers=(), gpus=["0", "1", "2", "3"], gpus_per_worker=2,
                         dashboard_address="127.0.0.1:0", threads_per_worker=1,
                         engine_options={"kv_cache_tokens": 1024}) as cluster, Client(cluster) as client:
        visible = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(visible.values()) == ["0,1", "2,3"]
        assert all(m == ["tiny"] for m in resident_models(client).values())
    with pytest.raises(ValueError, match="2 GPU"):  # a second worker would have to share: not asked for
        LocalLLMCluster(models=["tiny"], gpus=["0", "1", "2"], gpus_per_worker=2, n_workers=2, workers_per_gpu=1)
    # a spec's tensor_parallel_size sets the group size
    with pytest.raises(ValueError, match="3 GPU"):
        LocalLLMCluster(models=[{"model": "tiny", "options": {"tensor_parallel_size": 3}}], gpus=["0", "1"])


def _max_batch(dask_worker) -> int:
    return dask_worker.plugins["daskllm-engines"].engines["llm"]["tiny"].stats().max_batch_size


def test_tasks_waiting_on_the_engine_release_their_threads(llm_cluster):
    """One worker thread: tasks that hold it send one request at a time; tasks that give it
    back while they wait (release_threads, the default) put several in one engine step."""
    import daskllm
    from daskllm.runtime.control import cold_start

    calls = [daskllm.generate(f"Release test {i}: {'count ' * i}", model="tiny", max_tokens=32, ignore_eos=True)
             for i in range(8)]
    with llm_cluster(n_workers=1, threads_per_worker=1, embedders=(), rerankers=()) as client:
        held = daskllm.compute(*calls, passes=[], granularity="query", result_cache=False, release_threads=False)
        assert max(client.run(_max_batch).values()) == 1
        cold_start(client)
        released = daskllm.compute(*calls, passes=[], granularity="query", result_cache=False)
        assert max(client.run(_max_batch).values()) > 1
    assert released == held


def test_work_submitted_from_a_shared_thread_stays_work_of_its_task():
    """A shared thread runs work of a worker task (``WORK_OF``); what it hands to further
    shared threads is registered under the same task, so cancelling the task aborts it too."""
    from concurrent.futures import ThreadPoolExecutor

    from daskllm.worker.host import WORK_OF
    from daskllm.worker.parts import _InWorker

    with ThreadPoolExecutor(2) as pool:
        def on_shared_thread():
            WORK_OF.set("table-task-1")  # as _in_task sets it for the task's first hand-off
            return _InWorker(pool).submit(WORK_OF.get).result(timeout=30)

        assert pool.submit(on_shared_thread).result(timeout=30) == "table-task-1"


def test_a_sequence_s_room_is_the_context_or_the_kv_cache_where_smaller(tiny_model_dir):
    """What a worker reports as a model's context (a server's prompt check and the output limit
    of a request that sets none): an engine given a cache smaller than the context holds no
    longer sequence, so its cache is the room."""
    from daskllm.worker.host import sequence_room

    with EngineSpec(model=str(tiny_model_dir), name="tiny").load(kv_cache_tokens=1024) as small:
        assert small.max_model_len == 2048 and sequence_room(small) == 1024
        with pytest.raises(Exception, match="KV cache"):  # the engine itself refuses a longer one
            small.generate([[1] * 1000], SamplingParams(max_tokens=100))
    with EngineSpec(model=str(tiny_model_dir), name="tiny").load(kv_cache_tokens=8192) as large:
        assert sequence_room(large) == 2048
