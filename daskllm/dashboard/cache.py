"""The metrics snapshot every reader shares, rebuilt at most once per refresh interval.

The JSON route, the Prometheus collector and every open page read it through
:func:`snapshot`, so a storm of requests costs one :func:`~daskllm.dashboard.metrics.build_snapshot`
per ``daskllm.dashboard.refresh`` seconds per scheduler, not one per request: these readers
run on the scheduler's event loop, and monitoring must not slow scheduling.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from dask.utils import parse_timedelta

from daskllm import config
from daskllm.dashboard.metrics import build_snapshot


def refresh_interval() -> float:
    """Seconds between two snapshot builds (``daskllm.dashboard.refresh``)."""
    return parse_timedelta(config.get("dashboard.refresh"), default="s")


class SnapshotCache:
    """The last snapshot of one scheduler and when it was built; ``builds`` counts the builds."""

    def __init__(self, build: Callable[[object], dict] = build_snapshot, clock: Callable[[], float] = time.monotonic):
        self.build = build
        self.clock = clock
        self.builds = 0
        self._value: dict | None = None
        self._built_at = 0.0
        self._lock = threading.Lock()  # readers on other threads (tests, a collector) wait for one build

    def get(self, scheduler) -> dict:
        interval = refresh_interval()
        with self._lock:
            now = self.clock()
            if self._value is None or now - self._built_at >= interval:
                self._value = self.build(scheduler)
                self._built_at = now
                self.builds += 1
            return self._value


# One cache per scheduler (several can share a process, as in tests); weak, so a closed
# scheduler's entry goes with it.
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_of(scheduler) -> SnapshotCache:
    cache = _caches.get(scheduler)
    if cache is None:
        cache = _caches[scheduler] = SnapshotCache()
    return cache


def snapshot(scheduler) -> dict:
    """The scheduler's metrics snapshot, at most ``daskllm.dashboard.refresh`` seconds old.
    Shared by every reader: do not change it."""
    return cache_of(scheduler).get(scheduler)


__all__ = ["SnapshotCache", "cache_of", "refresh_interval", "snapshot"]
