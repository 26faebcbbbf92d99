"""A progress bar for a table job: the result's partitions done (with an ETA), and the rows,
LLM calls and tokens done so far, in a terminal or a notebook (``tqdm.auto``).

    out = daskllm.dataframe.progress(ddf.llm.map("Summarize {doc}:", out="summary"))
    out.to_parquet("summaries/")  # the persisted result: nothing runs twice

Partitions done come from the client's own view of the futures (no round trip); rows, calls
and tokens from the usage records the workers keep (one ``client.run`` per tick, at most
``1 / interval`` ticks a second). The bar ends when the job does, or raises its error.
"""

from __future__ import annotations

import time

from dask.base import is_dask_collection
from distributed import default_client, futures_of
from tqdm.auto import tqdm

from daskllm.annotations import DECODE_TASK
from daskllm.dataframe.estimate import operator_calls, operator_of
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
    started = time.time()
    persisted = collection if futures_of(collection) else client.persist(collection)
    futures = futures_of(persisted)
    with tqdm(total=len(futures), unit="part", desc="ddf.llm", file=file, dynamic_ncols=True) as bar:
        while True:
            states = [f.status for f in futures]
            failed = next((f for f, s in zip(futures, states) if s in ("error", "cancelled")), None)
            finished = states.count("finished")
            bar.set_postfix(counts(client, started, first), refresh=False)
            bar.update(finished - bar.n)
            if failed is not None:
                failed.result()  # raises the job's error (or CancelledError)
            if finished == len(futures):
                return persisted
            time.sleep(interval)  # a poll of local future states, not a synchronization


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
