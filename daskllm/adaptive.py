"""Adaptive scaling that sees LLM work: the scheduler's ``adaptive_target`` counts engine requests.

Dask's target (what ``cluster.adapt()``, dask-jobqueue and the dask-kubernetes operator's
autoscaler ask the scheduler for) counts the seconds of work worker threads hold. An LLM task
gives its thread back while its engine works (secede), so Dask sees no work and never scales
up for it. :class:`AdaptiveTarget` makes the target at least one worker per
``requests_per_worker`` requests the workers' LLM engines hold, running or waiting (from their
heartbeat metrics); scaling down stays Dask's (idle workers are retired). It replaces the
scheduler's method and RPC handler, since Dask has no hook for the target.
"""

from __future__ import annotations

import math

from distributed import SchedulerPlugin

from daskllm.engines import sizing


class AdaptiveTarget(SchedulerPlugin):
    name = "daskllm-adaptive"

    def __init__(self, requests_per_worker: int | None = None):
        # An engine batches up to max-num-seqs sequences a step; beyond, requests wait. The
        # scheduler does not know its workers' devices: auto counts a CPU engine's batch.
        self.requests_per_worker = sizing.limit(requests_per_worker, "max-num-seqs", on_cpu=True)

    async def start(self, scheduler) -> None:
        dask_target = scheduler.adaptive_target

        def adaptive_target(target_duration=None) -> int:
            return max(dask_target(target_duration), math.ceil(self.requests(scheduler) / self.requests_per_worker))

        # The method serves the HTTP API (/api/v1/adaptive_target), the handler the RPC (Adaptive).
        scheduler.adaptive_target = adaptive_target
        scheduler.handlers["adaptive_target"] = adaptive_target

    @staticmethod
    def requests(scheduler) -> int:
        """LLM requests in the workers' engines, running or waiting, as of their last heartbeats."""
        return sum(engine.get("running", 0) + engine.get("waiting", 0)
                   for ws in scheduler.workers.values()
                   for engine in ((ws.metrics or {}).get("daskllm") or {}).get("engines", {}).get("llm", {}).values())
