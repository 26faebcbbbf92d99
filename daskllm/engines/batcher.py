"""A background thread that runs requests from many threads in shared batches.

Requests arriving while a batch runs are queued and go together into the next one, up to a
size limit: the same continuous batching the LLM engine does, for one-shot models
(embedding, reranking) where a request needs a single forward pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

from daskllm.engines import compute
from daskllm.engines.lifecycle import close_at_exit

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


class BatcherClosed(RuntimeError):
    pass


class Batcher(Generic[Item, Result]):
    """Runs ``run_batch(items) -> results`` on a background thread over queued requests.

    A request is a list of items; its future resolves to the list of their results. Items
    of one request always go to the same batch unless the request alone exceeds the limit.
    """

    def __init__(self, run_batch: Callable[[list[Item]], Sequence[Result]], *, max_batch_items: int,
                 cost: Callable[[Item], int] = lambda item: 1, name: str = "batcher"):
        self._run_batch = run_batch
        self._cost = cost
        self.max_batch_items = max_batch_items
        self._queue: deque[tuple[list[Item], Future]] = deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self.requests = self.items = self.batches = self.failed = 0
        self.busy_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"daskllm-{name}", daemon=True)
        self._thread.start()
        close_at_exit(self)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def submit(self, items: list[Item]) -> Future[list[Result]]:
        future: Future[list[Result]] = Future()
        with self._wakeup:
            if self._closed:
                raise BatcherClosed("this engine is closed")
            self._queue.append((list(items), future))
            self.requests += 1
            self._wakeup.notify()
        return future

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()
        self._thread.join()
        while self._queue:
            _, future = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(BatcherClosed("engine closed"))

    def _next_batch(self) -> list[tuple[list[Item], Future]]:
        batch, budget = [], self.max_batch_items
        while self._queue:
            items, future = self._queue[0]
            cost = sum(self._cost(i) for i in items)
            if batch and cost > budget:
                break
            self._queue.popleft()
            if future.set_running_or_notify_cancel():  # skip cancelled requests
                batch.append((items, future))
                budget -= cost
        return batch

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not self._queue:
                    self._wakeup.wait()
                if self._closed:
                    return
                batch = self._next_batch()
            if batch:
                self._run(batch)
            # Nothing of a finished batch (results may be big, or hold futures that keep
            # their keys alive) stays referenced while the loop waits for the next.
            del batch

    def _run(self, batch: list[tuple[list[Item], Future]]) -> None:
        flat = [item for items, _ in batch for item in items]
        start = time.perf_counter()
        try:
            results = list(compute.run(self._run_batch, flat))  # the process's compute thread: compute.py
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("%s: batch failed", self._thread.name)
            self.failed += len(batch)
            for _, future in batch:
                future.set_exception(exc)
            return
        self.busy_seconds += time.perf_counter() - start
        self.batches += 1
        self.items += len(flat)
        offset = 0
        for items, future in batch:
            future.set_result(results[offset:offset + len(items)])
            offset += len(items)
