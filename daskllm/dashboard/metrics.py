"""LLM metrics on the scheduler: what workers report with their heartbeats, as one snapshot.

Workers send their engines' counters and gauges (``ws.metrics["daskllm"]``, see
:mod:`daskllm.worker`) with every heartbeat. :class:`MetricsHistory` turns successive
snapshots into rates (prefill and decode tokens/s) and keeps a short time series for the
dashboard page; :func:`snapshot` is what ``/llm/metrics.json`` returns and
:class:`PrometheusCollector` exports the same counters on the scheduler's ``/metrics``.
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


def snapshot(scheduler) -> dict:
    """Everything the page shows, as plain JSON: per worker engines, GPUs, indexes; placement."""
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


class PrometheusCollector:
    """The same counters for Prometheus, on the scheduler's ``/metrics`` (names ``daskllm_*``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # optional dependency

        counters = {
            "prefill_tokens_computed": ("daskllm_prefill_tokens_computed", "Prompt tokens computed by prefill"),
            "prefill_tokens_cached": ("daskllm_prefix_cache_hits", "Prompt tokens served from the prefix cache"),
            "decode_tokens": ("daskllm_decode_tokens", "Tokens generated"),
            "requests_finished": ("daskllm_requests_finished", "Requests finished"),
            "requests_failed": ("daskllm_requests_failed", "Requests failed"),
            "preemptions": ("daskllm_preemptions", "Sequences preempted for cache space"),
            "evicted_blocks": ("daskllm_evicted_blocks", "Prefix-cache blocks evicted"),
        }
        gauges = {
            "running": ("daskllm_requests_running", "Requests in the running batch"),
            "waiting": ("daskllm_requests_waiting", "Requests waiting for the engine"),
            "cache_blocks_used": ("daskllm_cache_blocks_used", "KV-cache blocks in use"),
            "cache_blocks_total": ("daskllm_cache_blocks_total", "KV-cache blocks in all"),
            "mean_batch_size": ("daskllm_mean_batch_size", "Mean sequences per engine step"),
        }
        families = {k: CounterMetricFamily(name, doc, labels=["worker", "model"]) for k, (name, doc) in
                    counters.items()}
        families.update({k: GaugeMetricFamily(name, doc, labels=["worker", "model"]) for k, (name, doc) in
                         gauges.items()})
        for worker, metrics in engines_of(self.scheduler).items():
            for name, stats in (metrics.get("engines") or {}).get("llm", {}).items():
                for key, family in families.items():
                    if key in stats:
                        family.add_metric([worker, name], float(stats[key]))
        yield from families.values()
        placement = self.scheduler.plugins.get("daskllm-placement")
        decisions = CounterMetricFamily("daskllm_placement_decisions", "Tasks placed by the placement plugin",
                                        labels=["reason"])
        for reason, n in dict(getattr(placement, "decisions", {}) or {}).items():
            decisions.add_metric([reason], float(n))
        yield decisions
