"""Faults, measured (issue 19): how fast a killed worker's slot comes back, and how fast the
engines stop after a job is cancelled.

* ``rejoin``: kill one worker slot with SIGKILL as soon as it has (re)joined, ``--rounds``
  times, on a LocalLLMCluster and on a plain ``distributed.LocalCluster`` side by side.
  Reports per round the seconds until the slot was back (or that it never came back within
  ``--patience`` seconds: the nanny was closed).
* ``cancel``: start a job of ``--rows`` prompts x ``--max-tokens`` (ignore_eos), cancel it as
  soon as the engines decode, and report the seconds until every engine is idle and how many
  tokens were decoded, for a graph job and a ``ddf.llm.map`` job; then a ``ddf.llm.map`` of
  400 rows under ``Budget(tokens=0)`` (each row must fail at once, silently).

    python bench/faults.py --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import dask
import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster

import daskllm
import daskllm.dataframe  # noqa: F401 - the ddf.llm accessor
from daskllm.worker import engine_stats


def rejoin(make_cluster, rounds: int, patience: float) -> list[float | None]:
    """Seconds until the killed slot was back, per round; None: it never came back."""
    out: list[float | None] = []
    with make_cluster() as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=180)
        name = sorted(cluster.workers)[0]

        def address():
            return next((a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name), None)

        for _ in range(rounds):
            victim = address()
            os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
            start = time.perf_counter()
            while address() in (None, victim):
                if time.perf_counter() - start > patience:
                    out.append(None)
                    return out
                time.sleep(0.02)
            out.append(round(time.perf_counter() - start, 2))
    return out


def _engines(client) -> dict:
    stats = [s["tiny"] for s in client.run(engine_stats).values() if "tiny" in s]
    return {k: sum(s[k] for s in stats) for k in ("decode_tokens", "requests_cancelled", "running", "waiting")}


def cancel(rows: int, max_tokens: int) -> list[dict]:
    out = []
    with daskllm.LocalLLMCluster(models=["tiny"], n_workers=2, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2, timeout=180)
        for how in ("graph", "dataframe"):
            texts = [f"{how} row {i}: tell a long story" for i in range(rows)]
            if how == "graph":
                job = daskllm.generate(daskllm.prompt("{x}", x=daskllm.batch(texts)), max_tokens=max_tokens,
                                       ignore_eos=True)
            else:
                frame = dd.from_pandas(pd.DataFrame({"x": texts}), npartitions=2)
                job = frame.llm.map("{x}", out="y", max_tokens=max_tokens, ignore_eos=True)
            before = _engines(client)
            future = client.compute(job)
            while _engines(client)["decode_tokens"] <= before["decode_tokens"]:
                time.sleep(0.02)
            future.cancel()
            start = time.perf_counter()
            while (now := _engines(client))["running"] + now["waiting"]:
                time.sleep(0.02)
            out.append({"job": how, "idle_after_s": round(time.perf_counter() - start, 2),
                        "decoded": now["decode_tokens"] - before["decode_tokens"], "requested": rows * max_tokens,
                        "cancelled_requests": now["requests_cancelled"] - before["requests_cancelled"]})
        frame = dd.from_pandas(pd.DataFrame({"x": [f"row {i}" for i in range(400)]}), npartitions=4)
        start = time.perf_counter()
        result = frame.llm.map("Say {x}", out="y", budget=daskllm.Budget(tokens=0), on_error="null",
                               max_tokens=4).compute()
        out.append({"job": "Budget(tokens=0), 400 rows", "seconds": round(time.perf_counter() - start, 2),
                    "failed_rows": int(result["y"].isna().sum()),
                    "scheduler_errors": sum(1 for level, _ in client.get_scheduler_logs(n=10000) if level == "ERROR")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--patience", type=float, default=40.0)
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=800)
    args = parser.parse_args()
    dask.config.set({"daskllm.model": "tiny"})
    report = {"rejoin": {
        "LocalLLMCluster": rejoin(lambda: daskllm.LocalLLMCluster(models=["tiny"], n_workers=2,
                                                                  dashboard_address="127.0.0.1:0"),
                                  args.rounds, args.patience),
        "LocalCluster": rejoin(lambda: LocalCluster(n_workers=2, dashboard_address="127.0.0.1:0"),
                               args.rounds, args.patience)},
        "cancel": cancel(args.rows, args.max_tokens)}
    for system, times in report["rejoin"].items():
        back = [t for t in times if t is not None]
        print(f"{system}: back {len(back)} of {len(times)} kills"
              + (f", median {statistics.median(back):.2f} s" if back else "")
              + (" (then never: its nanny was closed)" if None in times else ""))
    for c in report["cancel"]:
        if "seconds" in c:
            print(f"{c['job']}: {c['seconds']} s, {c['failed_rows']} rows failed at once, "
                  f"{c['scheduler_errors']} scheduler error records")
            continue
        print(f"cancel {c['job']}: engines idle {c['idle_after_s']} s after the cancel; "
              f"{c['decoded']:,} of {c['requested']:,} tokens decoded; {c['cancelled_requests']} requests cancelled")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
