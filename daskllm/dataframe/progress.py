"""A progress bar for a table job: the LLM calls done out of those the cost preview expects
(with an ETA from the measured rate), and the calls and tokens done so far, in a terminal or a
notebook (``tqdm.auto``).

    out = daskllm.dataframe.progress(ddf.llm.map("Summarize {doc}:", out="summary"))
    out.to_parquet("summaries/")  # the persisted result: nothing runs twice

The bar counts calls, not partitions: every call of a table job runs behind its dedupe step,
so the partitions finish together at the end and a bar of partitions would jump from 0 to
100%. Its total is :func:`~daskllm.dataframe.estimate.estimate`'s calls to execute (distinct
inputs not in the result store; an upper bound for an operator that reads another's answers),
computed before the job starts; a job without LLM calls (embeddings only) counts partitions.

It moves as the engines finish requests: their counters travel to the scheduler with every
worker heartbeat (``EngineHost.metrics``), and the bar asks the scheduler for them, never a
worker, so a worker that dies or restarts costs the bar nothing (its last report is kept). The
question runs in a thread of its own, one at a time: a scheduler slow to answer delays the
numbers, never the job, and an error is skipped. Its ETA comes from the rate measured since
the first calls finished. At the end the bar takes the exact counts from the usage records
the scheduler keeps (rows, calls, tokens: :func:`daskllm.usage`'s, a lost worker's work
included) and ends at the real count, never below what it showed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dask.base import is_dask_collection
from distributed import default_client, futures_of
from tqdm.auto import tqdm

from daskllm.dataframe.estimate import estimate, operator_calls, operator_of
from daskllm.ops.generate import GENERATE
from daskllm.runtime.metering import usage_since

COUNTERS = ("requests_finished", "prefill_tokens_computed", "decode_tokens")
FINAL_WAIT = 10.0  # seconds the end of the bar waits for the workers' exact counts


def progress(collection, *, interval: float = 0.5, file=None, client=None):
    """Run ``collection`` (a dask dataframe or series, persisted here if it is not yet) with a
    progress bar; return it persisted. Raises the job's error, with the bar closed, if it fails;
    the bar itself never raises into the job."""
    if not is_dask_collection(collection):
        raise TypeError(f"progress: expected a dask collection, got {type(collection).__name__}")
    client = client if client is not None else default_client()
    calls = operator_calls(collection)
    first = operator_of(calls[0])[0].name if calls else None
    expected = expected_calls(collection) if calls else 0
    engines = Poll(lambda: client.run_on_scheduler(engine_counters))
    tally = Tally(engines.wait(FINAL_WAIT))  # the counters before the job: the bar counts from them
    started = time.time()
    persisted = collection if futures_of(collection) else client.persist(collection)
    futures = futures_of(persisted)
    unit, total = ("call", expected) if expected else ("part", len(futures))
    with Bar(total=total, unit=unit, desc="ddf.llm", file=file, dynamic_ncols=True) as bar:
        while True:
            states = [f.status for f in futures]
            failed = next((f for f, s in zip(futures, states) if s in ("error", "cancelled")), None)
            if failed is not None:
                failed.result()  # raises the job's error (or CancelledError)
            finished = states.count("finished")
            tally.update(engines.latest())
            if finished == len(futures):
                done = final_counts(started, first) or tally.done()
                bar.set_postfix(done, refresh=False)
                if unit == "call":
                    # The real count, where the preview gave a bound; never below what the bar showed.
                    bar.total = max(done["calls"], bar.n)
                bar.update(bar.total - bar.n)
                return persisted
            live = tally.done()
            bar.set_postfix(live, refresh=False)
            count = min(live["calls"], max(total - 1, 0)) if unit == "call" else finished
            bar.update(max(0, count - bar.n))
            bar.measured.update(bar.n, time.monotonic())
            bar.refresh()
            time.sleep(interval)  # a poll of local future states, not a synchronization


def expected_calls(collection) -> int:
    """The calls the cost preview expects the job to execute; 0 if it cannot say."""
    try:
        preview = estimate(collection)
    except Exception:  # noqa: BLE001 - a preview that fails costs the bar its total, never the job
        return 0
    return sum(o.distinct - o.cache_hits for o in preview.operators if o.output_tokens is not None)


@dataclass(slots=True)
class MeasuredRate:
    """Calls per second since the first calls finished: what the job does once its engines
    work, without the start (planning, the dedupe step, engines warming up) that comes before.
    tqdm's own rate smooths the last few refreshes, which an engine batch finishing at once
    (a jump) or a lost worker's calls being redone (a pause) throws far off."""

    first: tuple[int, float] | None = None  # (count, time) when the count first moved
    last: tuple[int, float] | None = None

    def update(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self.first is None:
            self.first = (count, now)
        self.last = (count, now)

    def per_second(self) -> float | None:
        if self.first is None or self.last is None or self.last[1] <= self.first[1] or self.last[0] <= self.first[0]:
            return None
        return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])


class Bar(tqdm):
    """tqdm with its rate, and so its ETA, from :class:`MeasuredRate` (tqdm's own average
    since the start until the count has moved twice)."""

    def __init__(self, *args, **kwargs):
        self.measured = MeasuredRate()
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        rate = self.measured.per_second()
        if rate is not None:
            d["rate"] = rate
        return d


class Poll:
    """``fetch()`` asked in a daemon thread, one question at a time; :meth:`latest` never waits."""

    def __init__(self, fetch: Callable[[], object]):
        self._fetch = fetch
        self._thread: threading.Thread | None = None
        self._answer = None

    def _ask(self) -> None:
        def run():
            try:
                self._answer = self._fetch()
            except Exception:  # noqa: BLE001 - a lost worker, a closed comm, a timeout: no numbers this time
                self._answer = None
        self._answer = None
        self._thread = threading.Thread(target=run, name="daskllm-progress", daemon=True)
        self._thread.start()

    def latest(self):
        """The answer that has come since the last call (None if none), asking again if none is pending."""
        if self._thread is not None and self._thread.is_alive():
            return None
        answer = self._answer if self._thread is not None else None
        self._ask()
        return answer

    def wait(self, timeout: float):
        """Ask and wait at most ``timeout`` seconds for the answer (None if none came)."""
        if self._thread is None or not self._thread.is_alive():
            self._ask()
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._answer


@dataclass(slots=True)
class Tally:
    """The engines' work since the job started, from snapshots ``{worker id: {counter: value}}``.
    A worker that leaves keeps its last counts (that work was done); one that joins later counts
    from zero; the first snapshot is the baseline when none was taken before the job."""

    baseline: dict | None
    last: dict = field(default_factory=dict)

    def update(self, snapshot: dict | None) -> None:
        if snapshot is None:
            return
        if self.baseline is None:
            self.baseline = snapshot
        self.last.update(snapshot)

    def done(self) -> dict:
        base = self.baseline or {}
        since = {c: sum(max(0, v.get(c, 0) - base.get(w, {}).get(c, 0)) for w, v in self.last.items())
                 for c in COUNTERS}
        return {"calls": since["requests_finished"],
                "tokens": since["prefill_tokens_computed"] + since["decode_tokens"]}


def engine_counters(dask_scheduler=None) -> dict:
    """On the scheduler: per worker (by its process id, new after a restart), its LLM engines'
    counters summed, as its last heartbeat reported them."""
    out = {}
    for ws in dask_scheduler.workers.values():
        llm = (((ws.metrics or {}).get("daskllm") or {}).get("engines") or {}).get("llm") or {}
        out[ws.server_id] = {c: sum(int(e.get(c, 0)) for e in llm.values()) for c in COUNTERS}
    return out


def final_counts(started: float, operator: str | None) -> dict | None:
    """Rows the job's first operator looked up, calls executed and tokens computed, from the
    usage records the scheduler keeps (those of workers that died too), as
    :func:`daskllm.usage` counts them; None if they do not come within :data:`FINAL_WAIT` seconds."""
    used = Poll(lambda: usage_since(started)).wait(FINAL_WAIT)
    if used is None:
        return None
    return {"rows": used.operators.get(operator, {}).get("rows", 0), "calls": used.executed.get(GENERATE.name, 0),
            "tokens": used.prefill_tokens_computed + used.decode_tokens}
