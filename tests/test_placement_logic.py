"""Placement decisions, in process: a scheduler and threaded workers from Dask's test harness.

Workers advertise models and resident prefix blocks the way daskllm workers do (heartbeat
metrics); tasks carry hand-written ``daskllm`` annotations like the ones lowering writes.
Nothing loads a model, so each test takes a fraction of a second.
"""

from __future__ import annotations

import copy

import dask
import pytest
from distributed import Event
from distributed.utils_test import async_poll_for, gen_cluster, inc

from daskllm import config
from daskllm.annotations import TaskAnnotation
from daskllm.placement import EVENT_TOPIC, PlacementPlugin

BLOCK = 16  # tokens per prefix block (daskllm.engine.block-size)
PREFIX = ["a1", "a2", "a3", "a4"]  # a chain of block hashes, as annotations carry them


def placement_cluster(workers: int = 2):
    """An in-process cluster of single-threaded workers, failing the test after 10 s.

    gen_cluster resets Dask's config to what it was when distributed.utils_test was first
    imported, which may be before daskllm's defaults were loaded: they are set again here.
    """
    return gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * workers, timeout=10,
                       config={"daskllm": config.defaults["daskllm"]})


@pytest.fixture(autouse=True)
def restore_dask_config():
    """gen_cluster does not restore the config it resets: later tests need the session's."""
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


async def advertise(worker, llm=("tiny",), cache=None) -> None:
    """What a daskllm worker reports with each heartbeat: its models and resident blocks."""
    report = {"models": {"llm": list(llm), "embed": [], "rerank": []}, "cache": cache or {}}
    worker.metrics["daskllm"] = lambda worker: report
    await worker.heartbeat()


def plug(scheduler, policy: str = "cache_aware", **settings) -> PlacementPlugin:
    plugin = PlacementPlugin(policy, block_size=BLOCK)
    for name, value in settings.items():
        setattr(plugin, name, value)
    scheduler.add_plugin(plugin)
    return plugin


def call(key: str, *deps, op: str = "decode", model: str = "tiny", prefix=(), prompt_tokens: int = 70,
         max_tokens: int = 4, engine: str = "llm", **extra):
    """A task annotated as lowering annotates an LLM call."""
    annotation = TaskAnnotation(op=op, engine=engine, model=model, prefix=tuple(prefix), prompt_tokens=prompt_tokens,
                                max_tokens=max_tokens, shard=1, **extra).as_dict()
    with dask.annotate(daskllm=annotation):
        return dask.delayed(_run, pure=False)(*deps, dask_key_name=key)


def _run(*inputs) -> int:
    return len(inputs)


async def run(client, *tasks) -> list:
    """Compute, and keep the futures: the scheduler forgets the tasks nobody holds."""
    futures = client.compute(list(tasks))
    await client.gather(futures)
    return futures


def wait(event) -> int:
    event.wait()
    return 1


def pinned(scheduler, key: str) -> str:
    [worker] = scheduler.tasks[key].worker_restrictions
    return worker


def ran_on(scheduler, key: str) -> str:
    [ws] = scheduler.tasks[key].who_has
    return ws.address


async def events(client) -> list[dict]:
    return [msg for _, msg in await client.get_events(EVENT_TOPIC)]


# --- models ---------------------------------------------------------------------------------


@placement_cluster(workers=3)
async def test_only_workers_holding_the_model_are_candidates(c, s, a, b, x):
    plug(s, "round_robin")  # would use every worker it may
    await advertise(a, llm=["tiny"])
    await advertise(b, llm=["tiny", "other"])
    await advertise(x, llm=["other"])
    keys = [f"call-{i}" for i in range(6)]
    _ = await run(c, *[call(k) for k in keys])
    assert sorted(ran_on(s, k) for k in keys) == sorted([a.address, b.address] * 3)


@placement_cluster()
async def test_a_model_no_worker_holds_fails_naming_it(c, s, a, b):
    plug(s)
    await advertise(a)
    await advertise(b)
    with pytest.raises(Exception, match="no worker holds the llm model 'nobody-has-it'"):
        await c.compute(call("orphan", model="nobody-has-it"))
    assert (await events(c))[-1] == {"action": "no-worker-for-model", "key": "orphan", "model": "nobody-has-it"}
    assert await c.compute(call("served")) == 0  # the others carry on


# --- cache and load --------------------------------------------------------------------------


@placement_cluster()
async def test_a_call_goes_where_its_prefix_is_cached_while_load_is_balanced(c, s, a, b):
    plugin = plug(s)
    await advertise(a)
    await advertise(b, cache={"tiny": PREFIX})
    _ = await run(c, call("q", prefix=PREFIX))
    assert ran_on(s, "q") == b.address
    assert plugin.decisions == {"cache": 1}


@placement_cluster()
async def test_a_call_spills_to_the_least_loaded_worker_past_the_balance_slack(c, s, a, b):
    plugin = plug(s)
    await advertise(a)
    await advertise(b, cache={"tiny": PREFIX})
    plugin.queued[b.address] = 10_000  # work placed there earlier and not finished
    _ = await run(c, call("q", prefix=PREFIX))
    assert ran_on(s, "q") == a.address
    assert plugin.decisions == {"balance": 1}


@placement_cluster()
async def test_calls_sharing_a_prefix_go_together(c, s, a, b):
    plug(s)
    await advertise(a)
    await advertise(b)
    other = ["b1", "b2", "b3", "b4"]
    calls = [call(f"x{i}", prefix=PREFIX) for i in range(4)] + [call(f"y{i}", prefix=other) for i in range(4)]
    _ = await run(c, *calls)
    x = {ran_on(s, f"x{i}") for i in range(4)}
    y = {ran_on(s, f"y{i}") for i in range(4)}
    assert len(x) == len(y) == 1 and x != y  # one prefix per worker, computed once each


@placement_cluster()
async def test_a_decode_goes_where_its_prefill_went(c, s, a, b):
    # Scores only (no slack), and a queue on the prefill's worker that outweighs the cache
    # the decode would find there (64 tokens) but not the prefill it would waste elsewhere.
    plugin = plug(s, balance_tokens=0, balance_ratio=0.0)
    await advertise(a, cache={"tiny": PREFIX})  # the prefill goes where its prefix may be
    await advertise(b)
    plugin.queued[a.address] = 32
    # Recognized by the prefill's annotation, whatever its key says.
    prefill = call("shared-prefix-0", op="prefill", prefix=PREFIX, prompt_tokens=64, max_tokens=0)
    _ = await run(c, call("answer-0", prefill, prefix=PREFIX))
    assert pinned(s, "shared-prefix-0") == pinned(s, "answer-0") == a.address


# --- faults ---------------------------------------------------------------------------------


@placement_cluster()
async def test_a_malformed_annotation_falls_back_to_plain_dask_and_is_logged(c, s, a, b):
    plugin = plug(s)
    await advertise(a)
    await advertise(b)
    with dask.annotate(daskllm={"op": "decode", "model": 7}):
        value = dask.delayed(sum)([1, 2, 3], dask_key_name="malformed")
    assert await c.compute(value) == 6
    assert s.tasks["malformed"].worker_restrictions is None
    assert plugin.decisions["fallback"] == 1
    [logged] = [e for e in await events(c) if e["action"] == "malformed-annotation"]
    assert logged["key"] == "malformed"


@placement_cluster()
async def test_an_annotation_without_a_work_estimate_is_placed_not_a_fault(c, s, a, b):
    """Only op (and model, with an engine) is required: a task without prompt_tokens, max_tokens,
    prefix or shard is placed by model and load, its estimate counting as no work."""
    plugin = plug(s)
    await advertise(a)
    await advertise(b)
    with dask.annotate(daskllm={"op": "decode", "engine": "llm", "model": "tiny"}):
        value = dask.delayed(_run, pure=False)(dask_key_name="bare")
    _ = await run(c, value)
    assert pinned(s, "bare") in (a.address, b.address)
    assert plugin.decisions == {"balance": 1}  # no fallback, no fault
    assert not [e for e in await events(c) if e["action"] in ("error", "malformed-annotation")]


@placement_cluster()
async def test_a_fault_in_the_plugin_never_reaches_the_scheduler(c, s, a, b):
    plugin = plug(s)
    await advertise(a)
    await advertise(b)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in placement")

    async def errors():
        return [e["error"] for e in await events(c) if e["action"] == "error"]

    plugin._place = broken
    assert await c.gather(c.compute([call(f"q{i}", prefix=PREFIX) for i in range(4)])) == [0] * 4
    assert len(await errors()) == 1 and "a bug in placement" in (await errors())[0]
    plugin.reported = None  # breaks remove_worker
    await b.close()
    await async_poll_for(lambda: b.address not in s.workers, timeout=5)
    assert len(await errors()) == 2
    assert await c.compute(call("after")) == 0  # the scheduler carries on


# --- policies ---------------------------------------------------------------------------------


@placement_cluster()
async def test_round_robin_alternates(c, s, a, b):
    plug(s, "round_robin")
    await advertise(a, cache={"tiny": PREFIX})
    await advertise(b)
    keys = [f"q{i}" for i in range(6)]
    _ = await run(c, *[call(k, prefix=PREFIX) for k in keys])
    assert sorted(ran_on(s, k) for k in keys) == sorted([a.address, b.address] * 3)


@placement_cluster()
async def test_least_loaded_ignores_the_cache(c, s, a, b):
    plugin = plug(s, "least_loaded")
    await advertise(a, cache={"tiny": PREFIX})
    await advertise(b)
    plugin.queued[a.address] = 1_000
    keys = [f"q{i}" for i in range(3)]
    _ = await run(c, *[call(k, prefix=PREFIX) for k in keys])
    assert {ran_on(s, k) for k in keys} == {b.address}


@placement_cluster()
async def test_off_leaves_tasks_to_plain_dask(c, s, a, b):
    plugin = plug(s, "off")
    await advertise(a)
    await advertise(b)
    _ = await run(c, call("q", model="nobody-has-it"))  # not even a model check
    assert s.tasks["q"].worker_restrictions is None and not plugin.decisions


# --- order and bookkeeping -------------------------------------------------------------------


@placement_cluster()
async def test_priorities_run_deeper_tasks_first_and_shared_prefixes_back_to_back(c, s, a, b):
    plug(s)
    await advertise(a)
    await advertise(b)
    prefixes = [PREFIX, ["b1"], PREFIX, ["b1"]]  # interleaved
    firsts = [call(f"first-{i}", prefix=prefix) for i, prefix in enumerate(prefixes)]
    second = call("second", *firsts[:2], prefix=["b1"])
    _ = await run(c, second, *firsts[2:])
    ranked = sorted(["second", *(f"first-{i}" for i in range(4))], key=lambda k: s.tasks[k].priority)
    assert ranked[0] == "second"  # the deepest
    assert [prefixes[int(k[-1])][0] for k in ranked[1:]] == ["a1", "a1", "b1", "b1"]


@placement_cluster()
async def test_finishing_releases_the_queued_load(c, s, a, b):
    plugin = plug(s)
    await advertise(a)
    await advertise(b)
    go = Event()
    blocked = c.submit(wait, go, pure=False)  # holds its dependents back
    futures = c.compute([call(f"q{i}", blocked, prefix=PREFIX) for i in range(4)])
    await async_poll_for(lambda: len(plugin.placed) == 4, timeout=5)
    assert sum(plugin.queued.values()) > 0
    assert sum(plugin.inflight[w]["tiny"]["a1"] for w in (a.address, b.address)) == 4
    await go.set()
    await c.gather(futures)
    assert not plugin.placed and not plugin.queued
    assert not any(coming for models in plugin.inflight.values() for coming in models.values())


@placement_cluster(workers=3)
async def test_a_worker_that_leaves_is_in_no_restriction(c, s, a, b, x):
    plugin = plug(s)
    for worker in (a, b, x):
        await advertise(worker)
    go = Event()
    blocked = c.submit(wait, go, pure=False, workers=[a.address])
    # Placed calls waiting on a dependency; a user's restriction to two workers; and a
    # finished task kept (released) for its dependent, which may need it computed again.
    calls = c.compute([call(f"q{i}", blocked, prefix=[f"p{i}"]) for i in range(6)])
    either = c.submit(inc, blocked, workers=[b.address, x.address], allow_other_workers=False, pure=False)
    first = c.submit(inc, 1, workers=[b.address], key="first")
    second = c.submit(inc, first, key="second")
    assert await second == 3
    del first
    await async_poll_for(lambda: s.tasks["first"].state == "released" and len(plugin.placed) == 6, timeout=5)
    assert b.address in {pinned(s, f"q{i}") for i in range(6)}
    await b.close()
    await async_poll_for(lambda: b.address not in s.workers, timeout=5)
    assert not [ts.key for ts in s.tasks.values() if b.address in (ts.worker_restrictions or ())]
    assert s.tasks[either.key].worker_restrictions == {x.address}
    assert {pinned(s, f"q{i}") for i in range(6)} <= {a.address, x.address}  # where the model is
    assert set(plugin.queued) <= {a.address, x.address}
    await go.set()
    assert await c.gather(calls) == [1] * 6 and await either == 2 and await second == 3  # none stranded


def test_annotations_round_trip_and_malformed_ones_name_the_field():
    ann = TaskAnnotation(op="decode", engine="llm", model="tiny", prefix=("a1", "b2"), prompt_tokens=40,
                         max_tokens=8, shard=2)
    assert TaskAnnotation.from_dict(ann.as_dict()) == ann
    search = TaskAnnotation(op="search", index="docs", shard=4, index_shard=1)
    assert TaskAnnotation.from_dict(search.as_dict()) == search
    for bad, field in [({"op": "decode", "engine": "llm", "model": 7}, "model"),
                       ({"op": 3}, "op"), ({"op": "decode", "engine": "llm"}, "model"),
                       ({"op": "decode", "prefix": "abc"}, "prefix"), ({"op": "decode", "shard": "2"}, "shard"),
                       ({"op": "decode", "colour": "red"}, "colour")]:
        with pytest.raises(ValueError, match=field):
            TaskAnnotation.from_dict(bad)
