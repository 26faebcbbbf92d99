"""Where a run's wall time went, from Dask's own instruments.

A run is wrapped in a ``distributed.span``; the scheduler's span then holds the workers' fine
performance metrics for every task of the run (sent with heartbeats): per task prefix, the
seconds worker threads spent computing (``thread-cpu``), blocked (``thread-noncpu``: a task
waiting on its engine, on a queue or on nested work) and in Dask's own task overhead
(``executor``, ``other``, deserialization), and the seconds threads sat idle. The engines'
``busy_seconds`` counters say how long they computed. What no task covers (the time before
the first task starts and after the last ends: planning on the client, submission,
scheduling, gathering results) is the wall time minus the tasks' window, from the task
stream (``tasks_window``).

    with attributed(client, "daskllm") as found:
        run()
    found["attribution"]  # seconds by category, see ``summarize``
"""

from __future__ import annotations

import contextlib
import time

from distributed import get_task_stream, span

# Task prefixes whose threads wait on an engine (the lowered task types).
ENGINE_TASKS = ("decode", "prefill", "embed", "search", "rerank")
STREAM_TASKS = ("pmap", "stream")


def span_metrics(span_id: str, dask_scheduler=None) -> dict:
    """The span's duration and its cumulative worker metrics, on the scheduler."""
    found = dask_scheduler.extensions["spans"].spans.get(span_id)
    if found is None:
        return {"duration": 0.0, "metrics": [], "groups": []}
    return {"duration": found.duration,
            "metrics": [[list(k), v] for k, v in found.cumulative_worker_metrics.items()],
            "groups": sorted({str(g.name) for g in found.traverse_groups()})}


def tasks_window(task_stream: list[dict]) -> float:
    """Seconds from the first task's start to the last task's end (``get_task_stream`` records)."""
    spans = [(ss["start"], ss["stop"]) for t in task_stream for ss in t.get("startstops", ())
             if ss.get("action") == "compute"]
    return max(stop for _, stop in spans) - min(start for start, _ in spans) if spans else 0.0


def summarize(metrics: list, window: float, wall: float, engine_busy: float, engines: int,
              thread_count: int) -> dict:
    """Seconds by category. ``outside_tasks`` + ``window`` is the wall time; the thread
    categories add up to about ``thread_count x window``; ``engine_busy`` + ``engine_idle`` to
    ``engines x wall``."""
    out = {"wall": wall, "tasks_window": window, "outside_tasks": max(0.0, wall - window),
           "engine_busy": engine_busy, "engine_idle": max(0.0, engines * wall - engine_busy),
           "threads_engine_wait": 0.0, "threads_stream_wait": 0.0, "threads_other_wait": 0.0,
           "threads_cpu": 0.0, "threads_dask_overhead": 0.0, "threads_idle": 0.0}
    for key, value in metrics:
        context, prefix, activity, unit = key
        if context != "execute" or unit != "seconds":
            continue
        if activity == "idle or other spans":
            out["threads_idle"] += value
        elif activity == "thread-cpu":
            out["threads_cpu"] += value
        elif activity == "thread-noncpu":
            kind = ("threads_engine_wait" if prefix in ENGINE_TASKS
                    else "threads_stream_wait" if prefix in STREAM_TASKS else "threads_other_wait")
            out[kind] += value
        else:  # executor, other, deserialize, memory-read, ...: Dask's cost of running the task
            out["threads_dask_overhead"] += value
    out["thread_count"] = thread_count
    return out


def _complete(found: dict) -> bool:
    """Every task group of the span has reported its execute metrics (they come with heartbeats)."""
    reported = {k[1] for k, _ in found["metrics"] if k[0] == "execute"}
    return all(g in reported for g in found["groups"] if not g.startswith("finalize"))


@contextlib.contextmanager
def attributed(client, name: str, engine_busy=None, timeout: float = 15.0):
    """Run the block in a span, with a task stream; on exit ``found["attribution"]`` holds
    ``summarize``'s categories. ``engine_busy()`` returns the engines' summed busy seconds and
    their count."""
    found: dict = {}
    busy_before, engines = engine_busy() if engine_busy else (0.0, 0)
    start = time.perf_counter()
    with span(f"bench-{name}") as span_id, get_task_stream(client) as stream:
        yield found
    wall = time.perf_counter() - start
    busy_after, engines = engine_busy() if engine_busy else (0.0, 0)
    deadline = time.monotonic() + timeout
    metrics = client.run_on_scheduler(span_metrics, span_id=span_id)
    while not _complete(metrics) and time.monotonic() < deadline:
        time.sleep(0.2)  # the workers' next heartbeat brings the rest
        metrics = client.run_on_scheduler(span_metrics, span_id=span_id)
    threads = sum(w["nthreads"] for w in client.scheduler_info(n_workers=-1)["workers"].values())
    found["attribution"] = summarize(metrics["metrics"], tasks_window(stream.data), wall,
                                     busy_after - busy_before, engines, threads)
    found["attribution"]["complete"] = _complete(metrics)
