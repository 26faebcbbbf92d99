"""Faults on a real multi-process cluster (issue 19): workers killed with SIGKILL mid-run, a
worker killed again as soon as it rejoins, a nanny that gives up, an index shard's holder
lost. Nothing hangs (every wait has a deadline) and nothing is lost: results equal a run
without the fault, or the error names what was lost and what to do.
"""

from __future__ import annotations

import os
import signal

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from distributed.utils_test import poll_for

import daskllm
import daskllm.dataframe  # noqa: F401 - the ddf.llm accessor
from daskllm.retrieval import ShardedIndex
from daskllm.worker import engine_stats
from daskllm.worker.indexes import IndexShardLost

from test_streaming import _keys, chunks, unstreamed

DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(12)) for i in range(40)]
QUERIES = ["word3 word10", "word17 word4 word21", "document 5"]


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    # A lost worker's slot is checked 2 s after it leaves (Dask's default: 15 s), so the
    # slot check runs while the nanny is still restarting the worker.
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "2s"}), \
            llm_cluster(n_workers=2, threads_per_worker=4) as client:
        yield client


def kill(client, worker: str) -> None:
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)


def running_on(client, keys: set) -> str | None:
    for worker, processing in client.processing().items():
        if keys & set(processing):
            return worker
    return None


@pytest.mark.usefixtures("stream_every_decode")
def test_a_killed_consumer_worker_mid_stream_gives_the_unstreamed_result(client):
    # The rerun consumer never sees the items the dead one took from its queue: it takes
    # them from the decode's result.
    s = daskllm.generate("A long story:", max_tokens=240, ignore_eos=True, split=chunks)
    pipeline = daskllm.collect(daskllm.pmap(s, lambda x: daskllm.generate(daskllm.prompt("Say {x}:", x=x),
                                                                          max_tokens=3)))
    expected = unstreamed(pipeline)
    consumers = {k for k in _keys(pipeline) if k.startswith("pmap-")}
    future = client.compute(pipeline)
    poll_for(lambda: running_on(client, consumers) is not None, timeout=60)
    # Some items are out (their generate tasks exist) before the consumer's worker dies.
    poll_for(lambda: client.run_on_scheduler(
        lambda dask_scheduler: any(str(k).startswith("generate-") for k in dask_scheduler.tasks)), timeout=60)
    kill(client, running_on(client, consumers))
    assert future.result(timeout=180) == expected
    client.wait_for_workers(2, timeout=60)


def test_computing_a_node_again_after_a_worker_loss(client):
    node = daskllm.generate(daskllm.prompt("Question {q}:", q=[f"q{i} " * 20 for i in range(24)]), max_tokens=6)
    expected = daskllm.compute(node, result_cache=False)[0]
    for victim in sorted(client.scheduler_info()["workers"]):
        future = client.compute(node)
        kill(client, victim)
        assert future.result(timeout=120) == expected
        del future
        # Computed again at once, with one worker still away: no task waits for the dead one.
        assert client.compute(node).result(timeout=120) == expected
        stranded = client.run_on_scheduler(lambda dask_scheduler, w: [
            str(k) for k, ts in dask_scheduler.tasks.items() if ts.worker_restrictions and w in ts.worker_restrictions],
            w=victim)
        assert stranded == []
        client.wait_for_workers(2, timeout=60)


def test_a_worker_killed_as_soon_as_it_rejoins_comes_back_every_time(client):
    name = sorted(info["name"] for info in client.scheduler_info()["workers"].values())[0]

    def address():
        return next((a for a, info in client.scheduler_info()["workers"].items() if info["name"] == name), None)

    for _ in range(5):
        victim = address()
        kill(client, victim)
        poll_for(lambda: address() not in (None, victim), timeout=60)  # back, under a new address
    client.wait_for_workers(2, timeout=60)
    assert daskllm.generate("still serving", max_tokens=2).compute()


def test_a_nanny_that_gave_up_is_replaced(client):
    cluster = client.cluster
    name, nanny = sorted(cluster.workers.items())[0]
    before = set(client.scheduler_info()["workers"])
    cluster.sync(nanny.close)  # as a nanny whose restarts failed does
    poll_for(lambda: len(set(client.scheduler_info()["workers"]) - before) == 1
             and len(client.scheduler_info()["workers"]) == 2, timeout=90)
    poll_for(lambda: cluster.workers.get(name) not in (None, nanny), timeout=30)  # the slot holds a new nanny
    assert daskllm.generate("replaced", max_tokens=2).compute()


def test_a_lost_index_shard_comes_back_from_its_saved_copy_or_fails_naming_it(client, tmp_path):
    index = ShardedIndex.from_texts(client, "faults-docs", DOCS, shards=2)
    unsaved = ShardedIndex.from_texts(client, "faults-unsaved", DOCS[:10], shards=2)
    try:
        expected = index.search(QUERIES, k=3)
        node = daskllm.search(index, daskllm.batch(QUERIES), k=3)  # planned for the old placement
        index.save(tmp_path / "index")
        victim = index.workers[0]
        kill(client, victim)
        poll_for(lambda: victim not in client.scheduler_info()["workers"], timeout=30)
        # A graph planned for the dead holder fails at once, naming the shard and what to do.
        with pytest.raises(LookupError, match=r"'faults-docs' shard 0 .*index\.restore\(\)"):
            client.compute(node).result(timeout=60)
        # Without a saved copy: an error naming the lost shard, at once.
        with pytest.raises(IndexShardLost, match=r"'faults-unsaved': shard\(s\) \[0\].*never saved"):
            unsaved.search(QUERIES, k=3)
        # With one: the shard is reloaded on a live worker and the answers are the same.
        assert index.search(QUERIES, k=3) == expected
        assert victim not in index.workers
        assert daskllm.search(index, daskllm.batch(QUERIES), k=3).compute() == expected
    finally:
        index.drop()
        unsaved.drop()
        client.wait_for_workers(2, timeout=60)


def engine_totals(client) -> dict:
    stats = [s["tiny"] for s in client.run(engine_stats).values() if "tiny" in s]
    return {k: sum(s[k] for s in stats) for k in ("decode_tokens", "requests_cancelled", "running", "waiting")}


@pytest.mark.parametrize("how", ["graph", "dataframe"])
def test_cancelling_a_job_stops_its_engine_requests(client, how):
    rows, max_tokens = 96, 800
    texts = [f"row {i}: tell a long story" for i in range(rows)]
    if how == "graph":
        job = daskllm.generate(daskllm.prompt("{x}", x=daskllm.batch(texts)), max_tokens=max_tokens,
                               ignore_eos=True)
        future = client.compute(job)
    else:
        ddf = dd.from_pandas(pd.DataFrame({"x": texts}), npartitions=2)
        job = ddf.llm.map("{x}", out="y", max_tokens=max_tokens, ignore_eos=True)
        future = client.compute(job)
    before = engine_totals(client)
    poll_for(lambda: engine_totals(client)["decode_tokens"] > before["decode_tokens"], timeout=60)  # under way
    future.cancel()
    # The engines drop the job's requests: they go idle with most of its tokens never decoded.
    poll_for(lambda: (t := engine_totals(client))["running"] + t["waiting"] == 0
             and t["requests_cancelled"] > before["requests_cancelled"], timeout=60)
    decoded = engine_totals(client)["decode_tokens"] - before["decode_tokens"]
    assert decoded < rows * max_tokens / 2
    assert daskllm.generate("still serving", max_tokens=2).compute()
