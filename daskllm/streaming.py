"""Streaming partial outputs: items cut from a decode while it runs, consumed as they arrive.

A split generation (``generate(..., split="lines")``) is a *stream*: its value is the list
of items its text splits into. With the decode-pipelining pass on, the decode task emits
each complete item through a ``distributed.Queue`` as soon as its tokens are decoded, and
the consumer (a :func:`daskllm.pmap` task) starts the item's sub-pipeline right away,
while the decode goes on (Alto's streaming, Teola's partial decoding).

Wire format (ARCHITECTURE.md): envelopes ``("item", ancestry, index, payload, run)``, then
``("end", ancestry, count, None, run)``; ``("error", ancestry, message, None, run)`` if the
decode fails. Payloads are pickled and small; one above ``daskllm.streaming.inline-bytes`` goes as
a future put on the queue just before its envelope (the queue goes through the scheduler).
``run`` tells a recomputed decode (its worker died) from the first: a deterministic stream
repeats the same items, which the consumer drops; a sampled one starts over.

The consumer never depends on the queue alone: when the decode task has finished it reads
any item it missed from the decode's result. So a lost consumer (its worker died) is
simply rerun, and a decode computed before (CSE, result cache) needs no queue at all.

Queues are named ``daskllm-stream/<decode key>/<position>/<consumer key>``; both ends
release them when done, and :class:`StreamJanitor` (a scheduler plugin) deletes any whose
tasks are gone: none leak after success, failure or cancellation.
"""

from __future__ import annotations

import contextvars
import json
import pickle
import queue as queue_mod
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import dask
from dask.base import tokenize
from distributed import SchedulerPlugin

from daskllm import config

QUEUE_PREFIX = "daskllm-stream/"

# --- splitters: how a generation's text becomes items ------------------------------------------


class Splitter:
    """Complete items in ``text``; ``final`` when the generation has ended.

    Items must be stable: once returned, an item stays the same as more text arrives.
    """

    fingerprint: str

    def items(self, text: str, final: bool) -> list:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<splitter {self.fingerprint}>"


class Delimited(Splitter):
    """Items separated by ``sep``, stripped; empty ones dropped."""

    def __init__(self, sep: str):
        if not isinstance(sep, str) or not sep:
            raise ValueError(f"a delimiter must be a non-empty str, got {sep!r}")
        self.sep = sep
        self.fingerprint = "lines" if sep == "\n" else f"delimited:{sep!r}"

    def items(self, text: str, final: bool) -> list[str]:
        pieces = text.split(self.sep)
        if not final:
            pieces = pieces[:-1]  # the last piece may still grow
        return [p.strip() for p in pieces if p.strip()]


class WordGroups(Splitter):
    """Every ``n`` complete words are an item (the remaining words, at the end, are the last).

    Useful where a model's output has no reliable delimiter (small or random-weight models)
    and a stream still needs items of a known size.
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"words(n): n must be a positive int, got {n!r}")
        self.n = n
        self.fingerprint = f"words:{n}"

    def items(self, text: str, final: bool) -> list[str]:
        # A word is complete once whitespace follows it (or the generation ended).
        found = text.split() if final else re.findall(r"\S+(?=\s)", text)
        groups = [" ".join(found[i:i + self.n]) for i in range(0, len(found), self.n)]
        return groups if final else groups[:len(found) // self.n]


class JSONArray(Splitter):
    """Elements of a JSON array, each as soon as the comma or bracket after it arrives."""

    fingerprint = "json"

    def items(self, text: str, final: bool) -> list:
        start = text.find("[")
        if start < 0:
            if final:
                raise ValueError(f"output is not a JSON array: {text[:80]!r}")
            return []
        out, depth, in_string, escaped, begin = [], 0, False, False, start + 1
        for i in range(start, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "[{":
                depth += 1
            elif c in "]}":
                depth -= 1
                if depth == 0:  # the array closed
                    self._add(out, text[begin:i], last=True)
                    return out
            elif c == "," and depth == 1:
                self._add(out, text[begin:i], last=False)
                begin = i + 1
        if final:
            raise ValueError(f"output ends inside a JSON array after {len(out)} elements: ...{text[-80:]!r}")
        return out

    @staticmethod
    def _add(out: list, piece: str, last: bool) -> None:
        if last and not piece.strip():
            return  # "[]" or a trailing comma
        try:
            out.append(json.loads(piece))
        except json.JSONDecodeError as exc:
            raise ValueError(f"JSON array element {len(out)} does not parse: {piece.strip()[:80]!r} ({exc})") from None


class Parsed(Splitter):
    """A user parser: ``fn(text, final) -> list`` of the complete items in ``text``."""

    def __init__(self, fn: Callable[[str, bool], list]):
        self.fn = fn
        self.fingerprint = f"parser:{tokenize(fn)}"

    def items(self, text: str, final: bool) -> list:
        return list(self.fn(text, final))


def splitter(spec) -> Splitter:
    """``"lines"``, ``"json"``, a :class:`Splitter` (e.g. :func:`delimited`) or ``fn(text, final)``."""
    if isinstance(spec, Splitter):
        return spec
    if spec == "lines":
        return Delimited("\n")
    if spec == "json":
        return JSONArray()
    if callable(spec):
        return Parsed(spec)
    raise ValueError(f"split must be 'lines', 'json', daskllm.delimited(sep) or a parser fn(text, final) -> list, "
                     f"got {spec!r}")


def delimited(sep: str) -> Splitter:
    """Split a generation into the pieces between ``sep`` (e.g. ``";"``)."""
    return Delimited(sep)


def words(n: int) -> Splitter:
    """Split a generation into groups of ``n`` words."""
    return WordGroups(n)


class ItemEmitter:
    """Turns a growing text into new items, checking that items already sent never change."""

    def __init__(self, split: Splitter, send: Callable[[int, Any], None]):
        self.split, self.send, self.sent = split, send, []

    def update(self, text: str, final: bool = False) -> list:
        items = self.split.items(text, final)
        if items[:len(self.sent)] != self.sent:
            changed = next(i for i, (a, b) in enumerate(zip(self.sent, items + [None] * len(self.sent))) if a != b)
            raise ValueError(f"the splitter changed item {changed} after sending it: {self.sent[changed]!r} -> "
                             f"{(items + [None] * len(self.sent))[changed]!r}; a splitter must only add items")
        for i in range(len(self.sent), len(items)):
            self.send(i, items[i])
        self.sent = items
        return items


# --- ancestry and item errors ------------------------------------------------------------------

# The (parent id, index) frames of the item whose sub-pipeline is being built: pmap() records
# them, so nested pmaps know where they are without users handling tags (Alto).
ANCESTRY: contextvars.ContextVar[tuple] = contextvars.ContextVar("daskllm_ancestry", default=())


def format_ancestry(frames) -> str:
    return " > ".join(f"{parent}[{index}]" for parent, index in frames) or "(top level)"


class ItemError(RuntimeError):
    """An item's sub-pipeline failed. ``ancestry`` names the item; ``results`` holds every
    other item's result (the failed slots hold their errors), so finished work is kept."""

    def __init__(self, message: str, ancestry: tuple = (), results: list | None = None):
        super().__init__(message)
        self.ancestry, self.results = tuple(ancestry), results

    def __reduce__(self):
        return type(self), (self.args[0], self.ancestry, self.results)


class StreamError(RuntimeError):
    """The decode feeding a stream failed or disappeared."""


# --- pmap stages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One step of an item's sub-pipeline: ``fn(item, *args)``.

    ``lazy_ok``: fn accepts a lazy value (a node or delayed) in place of the item, as
    daskllm's builders do; then the previous step's output feeds it without being computed
    first, and the two run as one graph.
    """

    fn: Callable
    nargs: int = 0
    lazy_ok: bool = False

    @property
    def fingerprint(self) -> str:
        return tokenize(getattr(self.fn, "fingerprint", None) or self.fn, self.nargs, self.lazy_ok)


@dataclass(frozen=True)
class PmapSpec:
    stages: tuple[Stage, ...]
    errors: str = "raise"  # "raise" | "keep"
    sticky: bool = False  # every item of one parent on one worker (stateful consumers)
    ancestry: tuple = ()  # frames of the item this pmap was built for (nested pmaps)
    # The rewrite settings of the computation that lowered this pmap, so the work its items
    # start on workers is planned the same way (passes, result cache; e.g. an ablation).
    rewrite: dict | None = None


# --- the wire ------------------------------------------------------------------------------------


def queue_name(producer_key: str, pos: int, consumer_key: str) -> str:
    return f"{QUEUE_PREFIX}{producer_key}/{pos}/{consumer_key}"


def _parse_queue_name(name: str) -> tuple[str, str] | None:
    if not isinstance(name, str) or not name.startswith(QUEUE_PREFIX):
        return None
    producer, _, rest = name[len(QUEUE_PREFIX):].partition("/")
    _, _, consumer = rest.partition("/")
    return producer, consumer


def stream_id(producer_key: str, pos: int) -> str:
    return f"{producer_key[:20]}:{pos}"


class StreamWriter:
    """The decode side: sends each call's new items to its consumers' queues.

    A queue that is gone (its consumer finished or was cancelled) is dropped silently: the
    decode still returns its full result.
    """

    def __init__(self, task_key: str, channels: list[list[str]]):
        from distributed import get_client

        self.client = get_client()
        self.run = uuid.uuid4().hex[:8]
        self.inline = int(config.get("streaming.inline-bytes"))
        self.task_key = task_key
        self.queues: dict[int, list] = {}
        for pos, consumers in enumerate(channels):
            self.queues[pos] = [q for q in (self._open(queue_name(task_key, pos, c)) for c in consumers) if q]

    def _open(self, name: str):
        from distributed import Queue

        try:
            return Queue(name, client=self.client)
        except Exception:  # noqa: BLE001 - scheduler unreachable: the consumer falls back to the result
            return None

    def _put(self, pos: int, envelope: tuple, future=None) -> None:
        for q in list(self.queues.get(pos, ())):
            try:
                if future is not None:
                    q.put(future)
                q.put(list(envelope))
            except Exception:  # noqa: BLE001 - queue deleted: nobody listens any more
                self.queues[pos].remove(q)

    def item(self, pos: int, index: int, value) -> None:
        payload = pickle.dumps(value, protocol=5)
        ancestry = stream_id(self.task_key, pos)
        if len(payload) > self.inline:
            [future] = self.client.scatter([value], hash=False)
            self._put(pos, ("ref", ancestry, index, future.key, self.run), future)
        else:
            self._put(pos, ("item", ancestry, index, payload, self.run))

    def end(self, pos: int, count: int) -> None:
        self._put(pos, ("end", stream_id(self.task_key, pos), count, None, self.run))

    def error(self, message: str) -> None:
        for pos in self.queues:
            self._put(pos, ("error", stream_id(self.task_key, pos), message, None, self.run))

    def close(self) -> None:
        for qs in self.queues.values():
            for q in qs:
                try:
                    q.close()
                except Exception:  # noqa: BLE001
                    pass
        self.queues = {}


def stream_decode(engine, prompts: list, sampling, split: Splitter, writer: StreamWriter | None) -> list:
    """Generate for ``prompts`` together; send items as they complete. Returns the completions."""
    if writer is None:
        return engine.generate(prompts, sampling)
    deltas: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    futures = []
    try:
        for pos, p in enumerate(prompts):
            # Engine callbacks only enqueue: queue round trips must not slow the engine loop.
            futures.append(engine.submit(p, sampling, on_text=lambda d, pos=pos: deltas.put((pos, d))))
            futures[-1].add_done_callback(lambda _, pos=pos: deltas.put((pos, None)))
        texts = [""] * len(prompts)
        emitters = [ItemEmitter(split, lambda i, v, pos=pos: writer.item(pos, i, v)) for pos in range(len(prompts))]
        open_ = len(prompts)
        while open_:
            pos, delta = deltas.get()
            if delta is None:
                open_ -= 1
                continue
            texts[pos] += delta
            try:
                emitters[pos].update(texts[pos])
            except ValueError:
                pass  # the final check below reports it, with the whole text
        completions = [f.result() for f in futures]
        for pos, c in enumerate(completions):
            items = emitters[pos].update(c.text, final=True)
            writer.end(pos, len(items))
        return completions
    except BaseException as exc:
        writer.error(f"{type(exc).__name__}: {exc}")
        raise


# --- the consumer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a pmap's items come from: a value (the list) or a streamed decode's queue."""

    producer_key: str | None = None  # streamed: the decode task
    pos: int = 0  # the call's position in that task's shard
    deterministic: bool = True


class _Item:
    __slots__ = ("index", "stage", "value", "frames")

    def __init__(self, index: int, value, frames: tuple):
        self.index, self.stage, self.value, self.frames = index, 0, value, frames


def _is_lazy(value) -> bool:
    if dask.is_dask_collection(value):
        return True
    if isinstance(value, (list, tuple)):
        return any(dask.is_dask_collection(v) for v in value)
    if isinstance(value, dict):
        return any(dask.is_dask_collection(v) for v in value.values())
    return False


class Consumer:
    """One pmap call: runs each item's stages as items arrive; returns results in index order."""

    def __init__(self, task_key: str, spec: PmapSpec, source: Source, args: list, items=None):
        self.task_key, self.spec, self.source, self.args = task_key, spec, source, args
        self.parent = stream_id(source.producer_key, source.pos) if source.producer_key else task_key[:20]
        self.items: dict[int, _Item] = {}
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.count: int | None = None
        self.pending: dict = {}  # future -> the items waiting for it (identical items share one)
        self.run: str | None = None
        self.first_started: float | None = None
        self.children: set = set()
        self.requested: dict = {}
        self._ready: list[_Item] = []  # arrived, stages not started
        self._events: queue_mod.SimpleQueue = queue_mod.SimpleQueue()  # records, and None to wake up
        self._refs: dict = {}  # futures of big payloads, until their envelopes arrive
        if items is not None:
            self._add_all(items)

    # -- items arriving --------------------------------------------------------------------

    def _add(self, index: int, value) -> None:
        if index in self.items:
            return  # a recomputed decode repeats items already here
        self.items[index] = _Item(index, value, (*self.spec.ancestry, (self.parent, index)))
        self._ready.append(self.items[index])

    def _add_all(self, values: list) -> None:
        for i, v in enumerate(values):
            self._add(i, v)
        self.count = len(values)

    def _records(self, records: list) -> None:
        from distributed import Future

        for r in records:
            if isinstance(r, Future):  # carries a big payload; its envelope comes next
                self._refs[r.key] = r
                continue
            kind, _, a, b, run = r
            if self.run is not None and run != self.run and not self.source.deterministic:
                self._restart()
            self.run = run
            if kind == "item":
                self._add(a, pickle.loads(b))
            elif kind == "ref":
                self._add(a, self._refs.pop(b).result())
            elif kind == "end":
                self.count = a
            elif kind == "error":
                raise StreamError(f"stream {self.parent}: the decode failed: {a}")

    def _restart(self) -> None:
        """A sampled decode was recomputed: its items may differ, so everything starts over."""
        for f in self.pending:
            f.release()
        self.pending.clear()
        self.items.clear()
        self.results.clear()
        self.errors.clear()
        self._ready = []
        self.count = None

    # -- running stages --------------------------------------------------------------------

    def _advance(self, item: _Item, to_compute: list) -> None:
        """Run item's stages until one returns work to compute, or it has a result."""
        stages = self.spec.stages
        offset = sum(s.nargs for s in stages[:item.stage])
        while item.stage < len(stages):
            stage = stages[item.stage]
            args = self.args[offset:offset + stage.nargs]
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
        from daskllm.graph.nodes import Joint, Node
        from daskllm.metering import task_keys

        if not batch:
            return
        restrict = {}
        if self.spec.sticky:
            from distributed import get_worker

            restrict = {"workers": [get_worker().address], "allow_other_workers": False}
        nodes = [i.value for i in batch if isinstance(i.value, Node)]
        by_key = {}
        if nodes:
            with config.overriding({"rewrite": self.spec.rewrite} if self.spec.rewrite else {}):
                joint = Joint(nodes)
            self.children |= set(task_keys(joint.lowered.graph))
            for op, n in joint.lowered.report.get("requested", {}).items():
                self.requested[op] = self.requested.get(op, 0) + n
            by_key = dict(zip((n.key for n in joint.nodes), joint.submit(client, **restrict)))
        others = [i for i in batch if not isinstance(i.value, Node)]
        lazies = [i.value if dask.is_dask_collection(i.value) else dask.delayed(i.value) for i in others]
        futures = dict(zip(map(id, others), client.compute(lazies, **restrict))) if others else {}
        for item in batch:
            f = by_key[item.value.key] if isinstance(item.value, Node) else futures[id(item)]
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
        return self.count is not None and len(self.results) + len(self.errors) >= self.count \
            and not self.pending

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
        from distributed import Queue, worker_client

        with worker_client(separate_thread=True) as client:
            q = producer = reader = None
            if self.source.producer_key is not None:
                q = Queue(queue_name(self.source.producer_key, self.source.pos, self.task_key), client=client)
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
        from daskllm.worker import host

        host().usage[self.task_key] = {"op": "pmap", "time": time.time(), "calls": 1,
                                       "items": len(self.results) + len(self.errors),
                                       "requested": dict(self.requested), "children": sorted(self.children),
                                       "first_item_started": self.first_started}
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
            self._events.put(record)

    def _loop(self, client, producer) -> None:
        while True:
            try:
                events = [self._events.get(timeout=0.5)]
            except queue_mod.Empty:
                events = []
            while True:
                try:
                    events.append(self._events.get_nowait())
                except queue_mod.Empty:
                    break
            records = [e for e in events if e is not None]
            if records and self.count is None:
                self._records(records)
            if producer is not None and self.count is None and not records and producer.done():
                if producer.status == "finished":
                    # Items missed (this consumer was restarted, or the decode ran before):
                    # the decode's result has them all, in order.
                    self._add_all(producer.result()[self.source.pos])
                else:
                    try:
                        exc = producer.exception()
                    except BaseException as e:  # noqa: BLE001
                        exc = e
                    raise StreamError(f"stream {self.parent}: the decode {producer.status}: {exc!r}")
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

    def _result(self) -> list:
        n = self.count or 0
        out = [self.errors.get(i, self.results.get(i)) for i in range(n)]
        if self.errors and self.spec.errors == "raise":
            first = min(self.errors)
            exc = self.errors[first]
            raise ItemError(f"{exc} ({len(self.errors)} of {n} items failed; the others finished and are in "
                            f".results)", exc.ancestry, out) from exc
        return out


def _watch(client, key: str):
    """A future for a task this one does not depend on. ``Future(key)`` alone no longer tells
    the scheduler, which then never reports the task's state to this client: ask for it."""
    from distributed import Future

    future = Future(key, client)
    client._send_to_scheduler({"op": "client-desires-keys", "keys": [key], "client": client.id})
    return future


def _cancelled(task_key: str) -> bool:
    try:
        from distributed import get_worker

        ts = get_worker().state.tasks.get(task_key)
    except Exception:  # noqa: BLE001 - not in a worker
        return False
    return ts is None or ts.state in ("cancelled", "released", "forgotten")


def in_cluster() -> bool:
    try:
        from distributed import get_worker

        get_worker()
        return True
    except (ImportError, ValueError):
        return False


# --- queue lifecycle on the scheduler -------------------------------------------------------


class StreamJanitor(SchedulerPlugin):
    """Deletes a stream queue when its consumer task is gone (erred, forgotten), and sweeps
    any whose decode and consumer are both unknown (e.g. a worker died holding it): no queue
    outlives its tasks."""

    name = "daskllm-streams"

    def __init__(self, sweep_interval: float = 5.0):
        self.sweep_interval = sweep_interval
        self.scheduler = None
        self.deleted = 0
        self._lock = threading.Lock()

    async def start(self, scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        self._pc = PeriodicCallback(self.sweep, self.sweep_interval * 1000)
        self._pc.start()

    async def close(self) -> None:
        pc = getattr(self, "_pc", None)
        if pc is not None:
            pc.stop()

    def _queues(self) -> dict:
        ext = (self.scheduler.extensions or {}).get("queues") if self.scheduler is not None else None
        return ext.queues if ext is not None else {}

    def _delete(self, name: str) -> None:
        ext = self.scheduler.extensions["queues"]
        if name in ext.queues:
            ext.client_refcount[name] = 1
            ext.release(name=name)
            self.deleted += 1

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish not in ("erred", "forgotten") or not isinstance(key, str) or not self._queues():
            return
        try:
            for name in list(self._queues()):
                ends = _parse_queue_name(name)
                if ends and key == ends[1]:  # the reader is gone; a decode still running just stops sending
                    self._delete(name)
        except Exception:  # noqa: BLE001 - never disturb the scheduler
            pass

    def sweep(self) -> None:
        try:
            tasks = self.scheduler.tasks
            for name in list(self._queues()):
                ends = _parse_queue_name(name)
                if ends and ends[0] not in tasks and ends[1] not in tasks:
                    self._delete(name)
        except Exception:  # noqa: BLE001
            pass


def stream_queues(dask_scheduler=None) -> list[str]:
    """Names of the stream queues on the scheduler (for tests and monitoring: ``client.run_on_scheduler``)."""
    ext = dask_scheduler.extensions.get("queues")
    return sorted(n for n in (ext.queues if ext else {}) if isinstance(n, str) and n.startswith(QUEUE_PREFIX))


__all__ = ["ANCESTRY", "Consumer", "Delimited", "ItemError", "JSONArray", "Parsed", "PmapSpec", "Source", "Stage",
           "StreamError", "StreamJanitor", "StreamWriter", "delimited", "format_ancestry", "splitter",
           "stream_decode", "stream_queues"]
