"""Request consolidation: requests that arrive close together are planned as one graph.

Each request is a daskllm node. Rather than planning and submitting every request alone,
the :class:`Consolidator` plans the requests that arrive close together as one graph, so CSE
works across requests, as in Halo and Harmonia. Where the requests need only engines, the
plan is split into parts that share no task, and each part is one task that runs its plan on
a worker holding its engines, chosen by the placement plugin from its estimated tokens and
each worker's queued tokens (streamed requests' included), so a short request goes to an idle
engine rather than behind another's long prompt (:mod:`daskllm.runtime.here`): a request is one
task, its dependent calls reach the engine with no scheduler round trip between them, and a
quick request is never held back by a slow one planned beside it. Other work (a search over
an index sharded across workers) is submitted as a normal plan, placed by the placement plugin.

How long a micro-batch waits adapts to load: when nothing is in flight a request goes at
once, alone; while earlier micro-batches run, requests gather for a tenth of the recent
request latency (at most ``window`` seconds), and whatever arrives while one is being planned
joins the next (group commit). Under load batches grow; at low load latency is untouched.

A request never waits for a batch longer than its deadline allows: the flush comes no later
than its deadline less the recent service time. Pending requests leave in deadline order
(earliest first, then ``priority``), and each micro-batch is submitted with the Dask priority
of its most urgent request, which orders Dask's queues and, through the tasks' priority, the
engines' waiting queues (see :func:`daskllm.worker.host.task_priority`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import dask
from distributed import as_completed

from daskllm.models import model_name
from daskllm.plan.ir import Node
from daskllm.runtime.here import engines_needed, plan_here
from daskllm.runtime.metering import note_lowering
from daskllm.runtime.submit import overrides, plan_and_submit
from daskllm.runtime.view import model_workers
from daskllm.worker.parts import run_part

logger = logging.getLogger(__name__)

# Priority keys pack (priority, deadline in ms since the server started) into one int, as
# Dask's user priority is one int: priority first, deadline among equals.
_DEADLINE_BITS = 32
NO_DEADLINE_MS = (1 << _DEADLINE_BITS) - 1
HOLDERS_TTL = 2.0  # seconds a view of which workers hold which engines is reused


@dataclass(order=True)
class Pending:
    order: int  # lower leaves first
    seq: int
    node: Node = field(compare=False)
    deadline: float = field(compare=False)  # loop time; inf when none
    result: asyncio.Future = field(compare=False)


@dataclass
class ConsolidatorStats:
    batches: int = 0
    requests: int = 0
    largest_batch: int = 0
    planning_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"batches": self.batches, "requests": self.requests, "largest_batch": self.largest_batch,
                "mean_batch": self.requests / self.batches if self.batches else 0.0,
                "planning_seconds": self.planning_seconds}


class Consolidator:
    """Micro-batches requests' nodes into joint plans on ``client``'s cluster.

    ``enabled=False`` plans and submits each request alone, the moment it arrives (the
    baseline consolidation is measured against). ``window``: the most seconds a micro-batch
    waits for more requests while earlier ones run; 0 waits only for the planner.
    """

    LATENCY_SHARE = 0.1  # of the recent request latency, a micro-batch may spend gathering

    def __init__(self, client, *, enabled: bool = True, window: float = 0.1, max_batch: int = 256,
                 here: bool = True, plan_options: dict | None = None):
        self.client = client
        self.enabled = enabled
        self.here = here
        self.window = window
        self.max_batch = max_batch
        self.plan_options = dict(plan_options or {})
        self.stats = ConsolidatorStats()
        self._pending: list[Pending] = []
        self._seq = itertools.count()
        self._planning = False
        self._timer: asyncio.TimerHandle | None = None
        self._epoch = time.monotonic()
        self._service = 0.0  # recent planning-and-submission time of a batch, seconds (EWMA)
        self._latency = 0.0  # recent request latency, arrival to value, seconds (EWMA)
        self._in_flight = 0  # micro-batches submitted whose values are not all delivered
        self._open: dict[str, asyncio.Future] = {}  # node key -> the value of its request pending or running
        self._wanted: dict[str, int] = {}  # node key -> requests still waiting for its value
        self._running: dict[str, tuple] = {}  # node key -> (its Dask future, every node key that future serves)
        self._held: tuple[float, dict] = (-math.inf, {})  # when, and which workers hold which engines
        # Planning holds the GIL, so one planner thread is all that helps; results are awaited
        # on a wider pool (one thread per batch in flight).
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="daskllm-serve-plan")
        self._waiters = ThreadPoolExecutor(64, thread_name_prefix="daskllm-serve-wait")

    def order_key(self, priority: int, deadline_ms: float | None, now: float) -> int:
        """One int ordering requests: ``priority`` first (lower first), then absolute deadline."""
        if deadline_ms is None:
            at = NO_DEADLINE_MS
        else:
            at = min(NO_DEADLINE_MS - 1, int((now - self._epoch) * 1000 + deadline_ms))
        return (int(priority) << _DEADLINE_BITS) + at

    async def run(self, node: Node, *, priority: int = 0, deadline_ms: float | None = None):
        """The value of ``node``, computed in a micro-batch with whatever arrives alongside.
        A request equal to one still pending or running (the same node: the same deterministic
        calls) shares its value rather than computing it again."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        same = self._open.get(node.key)
        if same is not None:
            return await self._waited(node.key, same)
        deadline = loop.time() + deadline_ms / 1000 if deadline_ms is not None else math.inf
        pending = Pending(self.order_key(priority, deadline_ms, now), next(self._seq), node, deadline,
                          loop.create_future())
        self._pending.append(pending)
        self._open[node.key] = pending.result
        self._schedule(loop)
        try:
            return await self._waited(node.key, pending.result)
        finally:
            if self._open.get(node.key) is pending.result:
                del self._open[node.key]
            if node.key not in self._wanted:
                self._running.pop(node.key, None)
            latency = time.monotonic() - now
            self._latency = latency if not self._latency else 0.9 * self._latency + 0.1 * latency

    async def _waited(self, key: str, result: asyncio.Future):
        """``result``, shielded: a client that goes away must not cancel a value others share.
        When the last request waiting for it goes first, its work is cancelled: Dask's cancel
        aborts the engine requests, and the engine drops them at its next step."""
        self._wanted[key] = self._wanted.get(key, 0) + 1
        try:
            return await asyncio.shield(result)
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]
                if not result.done():  # its request went away before the value came
                    self._abandon(key, result)

    def _abandon(self, key: str, result: asyncio.Future) -> None:
        self._pending = [p for p in self._pending if p.node.key != key]  # not planned yet: never will be
        result.cancel()
        if key in self._running:  # else a micro-batch being planned holds it: see _submitted
            self._cancel_unwanted(*self._running[key])

    def _cancel_unwanted(self, future, keys: list[str]) -> None:
        """Cancel a submitted future once no request wants a value it computes (a part may
        compute the values of other requests planned with this one)."""
        if any(k in self._wanted for k in keys):
            return
        for k in keys:
            self._running.pop(k, None)
        self.client.loop.add_callback(self.client._cancel, [future])

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._pending or self._planning:
            return  # the planner's return flushes what arrived meanwhile
        wait = min(self.window, self.LATENCY_SHARE * self._latency)
        if not self.enabled or wait <= 0 or not self._in_flight:
            self._flush(loop)
            return
        # Gather, but never past what the most urgent request's deadline allows.
        first = min(p.deadline for p in self._pending) - self._service
        at = min(loop.time() + wait, first)
        if at <= loop.time():
            self._flush(loop)
        elif self._timer is None or self._timer.when() > at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._flush, loop)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending or self._planning:
            return
        self._pending.sort()
        size = self.max_batch if self.enabled else 1
        batch, self._pending = self._pending[:size], self._pending[size:]
        self._planning = True
        planned = loop.run_in_executor(self._planner, self._submit, batch)
        planned.add_done_callback(lambda f: self._submitted(loop, batch, f))

    def _submit(self, batch: list[Pending]) -> list[tuple]:
        """Plan and submit a batch (planner thread): ``(future, node keys)`` pairs: ``node keys`` a
        list of lists (the nodes whose value is each value of a part's future), or a str (a
        planned node's own future)."""
        start = time.perf_counter()
        nodes = list({p.node.key: p.node for p in batch}.values())
        with overrides(dict(self.plan_options)):
            workers = self._workers(nodes) if self.here else None
            if workers:
                parts, lowered = plan_here(nodes)
                note_lowering(lowered)
                by_output: dict[str, list[str]] = {}
                for n in nodes:
                    by_output.setdefault(lowered.outputs[n.key], []).append(n.key)
                deliveries = []
                for part in parts:
                    with dask.annotate(daskllm=part.annotation()):
                        future = self.client.submit(run_part, part, workers=workers, allow_other_workers=True,
                                                    priority=-batch[0].order, pure=False)
                    deliveries.append((future, [by_output[k] for k in part.keys]))
            else:
                submission = plan_and_submit(nodes, self.client, priority=-batch[0].order)
                deliveries = [(f, n.key) for f, n in zip(submission.futures, nodes)]
        seconds = time.perf_counter() - start
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        self.stats.planning_seconds += seconds
        self._service = seconds if not self._service else 0.8 * self._service + 0.2 * seconds
        return deliveries

    def _workers(self, nodes: list[Node]) -> list[str] | None:
        """The workers holding every engine the nodes need; None where they need more than
        engines (an index shard, a stream), or no worker holds them all."""
        needed = engines_needed(nodes)
        if needed is None:
            return None
        held = self._holders()
        workers = set.intersection(*(set(held.get((kind, model_name(model)), ())) for kind, model in needed)) \
            if needed else set()
        return sorted(workers) or None

    def _holders(self) -> dict:
        at, held = self._held
        if time.monotonic() - at > HOLDERS_TTL:
            held = model_workers(self.client)
            self._held = (time.monotonic(), held)
        return held

    def _submitted(self, loop: asyncio.AbstractEventLoop, batch: list[Pending], planned) -> None:
        self._planning = False
        try:
            futures = planned.result()
        except Exception as exc:  # noqa: BLE001 - a batch that cannot be planned: its requests fail
            for p in batch:
                if not p.result.done():
                    p.result.set_exception(exc)
        else:
            waiting: dict[str, list[Pending]] = {}
            for p in batch:
                waiting.setdefault(p.node.key, []).append(p)
            for future, node_keys in futures:
                keys = [node_keys] if isinstance(node_keys, str) else [k for ks in node_keys for k in ks]
                self._running.update((k, (future, keys)) for k in keys if k in self._wanted)
                self._cancel_unwanted(future, keys)  # its requests went away while it was planned
            self._in_flight += 1
            delivered = loop.run_in_executor(self._waiters, self._deliver, loop, futures, waiting)
            delivered.add_done_callback(lambda _: self._delivered())
        self._schedule(loop)

    def _delivered(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:  # idle now: what waits for a window need not
            self._schedule(asyncio.get_running_loop())

    def _deliver(self, loop: asyncio.AbstractEventLoop, deliveries: list, waiting: dict) -> None:
        """Hand each request its value as soon as its future finishes (waiter thread)."""
        where = {f.key: k for f, k in deliveries}
        for future, value in as_completed([f for f, _ in deliveries], with_results=True, raise_errors=False):
            if future.status == "error":
                value = value[1]  # (type, exception, traceback)
            node_keys = where[future.key]
            if isinstance(node_keys, str):
                pairs = [(node_keys, value)]
            else:  # a part: a value (or error) per output, each the value of one or more nodes
                values = value if isinstance(value, list) else [value] * len(node_keys)
                pairs = [(k, v) for keys, v in zip(node_keys, values) for k in keys]
            for key, v in pairs:
                for p in waiting[key]:
                    loop.call_soon_threadsafe(_settle, p.result, v)

    def close(self) -> None:
        self._planner.shutdown(wait=False, cancel_futures=True)
        self._waiters.shutdown(wait=False, cancel_futures=True)


def _settle(result: asyncio.Future, value) -> None:
    if result.done():  # the client went away
        return
    if isinstance(value, BaseException):
        result.set_exception(value)
    else:
        result.set_result(value)
