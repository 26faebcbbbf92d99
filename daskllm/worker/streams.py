"""The decode side of a stream: each complete item goes to its consumers' queues at once.

With the decode-pipelining pass on, a split decode emits every complete item through a
``distributed.Queue`` as soon as its tokens are decoded (Alto's streaming, Teola's partial
decoding); the consumer (:mod:`daskllm.worker.consumer`) starts that item's work right away.
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import uuid

from distributed import Queue, get_client

from daskllm import config
from daskllm.streaming.split import ItemEmitter, Splitter
from daskllm.streaming.wire import queue_name
from daskllm.worker.host import host, task_priority, wait_requests

class StreamWriter:
    """The decode side: sends each call's new items to its consumers' queues.

    ``channels``: per call (position in this task), the consumer tasks reading it; a consumer
    reading several of this task's calls has one queue for them all. A queue that is gone
    (its consumer finished or was cancelled) is dropped silently: the decode still returns
    its full result.
    """

    def __init__(self, task_key: str, channels: list[list[str]]):
        self.client = get_client()
        self.run = uuid.uuid4().hex[:8]
        self.inline = int(config.get("streaming.inline-bytes"))
        self.task_key = task_key
        opened = {c: self._open(queue_name(task_key, c)) for c in dict.fromkeys(c for cs in channels for c in cs)}
        self.queues: dict[int, list] = {pos: [opened[c] for c in consumers if opened[c] is not None]
                                        for pos, consumers in enumerate(channels)}
        self.pending: dict = {}  # queue -> envelopes not sent yet

    def _open(self, name: str):
        try:
            return Queue(name, client=self.client)
        except Exception:  # noqa: BLE001 - scheduler unreachable: the consumer falls back to the result
            return None

    def _put(self, positions, envelope: tuple) -> None:
        """Buffer an envelope for the queues of ``positions``' consumers; :meth:`flush` sends."""
        for q in dict.fromkeys(q for pos in positions for q in self.queues.get(pos, ())):
            self.pending.setdefault(q, []).append(list(envelope))

    def flush(self) -> None:
        """Send what is buffered: one queue message per consumer, however many items of this
        task's calls completed since the last flush (a decode step completes items of many
        calls at once; their consumer then plans them together)."""
        pending, self.pending = self.pending, {}
        for q, envelopes in pending.items():
            try:
                q.put(envelopes)
            except Exception:  # noqa: BLE001 - queue deleted: nobody listens any more
                for qs in self.queues.values():
                    if q in qs:
                        qs.remove(q)

    def item(self, pos: int, index: int, value) -> None:
        payload = pickle.dumps(value, protocol=5)
        if len(payload) > self.inline:
            [future] = self.client.scatter([value], hash=False)
            self.flush()  # the future goes just before its envelope
            for q in self.queues.get(pos, ()):
                try:
                    q.put(future)
                except Exception:  # noqa: BLE001 - the envelope's put drops the queue
                    pass
            self._put([pos], ("ref", pos, index, future.key, self.run))
        else:
            self._put([pos], ("item", pos, index, payload, self.run))

    def end(self, pos: int, count: int) -> None:
        self._put([pos], ("end", pos, count, None, self.run))

    def error(self, message: str) -> None:
        self._put(list(self.queues), ("error", None, message, None, self.run))
        self.flush()

    def close(self) -> None:
        for q in dict.fromkeys(q for qs in self.queues.values() for q in qs):
            try:
                q.close()
            except Exception:  # noqa: BLE001
                pass
        self.queues = {}


def stream_decode(task_key: str, engine, prompts: list, sampling, split: Splitter, writer: StreamWriter | None) -> list:
    """Generate for ``prompts`` together; send items as they complete. Returns the completions.
    If the task ``task_key`` is cancelled meanwhile, its engine requests are."""
    if writer is None:
        return wait_requests(task_key, engine.submit_many(prompts, sampling, priority=task_priority(task_key)))
    deltas: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    futures: list = []
    with host().abortable(task_key, lambda: [f.cancel() for f in futures]):
        return _stream(engine, prompts, sampling, split, writer, deltas, futures, task_priority(task_key))


def _stream(engine, prompts: list, sampling, split: Splitter, writer: StreamWriter, deltas, futures: list,
            priority: int) -> list:
    try:
        for pos, p in enumerate(prompts):
            # Engine callbacks only enqueue: queue round trips must not slow the engine loop.
            futures.append(engine.submit(p, sampling, on_text=lambda d, pos=pos: deltas.put((pos, d)),
                                         priority=priority))
            futures[-1].add_done_callback(lambda _, pos=pos: deltas.put((pos, None)))
        texts = [""] * len(prompts)
        emitters = [ItemEmitter(split, lambda i, v, pos=pos: writer.item(pos, i, v)) for pos in range(len(prompts))]
        open_ = len(prompts)
        while open_:
            arrived = [deltas.get()]
            while True:  # and whatever else this engine step gave: sent together
                try:
                    arrived.append(deltas.get_nowait())
                except queue_mod.Empty:
                    break
            for pos, delta in arrived:
                if delta is None:
                    open_ -= 1
                    continue
                texts[pos] += delta
                try:
                    emitters[pos].update(texts[pos])
                except ValueError:
                    pass  # the final check below reports it, with the whole text
            writer.flush()
        completions = [f.result() for f in futures]
        for pos, c in enumerate(completions):
            items = emitters[pos].update(c.text, final=True)
            writer.end(pos, len(items))
        writer.flush()
        return completions
    except BaseException as exc:
        writer.error(f"{type(exc).__name__}: {exc}")
        raise
