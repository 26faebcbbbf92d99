"""A progress bar for a table job: the LLM calls done out of those the cost preview expects
(with an ETA), and the rows, calls and tokens done so far, in a terminal or a notebook
(``tqdm.auto``).

    out = daskllm.dataframe.progress(ddf.llm.map("Summarize {doc}:", out="summary"))
    out.to_parquet("summaries/")  # the persisted result: nothing runs twice

The bar counts calls, not partitions: every call of a table job runs behind its dedupe step,
so the partitions finish together at the end and a bar of partitions would jump from 0 to
100%. Its total is :func:`~daskllm.dataframe.estimate.estimate`'s calls to execute (distinct
inputs not in the result store; an upper bound for an operator that reads another's answers),
computed before the job starts; a job without LLM calls (embeddings only) counts partitions.
Calls, rows and tokens come from the usage records the workers keep (one ``client.run`` per
tick, at most ``1 / interval`` ticks a second). The bar ends when the job does (at its real
count, where the total was a bound), or raises its error.
"""

from __future__ import annotations

import time

from dask.base import is_dask_collection
from distributed import default_client, futures_of
from tqdm.auto import tqdm

from daskllm.annotations import DECODE_TASK
from daskllm.dataframe.estimate import estimate, operator_calls, operator_of
from daskllm.worker.host import PLUGIN_NAME
from daskllm.worker.usage import DATAFRAME


def progress(collection, *, interval: float = 0.5, file=None, client=None):
    """Run ``collection`` (a dask dataframe or series, persisted here if it is not yet) with a
    progress bar; return it persisted. Raises the job's error, with the bar closed, if it fails."""
    if not is_dask_collection(collection):
        raise TypeError(f"progress: expected a dask collection, got {type(collection).__name__}")
    client = client if client is not None else default_client()
    calls = operator_calls(collection)
    first = operator_of(calls[0])[0].name if calls else None
    expected = expected_calls(collection) if calls else 0
    started = time.time()
    persisted = collection if futures_of(collection) else client.persist(collection)
    futures = futures_of(persisted)
    unit, total = ("call", expected) if expected else ("part", len(futures))
    with tqdm(total=total, unit=unit, desc="ddf.llm", file=file, dynamic_ncols=True) as bar:
        while True:
            states = [f.status for f in futures]
            failed = next((f for f, s in zip(futures, states) if s in ("error", "cancelled")), None)
            finished = states.count("finished")
            done = counts(client, started, first)
            bar.set_postfix(done, refresh=False)
            if failed is not None:
                failed.result()  # raises the job's error (or CancelledError)
            count = min(done["calls"], total) if unit == "call" else finished
            if finished == len(futures):
                if unit == "call":
                    bar.total = done["calls"]  # the real count, where the preview gave a bound
                bar.update(bar.total - bar.n)
                return persisted
            bar.update(count - bar.n)
            time.sleep(interval)  # a poll of local future states, not a synchronization


def expected_calls(collection) -> int:
    """The calls the cost preview expects the job to execute; 0 if it cannot say."""
    try:
        preview = estimate(collection)
    except Exception:  # noqa: BLE001 - a preview that fails costs the bar its total, never the job
        return 0
    return sum(o.distinct - o.cache_hits for o in preview.operators if o.output_tokens is not None)


def counts(client, started: float, operator: str | None) -> dict:
    """Rows the job's first operator has looked up, calls executed and tokens, on all workers."""
    total = {"rows": 0, "calls": 0, "tokens": 0}
    for worker in client.run(worker_counts, started, operator).values():
        for k, v in worker.items():
            total[k] += v
    return total


def worker_counts(started: float, operator: str | None, dask_worker=None) -> dict:
    rows = calls = tokens = 0
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    for record in reversed(list(plugin.usage.values()) if plugin is not None else []):  # newest first
        if record.time < started:  # before the job
            break
        if record.op == DATAFRAME and record.operator == operator:
            rows += record.rows
        elif record.op == DECODE_TASK:
            calls += record.calls
            tokens += record.prompt_tokens + record.decode_tokens
    return {"rows": rows, "calls": calls, "tokens": tokens}
