"""The consumer side of a stream: one pmap call runs each item's stages as items arrive.

The consumer never depends on the queue alone: when the decode task has finished it reads
any item it missed from the decode's result. So a lost consumer (its worker died) is simply
rerun, and a decode computed before (CSE, result cache) needs no queue at all. ``run`` tells
a recomputed decode from the first: a deterministic stream repeats the same items, which the
consumer drops; a sampled one starts over.
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import threading
import time
from typing import Any

import dask
from distributed import Future, Queue, get_worker, worker_client

from daskllm.annotations import PMAP_TASK
from daskllm.streaming.stages import ANCESTRY, ItemError, PmapSpec, StreamError, format_ancestry
from daskllm.streaming.wire import Source, queue_name, stream_id
from daskllm.worker.host import UNWANTED, host
from daskllm.worker.usage import TaskUsage

class _Item:
    __slots__ = ("index", "stage", "value", "frames", "args")

    def __init__(self, index: tuple[int, int], value, frames: tuple, args: list):
        self.index, self.stage, self.value, self.frames, self.args = index, 0, value, frames, args


def _is_lazy(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(map(_is_collection, value))
    if isinstance(value, dict):
        return any(map(_is_collection, value.values()))
    return _is_collection(value)


def _is_collection(value) -> bool:
    """A Dask collection, by its type: ``dask.is_dask_collection`` builds the graph to ask (for
    a daskllm node, a whole plan, made again when the items are submitted together)."""
    return not isinstance(value, type) and hasattr(type(value), "__dask_graph__")


class Consumer:
    """One pmap task: runs each item's stages as items arrive, for a shard of its pmap's
    calls (or of several pmaps' calls, consolidated); returns per call its results in order.

    ``calls``: per call ``(its number in the pmap, its items, its stage arguments, the
    ancestry frames of the item it was built for)``. Streamed, every call's items (None here)
    come from one decode task, through one queue, each at its position
    ``source.positions[call]`` in that task. The items of every call here are planned and
    submitted together, so a shard of calls is one plan and one scheduler message per round,
    not one per call. Items are keyed ``(call, index)``.
    """

    def __init__(self, task_key: str, spec: PmapSpec, source: Source, calls: list[tuple[int, list | None, list, tuple]]):
        self.task_key, self.spec, self.source, self.calls = task_key, spec, source, calls
        if source.producer_key:
            self.parents = [stream_id(source.producer_key, pos) for pos in source.positions]
        else:
            self.parents = [task_key[:20] if len(calls) == 1 else f"{task_key[:20]}/{number}" for number, *_ in calls]
        self.at_position: dict[int, list[int]] = {}  # a decode position -> the calls reading it
        for call, pos in enumerate(source.positions):
            self.at_position.setdefault(pos, []).append(call)
        self.items: dict[tuple[int, int], _Item] = {}
        self.results: dict[tuple[int, int], Any] = {}
        self.errors: dict[tuple[int, int], BaseException] = {}
        self.counts: list[int | None] = [None] * len(calls)
        self.received = [0] * len(calls)
        self.pending: dict = {}  # future -> the items waiting for it (identical items share one)
        self.run: str | None = None
        self.first_started: float | None = None
        self.children: set = set()
        self.requested: dict = {}
        self._ready: list[_Item] = []  # arrived, stages not started
        self._events: queue_mod.SimpleQueue = queue_mod.SimpleQueue()  # records, and None to wake up
        self._refs: dict = {}  # futures of big payloads, until their envelopes arrive
        for call, (_, items, _, _) in enumerate(calls):
            if items is not None:
                self._add_all(call, items)

    # -- items arriving --------------------------------------------------------------------

    def _add(self, call: int, index: int, value) -> None:
        if (call, index) in self.items:
            return  # a recomputed decode repeats items already here
        _, _, args, ancestry = self.calls[call]
        self.items[call, index] = item = _Item((call, index), value, (*ancestry, (self.parents[call], index)), args)
        self.received[call] += 1
        self._ready.append(item)

    def _add_all(self, call: int, values: list) -> None:
        """A call's items all at once (its list, or its decode's result)."""
        for i, v in enumerate(values):
            self._add(call, i, v)
        self.counts[call] = len(values)

    def _complete(self, call: int) -> bool:
        return self.counts[call] is not None and self.received[call] >= self.counts[call]

    def _records(self, records: list) -> None:
        for r in records:
            if isinstance(r, Future):  # carries a big payload; its envelope comes next
                self._refs[r.key] = r
                continue
            kind, pos, a, b, run = r
            if self.run is not None and run != self.run and not self.source.deterministic:
                self._restart()
            self.run = run
            if kind == "error":
                raise StreamError(f"stream {', '.join(dict.fromkeys(self.parents))}: the decode failed: {a}")
            value = pickle.loads(b) if kind == "item" else self._refs.pop(b).result() if kind == "ref" else None
            for call in self.at_position.get(pos, ()):
                if kind == "end":
                    self.counts[call] = a
                else:
                    self._add(call, a, value)

    def _from_result(self, producer) -> None:
        """The decode finished and some call still misses items (this consumer was rerun after
        its worker died, and its queue had given the lost run the first items; or the decode
        ran before): its result has them all, in order."""
        if producer.status != "finished":
            try:
                exc = producer.exception()
            except BaseException as e:  # noqa: BLE001
                exc = e
            raise StreamError(f"stream {', '.join(dict.fromkeys(self.parents))}: the decode {producer.status}: {exc!r}")
        result = producer.result()
        for call, pos in enumerate(self.source.positions):
            if not self._complete(call):
                self._add_all(call, result[pos])

    def _restart(self) -> None:
        """A sampled decode was recomputed: its items may differ, so everything starts over."""
        for f in self.pending:
            f.release()
        self.pending.clear()
        self.items.clear()
        self.results.clear()
        self.errors.clear()
        self._ready = []
        self.counts = [None] * len(self.calls)
        self.received = [0] * len(self.calls)

    # -- running stages --------------------------------------------------------------------

    def _advance(self, item: _Item, to_compute: list) -> None:
        """Run item's stages until one returns work to compute, or it has a result."""
        stages = self.spec.stages
        offset = sum(s.nargs for s in stages[:item.stage])
        while item.stage < len(stages):
            stage = stages[item.stage]
            args = item.args[offset:offset + stage.nargs]
            token = ANCESTRY.set(item.frames)
            try:
                item.value = stage.fn(item.value, *args)
            except Exception as exc:  # noqa: BLE001 - this item fails; the others go on
                self._fail(item, exc)
                return
            finally:
                ANCESTRY.reset(token)
            item.stage += 1
            offset += stage.nargs
            if _is_lazy(item.value) and not (item.stage < len(stages) and stages[item.stage].lazy_ok):
                to_compute.append(item)
                return
        self.results[item.index] = item.value

    def _fail(self, item: _Item, exc: BaseException) -> None:
        if isinstance(exc, ItemError):  # from a nested pmap: it already names the full ancestry
            self.errors[item.index] = exc
        else:
            self.errors[item.index] = ItemError(f"item {format_ancestry(item.frames)} failed: "
                                                f"{type(exc).__name__}: {exc}", item.frames)

    def _submit(self, client, batch: list) -> None:
        """Start the lazy work of ``batch``: daskllm nodes planned together (CSE, shared
        prefixes across items), one future per item."""
        if not batch:
            return
        restrict = {"workers": [get_worker().address], "allow_other_workers": False} if self.spec.sticky else {}
        submitted = self.spec.submit(client, [i.value for i in batch], self.spec.planning, **restrict)
        self.children |= submitted.task_keys
        for op, n in submitted.requested.items():
            self.requested[op] = self.requested.get(op, 0) + n
        for item, f in zip(batch, submitted.futures):
            if f not in self.pending:
                f.add_done_callback(self._wake)
            self.pending.setdefault(f, []).append(item)

    def _collect(self, client) -> list:
        """Items whose submitted work finished, holding its value; failed ones are recorded."""
        done = [f for f in self.pending if f.done()]
        if not done:
            return []
        ok = [f for f in done if f.status == "finished"]
        ready = []
        for f, v in zip(ok, client.gather(ok) if ok else []):
            for item in self.pending.pop(f):
                item.value = v
                ready.append(item)
        for f in done:
            if f in self.pending:
                exc = f.exception() if f.status == "error" else getattr(f._state, "exception", None)
                for item in self.pending.pop(f):
                    self._fail(item, exc if isinstance(exc, BaseException) else RuntimeError(f"item {f.status}"))
        return ready

    @property
    def finished(self) -> bool:
        return all(self._complete(c) for c in range(len(self.calls))) and not self.pending \
            and len(self.results) + len(self.errors) >= len(self.items)

    # -- the loop ----------------------------------------------------------------------------

    def run_local(self) -> list:
        """No cluster: compute every item's stages in this process."""
        for item in self._ready:
            while True:
                batch: list = []
                self._advance(item, batch)
                if not batch:
                    break
                try:
                    (item.value,) = dask.compute(item.value)
                except Exception as exc:  # noqa: BLE001
                    self._fail(item, exc)
                    break
        return self._result()

    def run_distributed(self) -> list:
        """Event driven: queue records (read by a helper thread) and finished futures wake the
        loop; no polling delay between an item's arrival or a stage's end and its next step."""
        with worker_client(separate_thread=True) as client:
            q = producer = reader = None
            if self.source.producer_key is not None:
                q = Queue(queue_name(self.source.producer_key, self.task_key), client=client)
                producer = _watch(client, self.source.producer_key)
                producer.add_done_callback(self._wake)
                reader = threading.Thread(target=self._read, args=(q,), daemon=True,
                                          name=f"daskllm-stream-reader-{self.task_key}")
                reader.start()
            try:
                self._loop(client, producer)
            finally:
                for f in self.pending:
                    f.release()
                if q is not None:
                    try:
                        q.put(["stop", None, None, None, None])  # lets the reader thread end
                    except Exception:  # noqa: BLE001 - queue already deleted
                        pass
                    q.close()
                if producer is not None:
                    producer.release()
        host().record(self.task_key, TaskUsage(PMAP_TASK, calls=len(self.calls), items=len(self.results) + len(self.errors),
                                               requested=dict(self.requested), children=tuple(sorted(self.children)),
                                               first_item_started=self.first_started))
        return self._result()

    def _wake(self, *_) -> None:
        self._events.put(None)

    def _read(self, q) -> None:
        """Blocking reads (no timeouts: the scheduler logs a timed-out get as an error)."""
        while True:
            try:
                record = q.get()
            except Exception:  # noqa: BLE001 - deleted: the loop sees the decode's state
                self._wake()
                return
            if isinstance(record, (list, tuple)) and record and record[0] == "stop":
                return
            if isinstance(record, (list, tuple)) and record and isinstance(record[0], (list, tuple)):  # sent together
                for envelope in record:
                    self._events.put(envelope)
            else:
                self._events.put(record)

    def _loop(self, client, producer) -> None:
        while True:
            try:
                # Wait only with nothing to do: items given up front are ready at once. The
                # timeout is for noticing a cancelled task.
                events = [] if self._ready else [self._events.get(timeout=0.5)]
            except queue_mod.Empty:
                events = []
            while True:
                try:
                    events.append(self._events.get_nowait())
                except queue_mod.Empty:
                    break
            records = [e for e in events if e is not None]
            if records:
                self._records(records)
            if producer is not None and not records and producer.done() \
                    and not all(self._complete(c) for c in range(len(self.calls))):
                self._from_result(producer)
            batch: list = []
            for item in self._ready:
                if self.first_started is None:
                    self.first_started = time.time()
                self._advance(item, batch)
            self._ready = []
            for item in self._collect(client):
                self._advance(item, batch)
            self._submit(client, batch)
            if self.finished:
                return
            if _cancelled(self.task_key):
                raise StreamError(f"pmap {self.task_key} was cancelled")

    def _result(self) -> list[list]:
        """Per call, its items' results in order (a failed item holds its error)."""
        per_call = [[self.errors.get((c, i), self.results.get((c, i))) for i in range(n or 0)]
                    for c, n in enumerate(self.counts)]
        if self.errors and self.spec.errors == "raise":
            call, index = min(self.errors)
            exc = self.errors[call, index]
            failed = sum(1 for c, _ in self.errors if c == call)
            raise ItemError(f"{exc} ({failed} of {self.counts[call]} items failed; the others finished "
                            f"and are in .results)", exc.ancestry, per_call[call]) from exc
        return per_call


def _watch(client, key: str):
    """A future for a task this one does not depend on. ``Future(key)`` alone no longer tells
    the scheduler, which then never reports the task's state to this client: ask for it."""
    future = Future(key, client)
    client._send_to_scheduler({"op": "client-desires-keys", "keys": [key], "client": client.id})
    return future


def _cancelled(task_key: str) -> bool:
    try:
        ts = get_worker().state.tasks.get(task_key)
    except Exception:  # noqa: BLE001 - not in a worker
        return False
    return ts is None or ts.state in UNWANTED
