"""Deadline-aware ordering: engines start waiting requests in priority order, and the server's
micro-batches leave in deadline order (pure logic and one real engine; no cluster)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from daskllm.engines import SamplingParams
from daskllm.engines.scheduler import Scheduler, Sequence
from daskllm.serve.consolidate import NO_DEADLINE_MS, Consolidator, Pending


def _seq(name: str, priority: int) -> Sequence:
    return Sequence(name, [1, 2, 3], 3, SamplingParams(), Future(), priority=priority)


def test_waiting_requests_queue_by_priority_then_arrival():
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.waiting = __import__("collections").deque()
    scheduler.add([_seq("a", 0), _seq("b", 5), _seq("c", 0), _seq("d", -1), _seq("e", 5), _seq("f", 3)])
    assert [s.request_id for s in scheduler.waiting] == ["d", "a", "c", "f", "b", "e"]


def test_a_more_urgent_request_overtakes_waiting_ones_on_a_real_engine(tiny_model_dir):
    """One sequence at a time: while the first decodes, two more wait; the lower priority value starts first."""
    from daskllm.engines.torch_engine import TorchEngine

    finished: list[str] = []
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with TorchEngine("tiny", max_num_seqs=1, device="cpu") as engine:
        queued: list[Future] = []

        def on_first_text(_delta):
            if not queued:  # the first sequence is running: these two must wait behind it
                queued.append(engine.submit("later", params, priority=5))
                queued.append(engine.submit("sooner", params, priority=1))
                queued[0].add_done_callback(lambda _: finished.append("later"))
                queued[1].add_done_callback(lambda _: finished.append("sooner"))

        first = engine.submit("first", params, on_text=on_first_text)
        first.result(timeout=120)
        for f in queued:
            f.result(timeout=120)
    assert finished == ["sooner", "later"]


def test_order_keys_put_priority_before_deadline():
    c = Consolidator.__new__(Consolidator)
    c._epoch = 100.0
    now = 101.0  # one second after the server started
    assert c.order_key(0, 50, now) == 1050
    assert c.order_key(0, None, now) == NO_DEADLINE_MS
    assert c.order_key(0, 10, now) < c.order_key(0, 500, now) < c.order_key(0, None, now)
    assert c.order_key(-1, None, now) < c.order_key(0, 1, now) < c.order_key(1, 1, now)


class Recording(Consolidator):
    """Plans nothing: records each micro-batch and answers every request with its node's key."""

    def __init__(self, **options):
        super().__init__(None, **options)
        self.batches: list[tuple[list[str], int]] = []

    def _submit(self, batch):
        self.batches.append(([p.node.key for p in batch], -batch[0].order))
        return {}

    def _deliver(self, loop, futures, waiting):
        for key, pending in waiting.items():
            for p in pending:
                loop.call_soon_threadsafe(p.result.set_result, key)


class _Named:
    def __init__(self, key):
        self.key = key


def _run(consolidator: Recording, requests) -> list:
    """Queue ``(name, deadline_ms)`` requests at once, flush, and wait (with a deadline) for all."""
    async def run():
        loop = asyncio.get_running_loop()
        pending = []
        for name, deadline in requests:
            p = Pending(consolidator.order_key(0, deadline, 0.0), len(pending), _Named(name), loop.time() + 10,
                        loop.create_future())
            pending.append(p)
        consolidator._pending.extend(pending)
        consolidator._schedule(loop)
        try:
            return await asyncio.wait_for(asyncio.gather(*(p.result for p in pending)), 30)
        finally:
            consolidator.close()

    return asyncio.run(run())


def test_a_micro_batch_takes_the_most_urgent_requests_first():
    """With more pending than fit one batch, the earliest deadlines go first, and the batch's
    Dask priority is its most urgent request's."""
    c = Recording(window=0.05, max_batch=2)
    requests = [("slow", 5000), ("urgent", 20), ("none", None), ("soon", 200)]
    assert _run(c, requests) == ["slow", "urgent", "none", "soon"]
    assert [keys for keys, _ in c.batches] == [["urgent", "soon"], ["slow", "none"]]
    assert c.batches[0][1] == -c.order_key(0, 20, 0.0)


@pytest.mark.parametrize("enabled, sizes", [(False, [1, 1, 1]), (True, [3])])
def test_consolidation_off_sends_each_request_alone(enabled, sizes):
    c = Recording(enabled=enabled, window=0.05)
    _run(c, [("a", None), ("b", None), ("c", None)])
    assert [len(keys) for keys, _ in c.batches] == sizes


def test_a_request_that_goes_away_does_not_cancel_the_value_an_equal_one_shares():
    release: list = []

    class Held(Recording):
        def _deliver(self, loop, futures, waiting):
            release.append(lambda: Recording._deliver(self, loop, futures, waiting))

    async def run():
        c = Held(window=0.05)
        node = _Named("same")
        first = asyncio.ensure_future(c.run(node))
        second = asyncio.ensure_future(c.run(node))
        while not release:  # both are waiting once the batch is submitted
            await asyncio.sleep(0.001)
        first.cancel()
        release[0]()
        try:
            return await asyncio.wait_for(second, 30)
        finally:
            c.close()

    assert asyncio.run(run()) == "same"


def test_calls_on_a_part_s_helper_threads_carry_the_part_task_s_priority():
    """A server's part runs its calls on helper threads under inner task keys Dask never saw: they
    take the priority of the part's task, through the context copied to those threads."""
    import contextvars
    import importlib
    import threading

    host = importlib.import_module("daskllm.worker.host")  # the module (daskllm.worker.host is also a function)

    token = host._inherited_priority.set(-1795)  # what priority_of sets from the running part's task
    try:
        context = contextvars.copy_context()
    finally:
        host._inherited_priority.reset(token)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(context.copy().run(host.task_priority, "decode-inner")))
    thread.start()
    thread.join(30)
    assert seen == [-1795]
    assert host.task_priority("decode-inner") == 0  # outside: no task, no priority
