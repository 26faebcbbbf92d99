"""LLM metrics on the scheduler: what workers report with their heartbeats, as one snapshot.

Workers send their engines' counters and gauges (``ws.metrics["daskllm"]``, see
:mod:`daskllm.worker`) with every heartbeat. :class:`MetricsHistory` turns successive
snapshots into rates (prefill and decode tokens/s) and keeps a short time series for the
dashboard page; :func:`build_snapshot` makes what ``/llm/metrics.json`` returns, the page
draws and :mod:`daskllm.dashboard.prometheus` exports (all through the cache in
:mod:`daskllm.dashboard.cache`).
Everything here only reads scheduler state.
"""

from __future__ import annotations

import threading
import time
from collections import deque

COUNTERS = ("prefill_tokens_computed", "prefill_tokens_cached", "decode_tokens", "requests_finished",
            "requests_failed", "steps", "preemptions", "evicted_blocks")
GAUGES = ("running", "waiting", "cache_blocks_used", "cache_blocks_total", "mean_batch_size",
          "prefix_cache_hit_rate")


def engines_of(scheduler) -> dict:
    """worker -> {"llm"/"embed"/"rerank": {engine: stats}} from the last heartbeats."""
    out = {}
    for address, ws in scheduler.workers.items():
        metrics = (ws.metrics or {}).get("daskllm")
        if metrics:
            out[address] = metrics
    return out


class MetricsHistory:
    """Rates from counter deltas over windows of at least ``window`` seconds (workers report
    once per heartbeat, and several readers ask at their own pace), and a bounded time series."""

    def __init__(self, length: int = 600, window: float = 1.0):
        self.window = window
        self.previous: dict = {}  # (worker, engine) -> (time, counters) at the window's start
        self.rates: dict = {}  # (worker, engine) -> rates over the last complete window
        self.series: deque = deque(maxlen=length)  # (time, {worker: {engine: {rates...}}})
        self._lock = threading.Lock()

    def update(self, scheduler) -> dict:
        now = time.time()
        rates: dict = {}
        with self._lock:
            for worker, metrics in engines_of(scheduler).items():
                for name, stats in (metrics.get("engines") or {}).get("llm", {}).items():
                    key = (worker, name)
                    counters = {c: stats.get(c, 0) for c in COUNTERS}
                    before = self.previous.get(key)
                    if before is None:
                        self.previous[key] = (now, counters)
                    elif now - before[0] >= self.window:
                        dt = now - before[0]
                        rate = {f"{c}_per_s": max(0.0, (counters[c] - before[1][c]) / dt) for c in COUNTERS}
                        rate["prefill_tokens_per_s"] = rate["prefill_tokens_computed_per_s"] + \
                            rate["prefill_tokens_cached_per_s"]
                        self.rates[key] = rate
                        self.previous[key] = (now, counters)
                    rates.setdefault(worker, {})[name] = self.rates.get(key) or _zero_rates()
            self.series.append((now, rates))
        return rates


def _zero_rates() -> dict:
    return {**{f"{c}_per_s": 0.0 for c in COUNTERS}, "prefill_tokens_per_s": 0.0}


_history = MetricsHistory()


def build_snapshot(scheduler) -> dict:
    """Everything the page shows, as plain JSON: per worker engines, GPUs, indexes; placement.
    Readers take it through :func:`daskllm.dashboard.cache.snapshot`, which calls this at a
    bounded rate (each call also adds a point to the rates' time series)."""
    rates = _history.update(scheduler)
    workers = {}
    for worker, metrics in engines_of(scheduler).items():
        engines = {}
        for kind, by_name in (metrics.get("engines") or {}).items():
            for name, stats in by_name.items():
                entry = {"kind": kind, **{k: stats.get(k) for k in COUNTERS + GAUGES if k in stats}}
                entry.update(rates.get(worker, {}).get(name, {}) if kind == "llm" else {})
                engines[name] = entry
        workers[worker] = {"engines": engines, "models": metrics.get("models", {}),
                           "indexes": metrics.get("indexes", {}),
                           **({"gpu": metrics["gpu"]} if metrics.get("gpu") else {})}
    placement = scheduler.plugins.get("daskllm-placement")
    return {"time": time.time(), "workers": workers,
            "placement": {"policy": getattr(placement, "policy", None),
                          "decisions": dict(getattr(placement, "decisions", {}) or {}),
                          "queued_tokens": dict(getattr(placement, "queued", {}) or {})}}
