"""Queue lifecycle on the scheduler: no stream queue outlives its tasks."""

from __future__ import annotations

import threading

from distributed import SchedulerPlugin

from tornado.ioloop import PeriodicCallback

from daskllm.streaming.wire import parse_queue_name


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
                ends = parse_queue_name(name)
                if ends and key == ends[1]:  # the reader is gone; a decode still running just stops sending
                    self._delete(name)
        except Exception:  # noqa: BLE001 - never disturb the scheduler
            pass

    def sweep(self) -> None:
        try:
            tasks = self.scheduler.tasks
            for name in list(self._queues()):
                ends = parse_queue_name(name)
                if ends and ends[0] not in tasks and ends[1] not in tasks:
                    self._delete(name)
        except Exception:  # noqa: BLE001
            pass
