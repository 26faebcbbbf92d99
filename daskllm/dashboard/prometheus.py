"""The LLM counters for Prometheus, on the scheduler's ``/metrics`` (names ``daskllm_*``).

They come from the shared, rate-limited snapshot (:mod:`daskllm.dashboard.cache`), like the
page and the JSON route, so scrapes cost no more than one snapshot per refresh interval.
"""

from __future__ import annotations

from daskllm.dashboard.cache import snapshot

COUNTERS = {
    "prefill_tokens_computed": ("daskllm_prefill_tokens_computed", "Prompt tokens computed by prefill"),
    "prefill_tokens_cached": ("daskllm_prefix_cache_hits", "Prompt tokens served from the prefix cache"),
    "decode_tokens": ("daskllm_decode_tokens", "Tokens generated"),
    "requests_finished": ("daskllm_requests_finished", "Requests finished"),
    "requests_failed": ("daskllm_requests_failed", "Requests failed"),
    "preemptions": ("daskllm_preemptions", "Sequences preempted for cache space"),
    "evicted_blocks": ("daskllm_evicted_blocks", "Prefix-cache blocks evicted"),
}
GAUGES = {
    "running": ("daskllm_requests_running", "Requests in the running batch"),
    "waiting": ("daskllm_requests_waiting", "Requests waiting for the engine"),
    "cache_blocks_used": ("daskllm_cache_blocks_used", "KV-cache blocks in use"),
    "cache_blocks_total": ("daskllm_cache_blocks_total", "KV-cache blocks in all"),
    "mean_batch_size": ("daskllm_mean_batch_size", "Mean sequences per engine step"),
}


class PrometheusCollector:
    """A ``prometheus_client`` collector reading one scheduler (the latest installed)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # optional dependency

        families = {k: CounterMetricFamily(name, doc, labels=["worker", "model"]) for k, (name, doc) in
                    COUNTERS.items()}
        families.update({k: GaugeMetricFamily(name, doc, labels=["worker", "model"]) for k, (name, doc) in
                         GAUGES.items()})
        snap = snapshot(self.scheduler)
        for worker, w in snap["workers"].items():
            for name, engine in w["engines"].items():
                if engine["kind"] != "llm":
                    continue
                for key, family in families.items():
                    if engine.get(key) is not None:
                        family.add_metric([worker, name], float(engine[key]))
        yield from families.values()
        decisions = CounterMetricFamily("daskllm_placement_decisions", "Tasks placed by the placement plugin",
                                        labels=["reason"])
        for reason, n in snap["placement"]["decisions"].items():
            decisions.add_metric([reason], float(n))
        yield decisions


__all__ = ["PrometheusCollector"]
