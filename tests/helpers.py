"""Helpers shared by the cluster tests."""

from __future__ import annotations

import time

from distributed.utils_test import poll_for

from daskllm.placement import set_policy  # noqa: F401 (tests import it from here)
from daskllm.rewrite.cache import RESULTS
from daskllm.worker import reset_prefix_caches


def cold_start(client) -> None:
    """Empty result and prefix caches, and wait until the scheduler's view says so too.

    Also wait until the previous computation's tasks are forgotten: results still in the
    scheduler would be reused by an identical graph instead of being computed again.
    """
    RESULTS.clear()

    def leftovers(dask_scheduler):
        return sum(1 for ts in dask_scheduler.tasks.values() if not ts.who_wants)

    deadline = time.monotonic() + 15
    while client.run_on_scheduler(leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)

    def reported(dask_scheduler):
        return sum(len(h) for ws in dask_scheduler.workers.values()
                   for h in ((ws.metrics or {}).get("daskllm") or {}).get("cache", {}).values())

    def empty():
        client.run(reset_prefix_caches)  # again: a request still running (e.g. cancelled) keeps its blocks
        return client.run_on_scheduler(reported) == 0

    poll_for(empty, timeout=30, period=0.5)


