"""Table jobs (daskllm/dataframe/job.py): several ``ddf.llm`` operators added to the same rows are
planned together, each shared prompt prefix computed once across rows, partitions and
operators, with a KV cache far smaller than the job; the answers are those of each operator
computed alone, in the table's row order."""

from __future__ import annotations

import os
import threading

import dask
import dask.dataframe as dd
import pandas as pd
import pytest

import daskllm
import daskllm.dataframe  # noqa: F401 - the ddf.llm accessor
from daskllm.corpus import stdlib_docs
from daskllm.dataframe.accessor import JOB

QUESTIONS = ("What does it return?", "Which arguments does it take?", "Is it deprecated?", "Give one example of its use.")
TEMPLATE = "Documentation of {qualname}:\n{doc}\n\nQuestion: "
KV_CACHE_TOKENS = 4096  # the job's distinct prefix tokens are about 9x this


def shuffled_docs(rows: int = 120, npartitions: int = 4) -> dd.DataFrame:
    """``rows`` stdlib docs of at least 400 characters (cut at 1,200), shuffled (seed 0)."""
    docs = stdlib_docs()
    docs = docs[docs["doc"].str.len() >= 400].sample(n=rows, random_state=0)
    docs = docs.assign(doc=docs["doc"].str.slice(0, 1200))[["qualname", "doc"]].reset_index(drop=True)
    return dd.from_pandas(docs, npartitions=npartitions)


def columns(ddf: dd.DataFrame) -> dd.DataFrame:
    """The four question columns, added one after another: one table job."""
    for i, question in enumerate(QUESTIONS):
        ddf = ddf.llm.map(TEMPLATE + question, model="tiny", max_tokens=4, out=f"a{i}")
    return ddf


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    settings = {"daskllm.engine.kv-cache-tokens": KV_CACHE_TOKENS, "daskllm.metering.prompt-blocks": True,
                "daskllm.result-store.enabled": False}
    with dask.config.set(settings), llm_cluster(n_workers=1, threads_per_worker=4) as client:
        yield client


@pytest.mark.timeout(240)
def test_four_question_columns_compute_each_prefix_once_and_equal_each_column_alone(client):
    ddf = shuffled_docs()
    (job,) = columns(ddf).llm.estimate().jobs  # the preview: each document one group of four calls
    assert (job.calls, job.groups) == (4 * 120, 120)
    with daskllm.usage() as u:
        joint = columns(ddf).compute()
    bound = u.distinct_prompt_tokens
    assert bound > 8 * KV_CACHE_TOKENS  # the job is far larger than the cache
    # Counted three ways: by the preview and from every prompt decoded (the job's), and by the
    # job's group partitions (a short prefix two groups share counts in each partition holding it).
    assert job.bound == bound <= u.prefix_bound <= 1.01 * bound
    assert job.predicted_prefill <= 1.1 * bound
    print(f"prefill computed {u.prefill_tokens_computed} / bound {bound} = {u.prefill_tokens_computed / bound:.3f}")
    assert bound <= u.prefill_tokens_computed <= 1.1 * bound  # the shared prefixes' own prefills counted too
    assert u.executed["prefill"] >= 120 // 8  # each wave's documents computed first (a wave holds a few)
    assert [u.operators["map"][k] for k in ("rows", "distinct", "failed")] == [4 * 120, 4 * 120, 0]
    expected = ddf.compute()
    pd.testing.assert_frame_equal(joint[["qualname", "doc"]], expected)  # the table's rows, in its order
    # Each column alone: four jobs of one operator each (built apart from one frame), computed at once.
    alones = dask.compute(*[ddf.llm.map(TEMPLATE + q, model="tiny", max_tokens=4, out=f"a{i}")
                            for i, q in enumerate(QUESTIONS)])
    for i, (question, alone) in enumerate(zip(QUESTIONS, alones)):
        assert alone[f"a{i}"].tolist() == joint[f"a{i}"].tolist(), question
        assert joint[f"a{i}"].notna().all()


@pytest.mark.timeout(240)
def test_a_map_after_a_filter_joins_its_job_and_runs_only_on_the_rows_it_keeps(client):
    """filter -> map on the same documents: one job, the map's calls conditional on the
    filter's yes, run while the document the two share is in the cache; an operator reading the
    map's output starts a job of its own."""
    ddf = shuffled_docs(rows=24, npartitions=3)
    kept = ddf.llm.filter(TEMPLATE + "Is this about files?", model="tiny")
    mapped = kept.llm.map(TEMPLATE + QUESTIONS[0], model="tiny", max_tokens=4, out="a")
    after = mapped.llm.map("Rephrase: {a}", model="tiny", max_tokens=4, out="b")  # reads the map's answers
    assert [(m.op.name, m.when) for m in getattr(mapped, JOB).members] == [("filter", ()), ("map", (0,))]
    assert [m.op.name for m in getattr(after, JOB).members] == ["map"]  # a job of its own
    with daskllm.usage() as u:
        joint = after.compute()
    alone_kept = ddf.llm.filter(TEMPLATE + "Is this about files?", model="tiny").compute()
    assert 0 < len(alone_kept) < 24  # the filter keeps some rows, not all: the map's calls are conditional
    assert u.operators["filter"]["distinct"] == 24
    assert u.operators["map"]["distinct"] == 2 * len(alone_kept)  # the map (kept rows only), then the rephrasing
    assert u.prefill_tokens_computed <= 1.1 * u.distinct_prompt_tokens
    alone_map = ddf.llm.map(TEMPLATE + QUESTIONS[0], model="tiny", max_tokens=4, out="a").compute()
    assert joint.index.tolist() == alone_kept.index.tolist()
    assert joint["a"].tolist() == alone_map.loc[alone_kept.index, "a"].tolist()
    rephrased = dd.from_pandas(alone_map.loc[alone_kept.index], npartitions=1).llm.map(
        "Rephrase: {a}", model="tiny", max_tokens=4, out="b").compute()
    assert joint["b"].tolist() == rephrased["b"].tolist()


@pytest.mark.timeout(240)
def test_operators_computed_together_from_separate_frames_give_the_same_answers(client):
    """``dask.compute(a, b)`` of two operators on the same frame: two jobs (their calls are not
    grouped with each other), the same answers."""
    ddf = shuffled_docs(rows=12, npartitions=2)
    a = ddf.llm.map(TEMPLATE + QUESTIONS[0], model="tiny", max_tokens=4, out="a")
    b = ddf.llm.map(TEMPLATE + QUESTIONS[1], model="tiny", max_tokens=4, out="b")
    together = dask.compute(a, b)
    assert together[0]["a"].tolist() == a.compute()["a"].tolist()
    assert together[1]["b"].tolist() == columns(ddf).compute()["a1"].tolist()


def test_a_wave_computes_the_deepest_prefixes_its_calls_share_in_whole_blocks():
    """Pure logic: the prefixes a wave computes before its calls (job.Wave.prefixes)."""
    from daskllm.dataframe.job import Wave, TokenGate

    head = [9] * 5  # shared by every prompt: shorter than prefix-min-tokens, not worth a step
    p, q = head + list(range(100, 115)), head + list(range(200, 235))  # 20 and 40 tokens
    deeper = p + [7] * 12  # starts with p: computing it computes p
    prompts = sorted([p + [1, 1], p + [2, 2], deeper + [1], deeper + [2], q + [1], q + [2], q + [3], [5] * 30])
    shared = [0] + [len(os.path.commonprefix([a, b])) for a, b in zip(prompts, prompts[1:])]
    calls = pd.DataFrame({"_daskllm_op": [0] * len(prompts)})
    wave = Wave(calls, prompts, shared, TokenGate(1000, block=4), tokens=0)
    assert wave.prefixes() == [tuple(deeper), tuple(q[:40])]  # whole blocks of 4; p inside deeper
    assert wave.phases() == [list(range(len(prompts)))]  # then every call at once
    assert Wave(calls, None, None, TokenGate(1000, block=4), tokens=0).prefixes() == []  # prompts unknown here


def test_a_gate_lets_a_second_wave_in_only_with_room_and_no_one_waiting():
    from daskllm.dataframe.job import TokenGate

    gate = TokenGate(100)
    first = gate.take(60)
    assert gate.try_take(50) is None  # no room
    second = gate.try_take(40)
    assert second == 40
    gate.give(first)
    waiter = threading.Thread(target=gate.take, args=(100,))
    waiter.start()
    with gate._changed:  # until the other task waits for room
        assert gate._changed.wait_for(lambda: gate._waiting == 1, timeout=30)
    assert gate.try_take(10) is None  # room, but a task waits: it goes first
    gate.give(second)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and gate._used == 100


@pytest.mark.timeout(240)
def test_a_table_without_divisions_is_never_shuffled_to_align_its_columns(client):
    """A parquet dataset's divisions are unknown: the job's columns are assigned partition by
    partition (dask would otherwise shuffle the table on its index once per column: 8
    shuffles for four columns, and 15 s of planning), with the answers of the same table with
    its divisions known."""
    known = shuffled_docs(rows=24, npartitions=3)
    unknown = known.clear_divisions()
    shuffles = [type(e).__name__ for e in columns(unknown).expr.optimize(fuse=False).walk()
                if "Shuffle" in type(e).__name__]
    assert len(shuffles) == 2, shuffles  # the calls grouped by prefix, and their results sent back
    got = columns(unknown).compute()
    pd.testing.assert_frame_equal(got, columns(known).compute())

    def filtered(ddf):  # a filter's mask, and a map on the rows it keeps
        kept = ddf.llm.filter(TEMPLATE + "Is this about files?", model="tiny")
        return kept.llm.map(TEMPLATE + QUESTIONS[0], model="tiny", max_tokens=4, out="a0")
    expected = filtered(known).compute()
    assert 0 < len(expected) < 24
    pd.testing.assert_frame_equal(filtered(unknown).compute(), expected)
