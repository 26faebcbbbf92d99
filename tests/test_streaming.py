"""Streaming partial outputs: splitters, pmap/collect, the decode-pipelining pass, queues.

The cluster tests run on a real multi-process LocalLLMCluster with the tiny model; a
streamed run is always checked against the same pipeline unstreamed (``passes=[]``).
"""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
from distributed.utils_test import poll_for

import daskllm
from daskllm.streaming import ItemEmitter, ItemError, JSONArray, splitter, stream_queues

from helpers import cold_start


def chunks(text: str, final: bool) -> list[str]:
    """Items of 8 characters (the tiny model writes no sentences): stable as text grows."""
    n = len(text) // 8 * 8
    out = [text[i:i + 8] for i in range(0, n, 8)]
    if final and len(text) > n:
        out.append(text[n:])
    return out


def no_items(text: str, final: bool) -> list:
    return []


def stream(prompt: str = "Once upon a time", max_tokens: int = 48, split=chunks):
    return daskllm.generate(prompt, max_tokens=max_tokens, ignore_eos=True, split=split)


# --- splitters (pure logic) ---------------------------------------------------------------------


def test_lines_are_sent_only_when_complete():
    sent = []
    emitter = ItemEmitter(splitter("lines"), lambda i, v: sent.append((i, v)))
    emitter.update("first line\nsecond")
    assert sent == [(0, "first line")]
    emitter.update("first line\nsecond line\n\n  third")
    assert sent == [(0, "first line"), (1, "second line")]
    assert emitter.update("first line\nsecond line\n\n  third", final=True) == ["first line", "second line", "third"]
    assert sent[-1] == (2, "third")


def test_json_array_elements_stream_and_bad_output_names_the_element():
    split = JSONArray()
    assert split.items('Sure: [{"a": [1, 2]}, "x, y"', False) == [{"a": [1, 2]}]
    assert split.items('Sure: [{"a": [1, 2]}, "x, y", 3]', True) == [{"a": [1, 2]}, "x, y", 3]
    assert split.items("[]", True) == []
    with pytest.raises(ValueError, match="element 1 does not parse"):
        split.items('[1, nope, 3]', False)
    with pytest.raises(ValueError, match="not a JSON array"):
        split.items("no array here", True)


def test_a_splitter_that_changes_a_sent_item_is_an_error():
    def unstable(text, final):
        return [text]  # the one item keeps growing

    emitter = ItemEmitter(splitter(unstable), lambda i, v: None)
    emitter.update("ab")
    with pytest.raises(ValueError, match="changed item 0"):
        emitter.update("abc")


def test_bad_split_and_bad_pmap_arguments_fail_at_build_time():
    with pytest.raises(ValueError, match="split must be"):
        daskllm.generate("x", split=3)
    with pytest.raises(TypeError, match="fn must be callable"):
        daskllm.pmap(["a"], "not a function")
    with pytest.raises(ValueError, match="errors must be"):
        daskllm.pmap(["a"], str.upper, errors="ignore")
    with pytest.raises(TypeError, match="collect"):
        daskllm.collect(daskllm.generate("x"))
    with pytest.raises(ValueError, match="all streams"):
        daskllm.generate(daskllm.prompt("{a} {b}", a=stream(), b=stream("other")))


# --- without a cluster ---------------------------------------------------------------------


class _FinishedDecode:
    """A decode task's future that has finished (pure logic: no cluster)."""

    status = "finished"

    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


def test_a_consumer_reads_several_streams_of_one_decode_and_fills_gaps_from_its_result():
    """One consumer task, three calls at decode positions 0, 1, 0 (a duplicated call): each
    envelope reaches every call at its position; items a lost run took from the queue (the
    consumer was rerun) come from the decode's result even when the count is known."""
    import pickle

    from daskllm.streaming.stages import PmapSpec, Stage
    from daskllm.streaming.wire import Source
    from daskllm.worker.consumer import Consumer

    spec = PmapSpec((Stage(str.upper),))
    calls = [(0, None, [], ()), (1, None, [], ()), (2, None, [], ())]
    consumer = Consumer("pmap-x", spec, Source("decode-y", (0, 1, 0)), calls)
    consumer._records([["item", 1, 0, pickle.dumps("c"), "run1"], ["end", 1, 1, None, "run1"],
                       ["item", 0, 1, pickle.dumps("b"), "run1"], ["end", 0, 2, None, "run1"]])
    assert consumer.counts == [2, 1, 2] and not consumer._complete(0)  # item 0 of position 0 never came
    consumer._from_result(_FinishedDecode([["a", "b"], ["c"]]))
    assert consumer.run_local() == [["A", "B"], ["C"], ["A", "B"]]
    with pytest.raises(daskllm.streaming.StreamError, match="decode-y"):
        consumer._records([["error", None, "boom", None, "run1"]])


def test_a_consumer_given_its_items_starts_them_without_waiting_for_an_event():
    """Items given up front (an ``each`` over a list, not a stream) are ready at once: the loop
    runs their stages before it ever blocks on its event queue (it used to wait 0.5 s first,
    at every pmap level of a pipeline)."""
    import queue

    from daskllm.streaming.stages import PmapSpec, Stage
    from daskllm.streaming.wire import Source
    from daskllm.worker.consumer import Consumer

    class NoWaiting(queue.SimpleQueue):
        def get(self, block=True, timeout=None):
            raise AssertionError("the loop waited for an event with items ready")

    consumer = Consumer("pmap-x", PmapSpec((Stage(str.upper),)), Source(), [(0, ["a", "b"], [], ())])
    consumer._events = NoWaiting()
    consumer._loop(client=None, producer=None)
    assert consumer._result() == [["A", "B"]]


def test_local_pmap_over_a_split_generation_matches_splitting_the_text(tiny_model_dir):
    text = daskllm.generate("Once upon a time", max_tokens=48, ignore_eos=True).compute()
    items = stream().compute()
    assert items == chunks(text, True) and len(items) > 3
    shouted = daskllm.collect(daskllm.pmap(stream(), lambda x, mark: x.upper() + mark, "!")).compute()
    assert shouted == [x.upper() + "!" for x in items]


def test_builders_given_a_stream_work_item_by_item(tiny_model_dir):
    items = stream().compute()
    vectors = daskllm.embed(stream()).compute()
    assert len(vectors) == len(items)
    assert all((v == daskllm.embed(x).compute()).all() for v, x in zip(vectors, items))
    answers = daskllm.generate(daskllm.prompt("Say {x}:", x=stream()), max_tokens=3).compute()
    assert answers == [daskllm.generate(daskllm.prompt("Say {x}:", x=x), max_tokens=3).compute() for x in items]


# --- on a cluster --------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("stream_every_decode")


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(n_workers=2, threads_per_worker=4) as client:
        yield client


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Every cluster test ends with no stream queue left on the scheduler."""
    yield
    if "client" in request.fixturenames:
        client = request.getfixturevalue("client")
        poll_for(lambda: client.run_on_scheduler(stream_queues) == [], timeout=20)


def unstreamed(node):
    return daskllm.compute(node, passes=[], result_cache=False)[0]


def compute_timed(client, node):
    """Compute with the result cache off; returns the value and per-key (start, stop, worker)."""
    cold_start(client)
    client.get_task_stream(start=time.time())  # clear
    start = time.time()
    value = daskllm.compute(node, result_cache=False)[0]
    spans = {}
    for record in client.get_task_stream(start=start):
        for ss in record["startstops"]:
            if ss["action"] == "compute":
                spans[record["key"]] = (ss["start"], ss["stop"], record["worker"])
    return value, spans


def first_chunks(text: str, final: bool) -> list[str]:
    """The first ten of ``chunks``: items early in a long decode."""
    return chunks(text, final)[:10]


def test_first_consumer_starts_before_the_decode_ends(client):
    # a decode (about 4 s) several times longer than an item takes to reach its consumer on a
    # busy machine (0.6 s quiet; once, beside the whole suite, more than the 1.5 s a 96-token
    # decode took), whose items all come early, so their calls stay few
    s = stream(max_tokens=640, split=first_chunks)
    pipeline = daskllm.collect(daskllm.generate(daskllm.prompt("Say {x}:", x=s), max_tokens=4))
    report = daskllm.explain(pipeline, file=open(os.devnull, "w"))
    assert report["pipeline"]["streamed"] == 1
    [producer] = [k for k in _keys(pipeline) if k.startswith("decode-")]
    value, spans = compute_timed(client, pipeline)
    item_decodes = [k for k in spans if k.startswith("decode-") and k != producer]
    # items arriving together are planned together: their calls may share a decode task
    assert len(value) > 5 and 0 < len(item_decodes) <= len(value)
    first_start = min(spans[k][0] for k in item_decodes)
    assert first_start < spans[producer][1], "no item's work started before the decode ended"
    assert value == unstreamed(pipeline)


def test_a_decode_too_short_to_pay_is_not_streamed(client):
    """Streaming is decided by the decode's expected time (its max_tokens at the engines'
    measured seconds per step) against stream-min-seconds; either way the result is the same."""
    from daskllm.runtime.view import take_view

    daskllm.compute(stream("Warm up", max_tokens=16, split="lines"), result_cache=False)
    poll_for(lambda: take_view(fresh=True).decode_seconds("tiny", 1) is not None, timeout=20)
    expected = take_view(fresh=True).decode_seconds("tiny", 48)
    pipeline = daskllm.collect(daskllm.generate(daskllm.prompt("Say {x}:", x=stream(max_tokens=48)), max_tokens=4))
    reports = {}
    for name, threshold in {"short": expected * 2, "long": expected / 2}.items():
        with dask.config.set({"daskllm.rewrite.stream-min-seconds": threshold}):
            reports[name] = daskllm.explain(pipeline, file=open(os.devnull, "w"))["pipeline"]
            assert daskllm.compute(pipeline, result_cache=False)[0] == unstreamed(pipeline)
    assert (reports["short"]["streamed"], reports["short"]["short_decodes"]) == (0, 1)
    assert (reports["long"]["streamed"], reports["long"]["short_decodes"]) == (1, 0)


def test_ordered_collect_when_items_finish_out_of_order(client):
    def slow(x, delay):
        time.sleep(delay)
        return x

    def late_first(item):
        return dask.delayed(slow)(item, 0.4 if item.startswith("0") else 0.0)

    s = daskllm.generate("Numbers:", max_tokens=40, ignore_eos=True, split=chunks)
    items = s.compute()
    marked = daskllm.pmap(s, lambda x: ("0" if x == items[0] else "1") + x)
    out = daskllm.collect(daskllm.pmap(marked, late_first))
    value = daskllm.compute(out, result_cache=False)[0]
    assert value == ["0" + items[0]] + ["1" + x for x in items[1:]]
    assert value == unstreamed(out)


def test_nested_pmap_claims_to_queries(client):
    """Claims -> queries per claim -> a call per query; ancestry comes from the nesting."""
    claims = daskllm.generate("Claims:", max_tokens=24, ignore_eos=True, split=chunks)

    def per_claim(claim):
        queries = daskllm.generate(daskllm.prompt("Queries for {c}:", c=claim), max_tokens=16, ignore_eos=True,
                                   split=chunks)
        return daskllm.collect(daskllm.generate(daskllm.prompt("Check {q}:", q=queries), max_tokens=2))

    nested = daskllm.collect(daskllm.pmap(claims, per_claim))
    value = daskllm.compute(nested, result_cache=False)[0]
    assert len(value) == len(claims.compute()) >= 3
    assert all(isinstance(v, list) and len(v) >= 2 for v in value)
    assert value == unstreamed(nested)

    def failing_inner(claim):
        queries = daskllm.generate(daskllm.prompt("Queries for {c}:", c=claim), max_tokens=16, ignore_eos=True,
                                   split=chunks)
        return daskllm.pmap(queries, lambda q, c: 1 / 0 if c == first_claim else q, claim)

    first_claim = claims.compute()[1]
    with pytest.raises(ItemError) as info:
        daskllm.compute(daskllm.collect(daskllm.pmap(claims, failing_inner)), result_cache=False)
    frames = info.value.ancestry
    assert len(frames) == 2 and frames[0][1] == 1 and frames[1][1] == 0, frames
    assert "ZeroDivisionError" in str(info.value)


def test_zero_items(client):
    empty = stream(split=no_items)
    out = daskllm.collect(daskllm.generate(daskllm.prompt("Say {x}", x=empty), max_tokens=2))
    future = client.compute(out)
    assert future.result(timeout=60) == []
    assert daskllm.collect(daskllm.pmap([], str.upper)).compute() == []


def test_an_item_failure_names_it_and_keeps_the_others(client):
    s = stream()
    items = s.compute()

    def fragile(x):
        if x == items[2]:
            raise ValueError("bad item")
        return daskllm.generate(daskllm.prompt("Say {x}:", x=x), max_tokens=2)

    with pytest.raises(ItemError, match=r"\[2\] failed: ValueError: bad item") as info:
        daskllm.compute(daskllm.pmap(s, fragile), result_cache=False)
    kept = info.value.results
    assert isinstance(kept[2], ItemError) and sum(isinstance(r, str) for r in kept) == len(items) - 1

    value = daskllm.compute(daskllm.pmap(s, fragile, errors="keep"), result_cache=False)[0]
    assert isinstance(value[2], ItemError) and "bad item" in str(value[2])
    assert [v for i, v in enumerate(value) if i != 2] == [v for i, v in enumerate(kept) if i != 2]
    assert client.submit(lambda: 1 + 1).result() == 2  # the cluster is fine


def test_a_killed_worker_mid_stream_gives_the_unstreamed_result(client):
    s = daskllm.generate("A long story:", max_tokens=240, ignore_eos=True, split=chunks)
    pipeline = daskllm.collect(daskllm.generate(daskllm.prompt("Say {x}:", x=s), max_tokens=3))
    expected = unstreamed(pipeline)
    cold_start(client)
    producers = {k for k in _keys(pipeline) if k.startswith("decode-")}
    future = client.compute(pipeline)

    def producer_worker():
        for worker, keys in client.processing().items():
            if producers & set(keys):
                return worker
        return None

    def items_out(dask_scheduler, producers):  # the tasks of items the producer has emitted
        return [k for k in dask_scheduler.tasks if str(k).startswith("decode-") and k not in producers]

    poll_for(lambda: producer_worker() is not None, timeout=30)
    poll_for(lambda: client.run_on_scheduler(items_out, producers=producers), timeout=30)  # some items out first
    victim = producer_worker()
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)  # the nanny starts a fresh worker
    assert future.result(timeout=180) == expected
    client.wait_for_workers(2, timeout=60)


def _keys(node) -> list:
    from daskllm.runtime.submit import plan as lowered

    return [k for layer in lowered([node]).graph.layers.values() for k in layer]


def test_cancelling_mid_stream_leaves_no_queue(client):
    s = daskllm.generate("Cancel me:", max_tokens=200, ignore_eos=True, split=chunks)
    pipeline = daskllm.collect(daskllm.generate(daskllm.prompt("Say {x}:", x=s), max_tokens=2))
    future = client.compute(pipeline)
    poll_for(lambda: client.run_on_scheduler(stream_queues) != [], timeout=30)
    future.cancel()
    poll_for(lambda: future.status == "cancelled", timeout=10)
    assert client.submit(sum, [1, 2]).result() == 3
    # the no_leaks fixture checks the scheduler has no queue left


def test_items_spread_across_workers_unless_sticky(client):
    words = [f"word {i} " * 4 for i in range(8)]

    def call(x):
        return daskllm.generate(daskllm.prompt("Echo {x}:", x=x), max_tokens=24, ignore_eos=True)

    def workers_used(node):
        _, spans = compute_timed(client, node)
        return {w for k, (_, _, w) in spans.items() if k.startswith("decode-")}

    assert len(workers_used(daskllm.pmap(words, call))) == 2
    assert len(workers_used(daskllm.pmap(words, call, sticky=True))) == 1


def test_usage_counts_the_work_items_asked_for(client):
    s = stream()
    n = len(s.compute())
    cold_start(client)
    with daskllm.usage() as u:
        daskllm.compute(daskllm.generate(daskllm.prompt("Say {x}:", x=s), max_tokens=2), result_cache=False)
    assert u.requested["generate"] == 1 + n and u.executed["generate"] == 1 + n
    assert u.decode_tokens == 48 + 2 * n
    # where the time went: both workers' engines ran steps, for part of the block's wall time
    assert u.engines["llm:tiny"]["count"] == 2 and u.engines["llm:tiny"]["busy_seconds"] > 0
    assert 0 < u.engine_busy()["llm:tiny"] <= 1 and u.planning_seconds > 0
    assert "engines busy: llm:tiny 2 x" in str(u)
    # the wall time split: planning + the busiest engine + the rest, which add up to it
    split = u.time_split()
    assert 0 < split["engines"] <= u.engines["llm:tiny"]["busy_seconds"] and split["planning"] == u.planning_seconds
    assert split["planning"] + split["engines"] + split["other"] == pytest.approx(split["wall"])
    assert f"{split['wall']:.2f} s wall = " in str(u)


def _set_inline_bytes(n):
    dask.config.set({"daskllm.streaming.inline-bytes": n})


def test_big_items_travel_as_futures(client):
    """Above streaming.inline-bytes an item goes as a future, not through the scheduler."""
    s = stream(max_tokens=32)
    pipeline = daskllm.collect(daskllm.pmap(s, lambda x: x[::-1]))
    client.run(_set_inline_bytes, 4)
    try:
        value = daskllm.compute(pipeline, result_cache=False)[0]
    finally:
        client.run(_set_inline_bytes, 65536)
    assert value == [x[::-1] for x in s.compute()] and len(value) >= 3


def test_nested_work_is_planned_with_the_outer_settings(client):
    """Items' work, lowered on workers, follows the computation's passes (e.g. an ablation)."""
    from daskllm.runtime.metering import _records, _with_children

    def per_claim(claim):
        parts = daskllm.generate(daskllm.prompt("Parts of {c}:", c=claim), max_tokens=16, ignore_eos=True,
                                 split=chunks)
        return daskllm.collect(daskllm.pmap(parts, str.upper))

    streamed = {}
    for name, passes in (("on", ["cse", "prune", "prefix", "pipeline", "stage"]),
                         ("off", ["cse", "prune", "prefix", "stage"])):
        claims = daskllm.generate(f"Settings {name}:", max_tokens=24, ignore_eos=True, split=chunks)
        nested = daskllm.collect(daskllm.pmap(claims, per_claim))
        value = daskllm.compute(nested, passes=passes, result_cache=False)[0]
        with dask.config.set({"daskllm.rewrite.passes": passes}):
            records = _with_children(_records(set(_keys(nested))))
        streamed[name] = {r.streamed for r in records.values() if r.op == "decode"}
        assert len(value) >= 3
    assert streamed == {"on": {True}, "off": {False}}
