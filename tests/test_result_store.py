"""The persistent result store: content keys, a second run that executes nothing, resuming a
run that was stopped halfway, ``result_cache=False``, ``daskllm cache info/clear``, and search
results that never outlive their index's contents."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import threading
import time
import types

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import daskllm
import daskllm.dataframe
from daskllm.engines import SamplingParams
from daskllm.retrieval import ShardedIndex
from daskllm.worker.store import ResultStore, StoredCompletion, decode_key, embed_key, is_stored, open_store

from helpers import cold_start, daskllm_command

TEMPLATE = "Answer in one line. Q: {q}\nA:"


# --- keys and the store itself (no cluster) ---------------------------------------------------------


def test_a_key_covers_the_model_the_exact_tokens_and_every_sampling_field():
    base = decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=8))
    assert base == decode_key("model-a", (1, 2, 3), SamplingParams(max_tokens=8))
    others = [decode_key("model-b", [1, 2, 3], SamplingParams(max_tokens=8)),
              decode_key("model-a", [1, 2, 3, 4], SamplingParams(max_tokens=8)),
              decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=9)),
              decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=8, stop=("\n",))),
              decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=8, allowed_token_ids=(5, 6))),
              decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.5, seed=1)),
              decode_key("model-a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.5, seed=2))]
    assert len({base, *others}) == 1 + len(others)
    assert embed_key("model-a", "text") != embed_key("model-a", "text ")


def test_a_sampled_call_without_a_seed_has_no_key():
    assert decode_key("m", [1], SamplingParams(temperature=0.7)) is None


def test_model_identity_follows_the_files_and_is_remembered_on_disk(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"layers": 2}')
    (model / "model.safetensors").write_bytes(b"\x00" * 1000)
    store = ResultStore(tmp_path / "store", 10**8)
    first = store.model_identity(model)
    assert ResultStore(tmp_path / "store", 10**8).model_identity(model) == first  # another process: same digest
    (model / "model.safetensors").write_bytes(b"\x01" * 1000)  # new weights, same size
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert store.model_identity(model) != first


def test_contains_answers_without_the_value_and_clear_empties(tmp_path):
    store = ResultStore(tmp_path / "store", 10**8)
    key = decode_key("m", [1, 2], SamplingParams())
    assert not store.contains(key) and store.get(key) is None
    store.put(key, StoredCompletion("hi", (5, 6), "length"))
    assert store.contains(key) and store.get(key) == StoredCompletion("hi", (5, 6), "length")
    assert store.info()["entries"] == 1
    store.clear()
    assert store.info()["entries"] == 0 and not store.contains(key)


def test_the_size_limit_bounds_the_store(tmp_path):
    store = ResultStore(tmp_path / "store", 200_000)
    for i in range(100):
        store.put(f"k{i}", "x" * 10_000)
    store._cache.cull()
    assert store.info()["size_bytes"] <= 200_000 + 64_000  # the limit, plus SQLite's own pages
    assert store.info()["entries"] < 100


def test_switched_off_there_is_no_store(tmp_path):
    with dask.config.set({"daskllm.result-store.enabled": False, "daskllm.result-store.path": str(tmp_path)}):
        assert open_store() is None
        assert not is_stored("tiny", [1, 2], SamplingParams())


def test_daskllm_cache_info_and_clear_through_the_cli(tmp_path):
    store = ResultStore(tmp_path / "store", 10**9)
    for i in range(3):
        store.put(decode_key("m", [i], SamplingParams()), StoredCompletion(str(i), (i,), "length"))
    store.close()

    def cli(*args) -> str:
        with dask.config.set({"daskllm.result-store.path": str(tmp_path / "store")}):
            done = daskllm_command("cache", *args)
        assert done.exit_code == 0, done.output
        return done.stdout

    info = cli("info")
    assert f"location: {tmp_path / 'store'}" in info
    assert "entries: 3" in info and "limit: 4,000,000,000 bytes" in info and "size on disk:" in info
    assert "3 entries removed" in cli("clear")
    assert "entries: 0" in cli("info")


def test_a_retried_tasks_store_hits_count_as_this_runs_when_their_task_started_inside_it():
    from daskllm.ledger import UsageLedger
    from daskllm.worker.usage import USAGE_TOPIC, TaskUsage

    # Three stored calls a dead try of this task computed (its task started at 100), two an
    # earlier run did (started at 50): a usage block from 90 counts three as its own.
    record = TaskUsage("decode", time=120.0, calls=1, from_cache=5,
                       from_store=((50.0, 2, 40, 30, 8), (100.0, 3, 60, 0, 12)))
    assert record.stored_since(90.0).calls == 3 and record.stored_since(90.0).computed_tokens == 60
    assert record.stored_since(90.0).decode_tokens == 12 and record.stored_since(40.0).calls == 5
    assert record.stored_since(101.0).calls == 0
    travelled = dataclasses.asdict(record)
    assert TaskUsage.from_event(json.loads(json.dumps(travelled))) == record  # lists back to tuples
    ledger = UsageLedger(limit=2)
    ledger.log_event(USAGE_TOPIC, {"key": "decode-a", "usage": travelled})
    ledger.log_event(USAGE_TOPIC, {"key": "decode-a", "usage": {**travelled, "time": 110.0}})  # an older try: kept out
    ledger.log_event(USAGE_TOPIC, {"key": "bad"})  # malformed: ignored, never raised
    ledger.log_event("other-topic", {"key": "x", "usage": travelled})
    assert ledger.find(["decode-a", "x"]) == {"decode-a": travelled}
    for key in ("b", "c"):
        ledger.log_event(USAGE_TOPIC, {"key": key, "usage": {**travelled, "op": "dataframe", "time": 130.0}})
    assert set(ledger.records) == {"b", "c"}  # bounded: the oldest go first
    assert set(ledger.find(since=125.0, op="dataframe")) == {"b", "c"} and ledger.find(since=131.0) == {}


# --- on a cluster --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("result-store")


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir, store_path):
    """Workers with the store switched on (the test session switches it off elsewhere)."""
    settings = {"daskllm.result-store.enabled": True, "daskllm.result-store.path": str(store_path)}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DASK_DASKLLM__RESULT_STORE__ENABLED", "True")
        monkeypatch.setenv("DASK_DASKLLM__RESULT_STORE__PATH", str(store_path))
        with dask.config.set(settings), llm_cluster(n_workers=2, threads_per_worker=2) as client:
            yield client


@pytest.fixture(autouse=True)
def empty_store(request, store_path):
    if "client" in request.fixturenames:
        cold_start(request.getfixturevalue("client"))
        ResultStore(store_path, 10**9).clear()


def questions(n: int, tag: str) -> list[str]:
    return [f"{tag} question number {i}: what is {i} plus {i}?" for i in range(n)]


def table(qs: list[str], npartitions: int) -> dd.DataFrame:
    return dd.from_pandas(pd.DataFrame({"q": qs}), npartitions=npartitions)


def naive(qs: list[str], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    """The same prompts as one plain graph, with no result caching at all."""
    p = daskllm.chat([{"role": "user", "content": TEMPLATE}], q=daskllm.batch(qs))
    return daskllm.compute(daskllm.generate(p, max_tokens=max_tokens, ignore_eos=ignore_eos), result_cache=False)[0]


def test_a_second_run_of_a_table_job_executes_no_call(client):
    qs = questions(12, "rerun")
    with daskllm.usage() as first:
        a = table(qs, 3).llm.map(TEMPLATE, max_tokens=6).compute()
    assert first.executed["generate"] == 12 and first.operators["map"]["from_cache"] == 0
    with daskllm.usage() as second:
        b = table(qs, 3).llm.map(TEMPLATE, max_tokens=6).compute()
    assert second.executed.get("generate", 0) == 0 and second.from_cache["generate"] == 12
    assert second.operators["map"]["executed"] == 0 and second.operators["map"]["from_cache"] == 12
    assert second.decode_tokens == 0 and second.prefill_tokens_computed == 0
    assert second.executed.get("prefill", 0) == 0
    pd.testing.assert_frame_equal(a, b)
    assert b["llm_output"].tolist() == naive(qs, 6)  # token for token what the uncached calls give


def test_a_rerun_computes_no_token_twenty_times_in_twenty(client):
    """Each pair: a job on fresh rows whose prompts share a prefix long enough for a prefill
    task (so the first run has one to skip), then the same job again: the second computes no
    token at all, prefills included. The pairs run in one cluster, so the second run of each
    is planned by worker processes that planned the first (a remembered plan must not bring
    its prefills back)."""
    template = ("Instructions: describe the following thing in a few plain words, briefly and without any "
                "preamble. Thing: {text}")
    for pair in range(20):
        rows = pd.DataFrame({"text": [f"a cat {pair}", None, f"a dog {pair}", f"a cat {pair}", f"bird {pair}",
                                      f"fish {pair}"]})

        def run():
            # dedupe="local": each partition's calls planned together, so their shared prefix gets
            # a prefill task (a table job's waves compute it with their first call instead).
            job = dd.from_pandas(rows, npartitions=2).llm.map(template, model="tiny", max_tokens=4, out="d",
                                                              on_error="null", dedupe="local")
            with daskllm.usage() as used:
                out = job.compute()
            return out, used

        first_out, first = run()
        assert first.executed["prefill"] > 0 and first.decode_tokens > 0, f"pair {pair}: {first}"
        again_out, again = run()
        assert (again.prefill_tokens_computed, again.decode_tokens) == (0, 0), f"pair {pair}: {again}"
        assert again.executed.get("prefill", 0) == again.executed.get("generate", 0) == 0, f"pair {pair}"
        pd.testing.assert_frame_equal(first_out, again_out)


def test_embeddings_come_from_the_store_on_a_second_run(client):
    qs = questions(10, "embed")
    first = table(qs, 2).llm.embed("q").compute()
    with daskllm.usage() as u:
        second = table(qs, 2).llm.embed("q").compute()
    assert u.executed.get("embed", 0) == 0 and u.from_cache["embed"] == 10
    assert u.operators["embed"]["executed"] == 0 and u.operators["embed"]["from_cache"] == 10
    # Arrow fixed-size lists: each cell comes back as a list or an array, compared as arrays.
    assert all(np.array_equal(a, b)  # not-bits: the second run reads the first one's values back from the store
               for a, b in zip(first["q_embedding"], second["q_embedding"]))


def test_a_run_stopped_halfway_resumes_with_what_it_had_finished(client, store_path):
    qs = questions(48, "resume")
    job = table(qs, 6).llm.map(TEMPLATE, max_tokens=24)
    future = client.compute(job)
    store = ResultStore(store_path, 10**9)
    deadline = time.monotonic() + 120
    while store.info()["entries"] < 3:  # some calls have finished (and been written): stop the run
        assert time.monotonic() < deadline, "no call finished within 120 s"
        time.sleep(0.05)
    client.cancel([future])
    # The stopped run's partition tasks wind down (their nested calls are cancelled) before the
    # next run starts, so its usage block counts only the next run.
    deadline = time.monotonic() + 120
    while any(client.run(lambda dask_worker: len(dask_worker.state.tasks)).values()):
        assert time.monotonic() < deadline, "the stopped run's tasks were still on the workers after 120 s"
        time.sleep(0.05)
    finished = store.info()["entries"]
    with daskllm.usage() as u:
        out = table(qs, 6).llm.map(TEMPLATE, max_tokens=24).compute()
    stats = u.operators["map"]
    assert stats["from_cache"] >= finished and stats["executed"] == 48 - stats["from_cache"] < 48
    assert u.executed.get("generate", 0) == stats["executed"]
    assert out["llm_output"].tolist() == naive(qs, 24)


def test_a_worker_killed_mid_job_leaves_exact_answers_and_counts_and_a_store_for_a_rerun(client, store_path):
    """SIGKILL a worker once calls have been stored (a process dying between writes), under the
    progress bar: the job still finishes (Dask reruns the lost partitions, reading what was
    stored) with every answer an uncached run's; the bar never moves back and ends at every
    call; usage counts every call as executed in this run, the dead worker's included, with
    their tokens; and a rerun executes nothing."""
    qs = questions(40, "killed")
    store = ResultStore(store_path, 10**9)
    killed = {}

    def kill_once_calls_are_stored():
        deadline = time.monotonic() + 120
        while store.info()["entries"] < 8:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        # Both workers, asked of the scheduler itself (the client's cached view can lag a restart).
        client.wait_for_workers(2, timeout=120)
        victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        killed["at"] = store.info()["entries"]

    killer = threading.Thread(target=kill_once_calls_are_stored, daemon=True)
    bar = io.StringIO()
    with daskllm.usage() as u:
        killer.start()
        out = daskllm.dataframe.progress(table(qs, 4).llm.map(TEMPLATE, max_tokens=24, ignore_eos=True),
                                         file=bar, interval=0.1).compute()
    killer.join(240)
    assert "at" in killed, "no call was stored within 120 s, or the kill never happened"
    assert out["llm_output"].tolist() == naive(qs, 24, ignore_eos=True)
    frames = [tuple(map(int, m)) for m in re.findall(r"(\d+)/(\d+) \[", bar.getvalue())]
    counts, totals = [n for n, _ in frames], [t for _, t in frames]
    assert counts == sorted(counts) and totals == sorted(totals), frames
    assert frames[-1] == (40, 40) and "calls=40" in bar.getvalue().strip().splitlines()[-1][-200:]
    assert u.executed["generate"] == 40 and not u.from_cache.get("generate"), u
    assert u.operators["map"]["executed"] == 40 and u.operators["map"]["from_cache"] == 0, u
    assert u.decode_tokens == 40 * 24, u
    client.wait_for_workers(2, timeout=120)
    cold_start(client)  # the scheduler forgets the finished job, so the rerun computes it again
    with daskllm.usage() as u:
        again = table(qs, 4).llm.map(TEMPLATE, max_tokens=24, ignore_eos=True).compute()
    assert u.operators["map"]["executed"] == 0 and u.operators["map"]["from_cache"] == 40
    assert u.decode_tokens == 0 and u.prefill_tokens_computed == 0
    pd.testing.assert_frame_equal(out, again)


def test_result_cache_false_neither_reads_nor_writes_the_store(client, store_path):
    node = daskllm.generate(daskllm.prompt("Say {x}", x=daskllm.batch(["one", "two", "three"])), max_tokens=5)
    with daskllm.usage() as u:
        expected = daskllm.compute(node, result_cache=False)[0]
    assert u.executed["generate"] == 3 and ResultStore(store_path, 10**9).info()["entries"] == 0
    daskllm.compute(node)  # stores them
    cold_start(client)  # the client's in-memory cache forgets: only the store can answer now
    with daskllm.usage() as u:
        assert daskllm.compute(node, result_cache=False)[0] == expected
    assert u.executed["generate"] == 3
    with daskllm.usage() as u:
        assert daskllm.compute(node)[0] == expected
    assert u.executed.get("generate", 0) == 0 and u.from_cache["generate"] == 3


def test_a_call_kept_out_of_the_result_cache_is_kept_out_of_the_store(client, store_path):
    node = daskllm.generate(daskllm.prompt("Spell {x}", x=daskllm.batch(["cat", "dog"])), max_tokens=4, cache=False)
    daskllm.compute(node)
    assert ResultStore(store_path, 10**9).info()["entries"] == 0
    with daskllm.usage() as u:
        daskllm.compute(node)
    assert u.executed["generate"] == 2 and not u.from_cache.get("generate")


def test_a_dropped_index_never_answers_from_remembered_results(client):
    index = ShardedIndex.create(client, "dropped").ingest(["apples are red", "the sky is blue", "grass is green"])
    before = index.version
    assert daskllm.compute(daskllm.search(index, daskllm.batch(["what colour is the sky?"]), k=1))[0][0][0].id == 1
    index.drop()
    assert index.version != before
    with pytest.raises(Exception, match=r"index 'dropped' shard \d+ is not on worker"):  # it searches the cluster, where the index is gone
        daskllm.compute(daskllm.search(index, daskllm.batch(["what colour is the sky?"]), k=1))


def test_engines_with_other_numerics_never_answer_for_each_other(tmp_path, tiny_model_dir):
    store = ResultStore(tmp_path / "store", 10**8)

    class Engine:  # what the key reads of an engine: its model directory and its numerics
        def __init__(self, dtype, device):
            self.path, self.model = tiny_model_dir, types.SimpleNamespace(dtype=dtype, device=device)

    cpu, gpu = store.engine_identity(Engine("float32", "cpu")), store.engine_identity(Engine("bfloat16", "cuda:0"))
    assert cpu != gpu and cpu.split("|")[0] == gpu.split("|")[0]  # same files, other numerics
    assert store.engine_identity(Engine("float32", "cpu")) == cpu
    sampling = SamplingParams(max_tokens=4)
    store.put(decode_key(gpu, [1, 2], sampling), StoredCompletion("hi", (5,), "length"))
    assert store.get(decode_key(cpu, [1, 2], sampling)) is None
    # A cost preview does not know which engine will run a call: any engine's stored result counts.
    assert is_stored(str(tiny_model_dir), [1, 2], sampling, store)
    assert not is_stored(str(tiny_model_dir), [1, 3], sampling, store)
    assert store.info()["entries"] == 1  # the remembered numerics are not results
