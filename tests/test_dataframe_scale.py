"""The table-wide dedupe plans (``dedupe="auto" | "local" | "global"``) and usage counts that
survive a worker killed mid-job, on a multi-process cluster with the tiny LLM. (The 100,000-row
run is a benchmark: ``bench/dataframe.py --scale 100000``.)"""

from __future__ import annotations

import os
import signal

import dask
import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest
from distributed import wait
from distributed.utils_test import poll_for

import daskllm
import daskllm.dataframe  # noqa: F401 - the ddf.llm accessor

from helpers import cold_start

TEMPLATE = "Say something about {word}:"


def table(rows: int, distinct: int, npartitions: int) -> dd.DataFrame:
    """``rows`` rows cycling through ``distinct`` words: each word in several partitions."""
    words = pd.Series([f"word {i % distinct}" for i in range(rows)], dtype=pd.ArrowDtype(pa.string()))
    return dd.from_pandas(pd.DataFrame({"word": words, "n": range(rows)}), npartitions=npartitions)


def counted(stats: dict) -> dict:
    """An operator's usage: rows, distinct inputs, calls (executed or taken from the result
    store), failed."""
    return {"rows": stats["rows"], "distinct": stats["distinct"], "calls": stats["executed"] + stats["from_cache"],
            "failed": stats["failed"]}


def per_partition_distinct(ddf: dd.DataFrame) -> int:
    return sum(ddf.partitions[i].compute()["word"].nunique() for i in range(ddf.npartitions))


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "2s"}), \
            llm_cluster(n_workers=2, threads_per_worker=4) as client:
        yield client


def test_every_dedupe_plan_gives_the_same_tokens_and_auto_calls_each_distinct_prompt_once(client):
    ddf = table(rows=60, distinct=12, npartitions=4)  # every word in every partition, some twice
    outputs, usages = {}, {}
    for strategy in ("global", "auto", "local"):
        cold_start(client)
        with daskllm.usage() as u:
            outputs[strategy] = ddf.llm.map(TEMPLATE, max_tokens=4, out="said", dedupe=strategy).compute()["said"]
        usages[strategy] = u.operators["map"]
    assert outputs["auto"].tolist() == outputs["global"].tolist() == outputs["local"].tolist()
    assert outputs["auto"].notna().all()
    for strategy in ("global", "auto"):
        assert counted(usages[strategy]) == {"rows": 60, "distinct": 12, "calls": 12, "failed": 0}
    local = per_partition_distinct(ddf)
    assert local > 12 and counted(usages["local"]) == {"rows": 60, "distinct": local, "calls": local, "failed": 0}


def test_auto_dedupe_with_all_distinct_prompts_and_null_rows(client):
    frame = pd.DataFrame({"word": pd.Series([f"w{i}" if i % 5 else None for i in range(40)],
                                            dtype=pd.ArrowDtype(pa.string()))})
    ddf = dd.from_pandas(frame, npartitions=4)
    with daskllm.usage() as u:
        out = ddf.llm.map("Say {word}:", max_tokens=2, out="said", on_error="null").compute()
    expected = ddf.llm.map("Say {word}:", max_tokens=2, out="said", on_error="null", dedupe="global").compute()
    assert out["said"].tolist() == expected["said"].tolist()
    assert u.operators["map"]["rows"] == 40


def test_an_unknown_dedupe_plan_is_refused_naming_the_choices(client):
    with pytest.raises(ValueError, match="dedupe must be one of .*'auto'.*'local'.*'global'"):
        table(rows=4, distinct=2, npartitions=2).llm.map(TEMPLATE, dedupe="hash")


def kill(client, worker: str) -> None:
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)


def running_on(client, prefix: str) -> str | None:
    for worker, processing in client.processing().items():
        if any(str(k).startswith(f"('{prefix}") or str(k).startswith(prefix) for k in processing):
            return worker
    return None


def run_with_a_worker_killed(client, max_tokens: int, disturbed) -> None:
    """450 rows (150 distinct prompts) computed undisturbed, then by ``disturbed(client, job)``
    (which kills a worker on the way): the same outputs, each row and prompt counted once."""
    job = table(rows=450, distinct=150, npartitions=6).llm.map(TEMPLATE, max_tokens=max_tokens, out="said")
    cold_start(client)
    expected = job.compute()["said"].tolist()
    cold_start(client)
    with daskllm.usage() as u:
        out = disturbed(client, job)
    assert out["said"].tolist() == expected
    assert counted(u.operators["map"]) == {"rows": 450, "distinct": 150, "calls": 150, "failed": 0}
    client.wait_for_workers(2, timeout=60)


def test_usage_counts_each_row_once_after_a_worker_is_killed_mid_job(client):
    """Issue 20: 450 rows were reported as 899 distinct after a worker loss (records of tasks
    that ran twice were added up). Each task's record now replaces its earlier attempt's, and
    goes to the scheduler's event log, so a dead worker's records are not lost either."""
    def disturbed(client, job):
        future = client.compute(job)
        victims: list = []
        poll_for(lambda: victims.append(running_on(client, "run_calls")) or victims[-1] is not None, timeout=120)
        kill(client, victims[-1])
        return future.result(timeout=240)

    run_with_a_worker_killed(client, 12, disturbed)


def test_usage_counts_each_row_once_when_lost_results_are_computed_again(client):
    """The double count itself (300 distinct for 150 before the fix): a worker holding finished
    partitions dies, and they (and the calls they were made from, on the other worker too) are
    computed again."""
    def disturbed(client, job):
        persisted = job.persist()
        wait(persisted, timeout=120)
        kill(client, sorted({w for ws in client.who_has(persisted).values() for w in ws})[0])
        return persisted.compute()

    run_with_a_worker_killed(client, 4, disturbed)
