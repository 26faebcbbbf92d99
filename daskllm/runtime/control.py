"""Cluster-wide controls a script or benchmark runs from the client."""

from __future__ import annotations

import time

from daskllm.worker.control import clear_results, reset_prefix_caches
from daskllm.worker.results import RESULTS


def cold_start(client, timeout: float = 30) -> None:
    """Empty every cache a computation could reuse, for measurements from cold: the result
    caches of the client and of every worker (nested plans run there) and the workers' prefix
    caches, once the previous computation's tasks are forgotten (results still held by the
    scheduler would be reused by an identical graph), until the scheduler's view of the
    caches is empty too."""

    def leftovers(dask_scheduler):
        # Only tasks that hold or will produce a value: a failed computation leaves its erred
        # tasks and their released neighbours in the scheduler for good, with nothing to reuse.
        return sum(1 for ts in dask_scheduler.tasks.values()
                   if not ts.who_wants and ts.state in ("memory", "processing", "waiting", "queued", "no-worker"))

    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)
    RESULTS.clear()
    client.run(clear_results)

    def reported(dask_scheduler):
        return sum(len(h) for ws in dask_scheduler.workers.values()
                   for h in ((ws.metrics or {}).get("daskllm") or {}).get("cache", {}).values())

    deadline = time.monotonic() + timeout
    while True:
        client.run(reset_prefix_caches)  # again: a request still running (e.g. cancelled) keeps its blocks
        if client.run_on_scheduler(reported) == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefix caches still reported non-empty after {timeout} s")
        time.sleep(0.5)
