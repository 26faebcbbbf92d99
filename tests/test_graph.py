"""The LLM task graph: builders, rewrite passes, lowering, exactness, usage, on a multi-process cluster."""

from __future__ import annotations

import dataclasses
import itertools
import shutil

import dask
import numpy as np
import pytest
from distributed import get_task_stream

import daskllm
from daskllm.runtime.submit import plan as lowered
from daskllm.worker.results import RESULTS
from daskllm.retrieval import ShardedIndex
from helpers import cold_start, set_policy

SYSTEM_A = ("You are a senior Python engineer. Answer questions about the standard library in one sentence, "
            "naming the module and the function to use, and one pitfall a newcomer is likely to hit. ") * 2
SYSTEM_B = ("You are a strict code reviewer. For each question, say whether the approach is idiomatic and "
            "why, in at most two sentences, citing the relevant PEP when there is one. ") * 2
QUESTIONS = [f"How would I {verb} a {noun} with the standard library, variant {i}?"
             for i, (verb, noun) in enumerate([("parse", "date"), ("read", "CSV file"), ("hash", "file"),
                                               ("zip", "folder"), ("walk", "directory tree"), ("time", "function"),
                                               ("sort", "list of dicts"), ("merge", "sorted iterables")])]
NAIVE = {"passes": [], "granularity": "query", "result_cache": False}


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir, stdlib_corpus):
    with llm_cluster(n_workers=2, threads_per_worker=6, engine_options={"kv_cache_tokens": 8192}) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh_result_cache():
    RESULTS.clear()
    yield
    RESULTS.clear()


def chain_and_fan(questions):
    """Shared prefixes, fan-out (two prompts per question), a chain, and fan-in (one summary of all)."""
    first = daskllm.generate(daskllm.prompt(SYSTEM_A + "Question: {q}\nAnswer:", q=questions), max_tokens=6)
    review = daskllm.generate(daskllm.prompt(SYSTEM_B + "Question: {q}\nAnswer: {a}\nReview:", q=questions, a=first),
                              max_tokens=6)
    summary = daskllm.generate(daskllm.prompt("Summarize these reviews:\n{r}\nSummary:", r=daskllm.gather(review)),
                               max_tokens=8)
    return first, review, summary


@pytest.mark.bits
def test_optimized_and_naive_runs_return_identical_tokens(client):
    nodes = chain_and_fan(QUESTIONS + QUESTIONS[:3])  # with duplicates
    optimized = daskllm.compute(*nodes)
    naive = daskllm.compute(*nodes, **NAIVE)
    assert optimized == naive
    first, review, summary = optimized
    assert len(first) == len(review) == len(QUESTIONS) + 3 and isinstance(summary, str)
    assert first[:3] == first[-3:]  # duplicate calls, same answers


def test_visualize_shows_the_lowered_task_types(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("dask.visualize needs Graphviz's `dot` (Debian package graphviz; .ci/run installs it)")
    node = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}\nA:", q=QUESTIONS[:3]), max_tokens=4)
    with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):  # staged tasks, even this small
        dask.visualize(node, filename=str(tmp_path / "graph.svg"), optimize_graph=True)
    svg = (tmp_path / "graph.svg").read_text()
    assert ">decode" in svg and ">prefill" in svg  # the lowered task types, not one opaque node


def test_the_collection_protocol(client):
    node = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}\nA:", q=QUESTIONS[:3]), max_tokens=4)
    expected = node.compute()
    assert dask.compute(node)[0] == expected
    assert client.compute(node).result() == expected
    persisted = dask.persist(node)[0]
    assert persisted.compute() == expected
    downstream = daskllm.generate(daskllm.prompt("Rewrite: {x}", x=persisted), max_tokens=3)
    assert len(downstream.compute()) == 3

    @dask.delayed
    def shout(texts):
        return [t.upper() for t in texts]

    assert shout(node).compute() == [t.upper() for t in expected]  # a delayed function takes a node
    topic = dask.delayed(str.lower)("JSON FILES")  # a node takes a delayed value
    scalar = daskllm.generate(daskllm.prompt("Topic: ", topic, "\nSummary:"), max_tokens=4)
    literal = daskllm.generate(daskllm.prompt("Topic: {t}\nSummary:", t="json files"), max_tokens=4)
    assert scalar.compute() == literal.compute()


def test_cse_merges_exactly_identical_deterministic_calls():
    qs = QUESTIONS[:4] + QUESTIONS[:2]
    greedy = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}", q=qs), max_tokens=4)
    again = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}", q=qs[:2]), max_tokens=4)  # built separately
    other_params = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}", q=qs[:2]), max_tokens=5)
    seeded = daskllm.generate(daskllm.prompt("Q: {q}", q=[qs[0]] * 3), max_tokens=4, temperature=0.7, seed=1)
    sampled = daskllm.generate(daskllm.prompt("Q: {q}", q=[qs[0]] * 3), max_tokens=4, temperature=0.7)
    report = lowered([greedy, again, other_params, seeded, sampled]).report
    # greedy: 4 distinct of 6 (+2 from `again`, all duplicates); other_params: 2 new; seeded: 1; sampled: 3
    assert report["cse"] == {"calls": 6 + 2 + 2 + 3 + 3, "distinct": 4 + 2 + 1 + 3, "merged": 2 + 2 + 2}
    assert report["tasks"]["decode"] >= 1
    assert again.key != greedy.key and daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}", q=qs[:2]),
                                                           max_tokens=4).key == again.key


@pytest.fixture(scope="module")
def fresh_client(llm_cluster, tiny_model_dir):
    """A cluster of its own: the measurement starts from engines no other test has used."""
    with llm_cluster(n_workers=2, threads_per_worker=6, embedders=(), rerankers=(),
                     engine_options={"kv_cache_tokens": 8192}, set_as_default=False) as client:
        yield client


def test_prefill_work_is_near_the_lower_bound_with_passes_on(fresh_client):
    # Staged tasks (not parts, as 24 calls would be): the prefix pass's prefill tasks.
    with fresh_client.as_current(), dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):
        _prefill_ratio_check(fresh_client)


def _prefill_ratio_check(client):
    questions = [q + " Please be specific about edge cases, error handling and performance." for q in QUESTIONS]
    calls = [daskllm.generate(daskllm.prompt(system + "Question: {q}\nAnswer:", q=questions + questions[:4]),
                              max_tokens=4) for system in (SYSTEM_A, SYSTEM_B)]
    report = lowered(calls).report
    # One engine could prefill each shared prefix once; with the batch spread over both
    # workers, each holds a copy of the prefixes it serves (the replicas' tokens).
    lower = report["prefill_lower_bound"]
    bound = lower + report["prefill_replica_tokens"]
    cold_start(client)  # earlier tests used these system prompts: start cold
    with daskllm.usage() as on:
        optimized = daskllm.compute(*calls)
    cold_start(client)
    set_policy(client, "off")  # the naive baseline: plain Dask placement too
    try:
        with daskllm.usage() as off:
            naive = daskllm.compute(*calls, **NAIVE)
    finally:
        set_policy(client, "cache_aware")
    assert optimized == naive
    assert on.requested["generate"] == off.requested["generate"] == 2 * (len(QUESTIONS) + 4)
    assert on.executed["generate"] == 2 * len(QUESTIONS)  # duplicates ran once
    assert off.executed["generate"] == 2 * (len(QUESTIONS) + 4)
    assert on.prefill_tokens_computed / bound <= 1.1
    # Off, the engine's own prefix cache still catches some reuse (measured 1.6-1.7 here).
    assert off.prefill_tokens_computed / lower > 1.4


def test_partial_prefill_runs_beside_the_retrieval_it_waits_for(client, stdlib_corpus):
    from daskllm.corpus import stdlib_docs

    docs = stdlib_docs(limit=300)
    index = ShardedIndex.from_texts(client, "graph-test", docs.doc.str.slice(0, 200).tolist())
    try:
        questions = ["How do I read a JSON document?", "How do I compile a regular expression?"]
        context = daskllm.search(index, questions, k=2)
        answer = daskllm.generate(daskllm.prompt(SYSTEM_A + "Question: {q}\nContext: {ctx}\nAnswer:", q=questions,
                                                 ctx=context), max_tokens=4)
        report = lowered([answer]).report
        assert report["prefix"]["partial"] >= 1
        with get_task_stream(client) as stream:
            optimized = answer.compute()
        starts = {t["key"]: t["startstops"][0]["start"] for t in stream.data}
        ends = {t["key"]: t["startstops"][-1]["stop"] for t in stream.data}
        prefill_start = min(v for k, v in starts.items() if k.startswith("prefill-"))
        retrieval_end = max(v for k, v in ends.items() if k.startswith(("search-", "embed-")))
        assert prefill_start < retrieval_end
        assert optimized == daskllm.compute(answer, **NAIVE)[0]
    finally:
        index.drop()


class FakeStore:
    """A result store's answers for the planner (a ``StoredLookup``): the prompts it holds,
    and how many it was asked about. Each has a version of its own (plans are remembered by it)."""

    versions = itertools.count(1)

    def __init__(self, held=()):
        self.held, self.asked, self.version = set(held), 0, next(self.versions)

    def stored(self, model, sampling, prompts):
        for ids in prompts:
            self.asked += 1
            yield tuple(ids) in self.held


def test_no_prefill_is_made_for_calls_the_result_store_answers():
    from daskllm.plan.context import LOCAL
    from daskllm.plan.items import items
    from daskllm.plan.planner import build
    from daskllm.runtime.submit import current_options, plan

    questions = [f"How do I do thing {i}?" for i in range(6)]
    node = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}\nA:", q=questions), max_tokens=4)
    prompts = [item.known for item in items(build([node], current_options(), LOCAL), node)]
    options = current_options()
    with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):  # staged tasks: the prefix pass runs
        empty = FakeStore()
        report = plan([node], dataclasses.replace(options, stored=empty), LOCAL).report["prefix"]
        assert (report["shared"], report["answered_by_store"]) == (1, 0)
        assert empty.asked == 1  # a first run: it stops at the first call it must run
        all_stored = FakeStore(prompts)
        lowered_all = plan([node], dataclasses.replace(options, stored=all_stored), LOCAL)
        assert (lowered_all.report["prefix"]["prefills"], lowered_all.report["prefix"]["answered_by_store"]) == (0, 1)
        assert "prefill" not in lowered_all.report["tasks"] and all_stored.asked == len(questions)
        one_left = FakeStore(prompts[1:])  # one call must still run: its prefill stays
        assert plan([node], dataclasses.replace(options, stored=one_left), LOCAL).report["prefix"]["shared"] == 1
        # The store's version is part of the plan-cache key: once it changes, the plan is made again.
        empty.held, empty.version = set(prompts), next(FakeStore.versions)
        assert plan([node], dataclasses.replace(options, stored=empty), LOCAL).report["prefix"]["prefills"] == 0


def test_granularity_bounds_task_counts():
    node = [f"question {i}" for i in range(2000)]
    for step in range(3):
        node = daskllm.generate(daskllm.prompt(f"Step {step}, refine: {{x}}", x=node), max_tokens=2)
    sharded = lowered([node]).report["tasks"]
    assert sharded["decode"] == 3 * -(-2000 // 32)  # (operator, query shard) tasks
    with dask.config.set({"daskllm.rewrite.granularity": "query"}):
        per_query = lowered([node]).report["tasks"]
    assert per_query["decode"] == 3 * 2000
    with dask.config.set({"daskllm.rewrite.passes": ["cse"]}):
        one_stage = lowered([node]).report["tasks"]
    assert one_stage["decode"] == 3


def test_small_nodes_of_one_depth_share_tasks():
    """Per-query nodes (as a pmap's items make them) are consolidated: their calls share
    decode tasks by depth, model and sampling; a node never shares a task with one it needs."""
    first = [daskllm.generate(f"Leaf {i}: {{x}}".replace("{x}", "x" * i), max_tokens=2) for i in range(40)]
    second = [daskllm.generate(daskllm.prompt("Root: {a}", a=leaf), max_tokens=2) for leaf in first]
    other = [daskllm.generate(f"Other {i}", max_tokens=3) for i in range(5)]  # other sampling: apart
    from daskllm.plan.context import LOCAL
    from daskllm.runtime.submit import plan

    report = plan(second + other, view=LOCAL).report  # one engine: shards of the full stage size
    assert report["stage"]["nodes_fused"] == 85
    assert report["tasks"]["decode"] == 2 + 2 + 1  # 40 leaves in shards of 32, 40 roots likewise, 5 others
    with dask.config.set({"daskllm.rewrite.passes": ["cse", "prefix"]}):
        assert plan(second + other, view=LOCAL).report["tasks"]["decode"] == 85


def _double(x):
    return 2 * x


def test_small_pmaps_built_by_the_same_code_share_a_consumer():
    from daskllm.plan.context import LOCAL
    from daskllm.runtime.submit import plan

    nodes = [daskllm.pmap([i, i + 1], _double) for i in range(10)]
    assert plan(nodes, view=LOCAL).report["tasks"]["pmap"] == 1
    with dask.config.set({"daskllm.rewrite.passes": ["cse"]}):
        assert plan(nodes, view=LOCAL).report["tasks"]["pmap"] == 10
    assert list(daskllm.compute(*nodes)) == [[2 * i, 2 * i + 2] for i in range(10)]


def _verify(claim):
    return daskllm.generate(daskllm.prompt("Check: {c}", c=claim), max_tokens=2)


def test_only_decodes_long_enough_to_pay_are_streamed():
    """The pipeline pass streams a split decode expected to take stream-min-seconds or more
    (its max_tokens at the view's seconds per step); unmeasured, it streams."""
    from daskllm.plan.context import ClusterView
    from daskllm.runtime.submit import plan

    holders = ((("llm", "tiny"), 2),)
    pmap = lambda max_tokens: daskllm.pmap(daskllm.generate("Claims:", model="tiny", max_tokens=max_tokens,
                                                            split=daskllm.words(2)), _verify)
    measured = ClusterView(on_cluster=True, holders=holders, reporting=2, step_seconds=(("tiny", 0.01),))
    report = lambda node, view: plan([node], view=view).report["pipeline"]
    assert report(pmap(8), measured) == {"pmaps_fused": 0, "streamed": 0, "short_decodes": 1}  # 0.08 s
    assert report(pmap(64), measured) == {"pmaps_fused": 0, "streamed": 1, "short_decodes": 0}  # 0.64 s
    unmeasured = ClusterView(on_cluster=True, holders=holders, reporting=2)
    assert report(pmap(8), unmeasured)["streamed"] == 1
    with dask.config.set({"daskllm.rewrite.stream-min-seconds": 0.05}):
        assert report(pmap(8), measured)["streamed"] == 1


def test_per_item_streams_share_decode_and_consumer_tasks():
    """Per-item split generates (as a pmap's items make them) share decode tasks, and their
    streamed pmaps one consumer per decode task: not a task each."""
    from daskllm.plan.context import ClusterView
    from daskllm.runtime.submit import plan

    view = ClusterView(on_cluster=True, holders=((("llm", "tiny"), 2),), reporting=2)
    streams = [daskllm.generate(f"Claims about {i}:", model="tiny", max_tokens=8, split=daskllm.words(2))
               for i in range(12)]
    nodes = [daskllm.pmap(s, _verify) for s in streams]
    lowered = plan(nodes, view=view)
    assert lowered.report["pipeline"]["streamed"] == 12
    assert lowered.report["stage"]["nodes_fused"] == 24
    layer = lambda op: next(v for k, v in lowered.graph.layers.items() if k.startswith(f"daskllm-{op}-"))
    decodes = list(layer("decode").values())
    consumers = [t for k, t in layer("pmap").items() if not k.startswith("stream-")]
    assert len(decodes) == 2  # 12 calls over 2 workers holding the model
    assert len(consumers) == len(decodes)  # one consumer reads each decode task's streams
    for task in consumers:  # and reads every position of it, each once
        source, calls = task.args[2], task.args[3]
        assert sorted(source.positions) == list(range(len(calls))) and len(calls) == 6
    with dask.config.set({"daskllm.rewrite.passes": ["cse", "pipeline"]}):  # no stage pass: one each
        alone = plan(nodes, view=view).report["tasks"]
        assert alone["decode"] == 12 and alone["pmap"] == 2 * 12  # a consumer and its join per stream


def test_per_item_searches_embeds_and_reranks_share_tasks():
    """Per-item search, embed and rerank nodes of one depth (one index, one model) are
    consolidated like generates: a few tasks, not one to four per item."""
    from daskllm.plan.context import ClusterView
    from daskllm.retrieval import ShardedIndex
    from daskllm.runtime.submit import plan

    index = ShardedIndex(None, "docs", {"dim": 384}, ["tcp://a:1", "tcp://b:1"], sizes=[5, 5])
    view = ClusterView(on_cluster=True, holders=((("embed", "all-MiniLM-L6-v2"), 2), (("rerank", "all-MiniLM-L6-v2"), 2)),
                       reporting=2)
    items = [f"claim {i}" for i in range(20)]
    nodes = [daskllm.search(index, q, k=2) for q in items]  # each embeds its query, then searches
    nodes += [daskllm.rerank(q, [f"doc {q}", "other doc"], k=1) for q in items]
    tasks = plan(nodes, view=view).report["tasks"]
    assert tasks["search"] == 2 and tasks["merge"] == 1  # one shard of 20 queries: a task per index shard
    assert tasks["rerank"] == 2 and tasks["embed"] <= 2  # a shard per worker holding the model
    with dask.config.set({"daskllm.rewrite.passes": ["cse"]}):
        alone = plan(nodes, view=view).report["tasks"]
        assert alone["search"] == 40 and alone["embed"] == 20 and alone["rerank"] == 20


def test_usage_and_the_result_cache(client):
    node = daskllm.generate(daskllm.prompt(SYSTEM_A + "Q: {q}\nA:", q=QUESTIONS[:4]), max_tokens=5)
    with daskllm.usage() as first:
        a = node.compute()
    with daskllm.usage() as second:
        b = node.compute()
    assert a == b
    assert first.executed["generate"] == 4 and first.decode_tokens > 0
    assert second.requested["generate"] == 4 and second.executed.get("generate", 0) == 0
    assert daskllm.compute(node, result_cache=False)[0] == a


def test_embed_search_rerank_nodes(client):
    docs = ["json.load reads JSON from a file", "csv.reader reads CSV rows", "re.compile builds a regex"]
    index = ShardedIndex.from_texts(client, "graph-small", docs)
    try:
        hits = daskllm.search(index, ["read a JSON file", "regular expression"], k=2).compute()
        assert [h[0].text for h in hits] == [docs[0], docs[2]]
        best = daskllm.rerank("read a JSON file", docs, k=1).compute()
        assert best == [docs[0]]
        vectors = daskllm.embed(["a", "b"]).compute()
        assert np.asarray(vectors).shape == (2, 384)
        chained = daskllm.rerank(["read a JSON file", "regex"], daskllm.search(index, ["read a JSON file", "regex"],
                                                                                 k=3), k=1).compute()
        assert chained == [[docs[0]], [docs[2]]]
    finally:
        index.drop()


def test_a_bad_item_fails_alone_named_by_its_index_in_the_batch(client):
    """on_error="raise" names the item's index in the user's list (not its place in a task) and
    why; on_error="null" makes that item None and returns the others as they would be alone."""
    long, bad = "word " * 5000, "\ud800 lone surrogate"
    items = QUESTIONS[:6] + [long] + QUESTIONS[6:]

    def answers(questions, **options):
        return daskllm.generate(daskllm.prompt("Q: {q}\nA:", q=questions), max_tokens=4, **options)

    for settings in ({}, {"granularity": "query"}):  # shards of several calls, and one task per call
        with pytest.raises(daskllm.CallError, match=r"^generate item 6: prompt has 50\d\d tokens; model 'tiny'"):
            daskllm.compute(answers(items), **settings)
    alone = answers(QUESTIONS).compute()
    assert answers(items, on_error="null").compute() == alone[:6] + [None] + alone[6:]
    with pytest.raises(daskllm.CallError, match=r"^generate item 2: text is not valid Unicode: '\\ud800'"):
        answers(QUESTIONS[:2] + [bad]).compute()

    vectors = daskllm.embed(["csv", bad, "json"], on_error="null").compute()
    assert vectors[1] is None and np.allclose(np.stack([vectors[0], vectors[2]]),
                                              np.stack(daskllm.embed(["csv", "json"]).compute()))
    with pytest.raises(daskllm.CallError, match=r"^embed item 1: text is not valid Unicode"):
        daskllm.embed(["csv", bad]).compute()

    # A null item's consumers: null too, or an error naming their own item.
    first = answers(items, on_error="null")
    assert [v is None for v in daskllm.embed(first, on_error="null").compute()] == [i == 6 for i in range(9)]
    with pytest.raises(daskllm.CallError, match=r"^embed item 6: its input is null \(an upstream call failed\)"):
        daskllm.embed(first).compute()

    docs = ["json.load reads JSON from a file", "csv.reader reads CSV rows", "re.compile builds a regex"]
    index = ShardedIndex.from_texts(client, "graph-errors", docs)
    try:
        hits = daskllm.search(index, ["read a JSON file", bad, "regular expression"], k=2, on_error="null").compute()
        assert hits[1] is None and [h[0].text for h in (hits[0], hits[2])] == [docs[0], docs[2]]
        with pytest.raises(daskllm.CallError, match=r"^embed item 1: text is not valid Unicode"):
            daskllm.search(index, ["read a JSON file", bad], k=2).compute()
    finally:
        index.drop()
    best = daskllm.rerank(["read a JSON file", bad], daskllm.batch([docs, docs]), k=1, on_error="null").compute()
    assert best == [[docs[0]], None]
    with pytest.raises(daskllm.CallError, match=r"^rerank item 1: text is not valid Unicode"):
        daskllm.rerank(["read a JSON file", bad], daskllm.batch([docs, docs]), k=1).compute()


def test_explain_prints_the_plan(capsys):
    node = chain_and_fan(QUESTIONS[:4] + QUESTIONS[:1])[2]
    with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):  # staged tasks, even this small
        report = daskllm.explain(node)
    out = capsys.readouterr().out
    assert "passes applied: cse, cache, prune, parts, prefix, pipeline, stage" in out
    assert "decode" in out and "calls merged" in out and "prefill tokens read from the prefix cache" in out
    assert report["cse"]["merged"] == 2 and "parts" not in report


@pytest.mark.bits
def test_a_small_plan_runs_as_parts_one_per_worker_with_the_same_answers(client):
    """A handful of chained calls: the stage pass's per-worker shards become parts, one worker
    task each, placed on different workers; no prefill task, no task between the calls."""
    first = daskllm.generate(daskllm.prompt("Q: {q}\nA:", q=QUESTIONS[:4]), max_tokens=4)
    second = daskllm.generate(daskllm.prompt("Q: {q}\nDraft: {a}\nBetter:", q=QUESTIONS[:4], a=first), max_tokens=4)
    report = daskllm.explain(second)
    assert report["parts"] == {"calls": 8, "workers": 2, "tasks": 2}
    assert "prefix" not in report and report["stage"]["nodes_fused"] == 0
    with get_task_stream() as stream, daskllm.usage() as used:
        answers = second.compute()
    assert answers == daskllm.compute(second, **NAIVE)[0]
    assert used.executed["generate"] == 8  # the calls inside the parts are metered
    parts = [t for t in stream.data if t["key"].startswith("daskllm-part-")]
    assert len(parts) == 2 and len({t["worker"] for t in parts}) == 2
    with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 1}):
        assert "parts" not in daskllm.explain(second)  # 8 calls > 1 per worker: staged tasks


def test_bad_input_fails_at_build_time_naming_the_problem():
    with pytest.raises(ValueError, match=r"prompt field \{missing\} has no value"):
        daskllm.prompt("Hello {missing}")
    with pytest.raises(ValueError, match="not deterministic and cannot be cached"):
        daskllm.generate("x", temperature=0.9, cache=True)
    with pytest.raises(ValueError, match="token ids from model"):
        daskllm.generate(daskllm.tokens([1, 2, 3], model="all-MiniLM-L6-v2"), model="tiny")
    with pytest.raises(ValueError, match="batched inputs have different sizes"):
        daskllm.generate(daskllm.prompt("{a} {b}", a=["1", "2"], b=["1", "2", "3"]))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        daskllm.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="message 1: token ids cannot go inside a chat message"):
        daskllm.chat([{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": daskllm.prompt("Q: ", daskllm.tokens([5, 6], model="tiny"))}])
    with pytest.raises(ValueError, match=r"prompt field \{q\} has no value"):
        daskllm.chat([{"role": "user", "content": "Q: {q}"}])
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'null', got 'ignore'"):
        daskllm.embed(["a"], on_error="ignore")
    with pytest.raises(ValueError, match="not supported with split"):
        daskllm.generate("x", split="lines", on_error="null")

    class Cyclic:
        name = "make-a-cycle"

        def run(self, graph):
            a, b = list(graph)[:2]
            graph.add_edge(a, b)
            graph.add_edge(b, a)
            return graph

    from daskllm.plan.passes import REGISTRY, register_pass

    register_pass("make-a-cycle", Cyclic)
    try:
        node = daskllm.generate(daskllm.prompt("Q: {q}", q=["a", "b"]))
        with dask.config.set({"daskllm.rewrite.passes": ["make-a-cycle"]}), \
                pytest.raises(ValueError, match="cycle through"):
            lowered([node])
    finally:
        REGISTRY.pop("make-a-cycle")


def test_overrides_are_per_thread_and_never_leak():
    """Threads computing with different settings at once each plan with their own, and the
    process keeps its configuration (dask.config.set in threads could leave one behind)."""
    import threading

    from daskllm import config
    from daskllm.runtime.submit import overrides

    default = config.get("rewrite.passes")
    seen, barrier = {}, threading.Barrier(8)

    def plan(i):
        settings = {"passes": [] if i % 2 else ["cse"], "granularity": "query" if i % 2 else "shard"}
        with overrides(dict(settings)):
            barrier.wait(timeout=30)
            seen[i] = (config.get("rewrite.passes"), config.get("rewrite")["granularity"])
            barrier.wait(timeout=30)

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == {i: ([], "query") if i % 2 else (["cse"], "shard") for i in range(8)}
    assert config.get("rewrite.passes") == default
    assert config.get("rewrite")["granularity"] == "shard"


def test_a_shared_prefill_has_a_copy_per_worker_its_calls_fill():
    """Halo's replication for a popular prefix only: one template over every call gets a prefill
    copy per worker; four equal templates on two workers one each (each prefix computed once);
    a hot template beside cold ones, copies for the hot one alone."""
    from daskllm.plan.context import ClusterView
    from daskllm.plan.passes.prefix import _replicas_needed
    from daskllm.runtime.submit import plan

    assert [_replicas_needed(2, calls, 160) for calls in (160, 40, 81, 80, 1)] == [2, 1, 2, 1, 1]
    assert _replicas_needed(4, 80, 160) == 2 and _replicas_needed(1, 160, 160) == 1
    view = ClusterView(on_cluster=True, holders=((("llm", "tiny"), 2),), reporting=2)
    questions = [f"Question {i}: how do I use feature {i} of the standard library?" for i in range(40)]

    def prefills(counts):
        nodes = [daskllm.generate(daskllm.prompt(f"System {s}. " + SYSTEM_A + "{q}", q=questions[:n]), model="tiny",
                                  max_tokens=4) for s, n in enumerate(counts)]
        with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):
            return plan(nodes, view=view).report["tasks"]["prefill"]

    assert prefills([40]) == 2
    assert prefills([40, 40, 40, 40]) == 4
    assert prefills([40, 4, 4, 4]) == 2 + 3
