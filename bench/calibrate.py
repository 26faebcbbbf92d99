"""How long ``daskllm.dataframe.calibrate()`` takes, and what a new cluster previews without it.

    python bench/calibrate.py --model smollm2 --workers 2 --runs 3 --json calibrate.json

Cluster: ``LocalLLMCluster(models=[--model], n_workers=--workers, threads_per_worker=4)``,
result store off. Its engines are loaded before any clock starts (a new worker joins the
cluster first and loads its engines after: that wait is reported on its own line, it is no
part of calibrating). Then ``calibrate()`` runs ``--runs`` times, each timed, and a small
``map`` job is previewed. Then the cluster closes, a new one starts (new processes, the same
machine and model) and the same job is previewed at once, without calibrating: its
estimated seconds and notes say whether a remembered calibration was found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import log, machine_info  # noqa: E402


def cluster(args):
    import daskllm

    return daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=4,
                                   dashboard_address="127.0.0.1:0")


def preview(model: str):
    import dask.dataframe as dd
    import pandas as pd

    rows = pd.DataFrame({"q": [f"In one sentence, what is {i} times {i + 3}?" for i in range(40)]})
    job = dd.from_pandas(rows, npartitions=4).llm.map("Q: {q}\nA:", model=model, max_tokens=16, out="a")
    start = time.perf_counter()
    estimate = job.llm.estimate()
    return estimate, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import dask
    from distributed import Client

    import daskllm.dataframe
    from daskllm.worker.control import resident_models

    dask.config.set({"daskllm.model": args.model})
    with cluster(args) as first, Client(first) as client:
        start = time.perf_counter()
        resident_models(client)  # waits for the engines to load
        loading = time.perf_counter() - start
        log(f"engines loaded {loading:.1f} s after the workers joined")
        runs = []
        for i in range(args.runs):
            start = time.perf_counter()
            costs = daskllm.dataframe.calibrate()
            runs.append(time.perf_counter() - start)
            log(f"calibrate() {i + 1}: {runs[-1]:.2f} s")
        calibrated, _ = preview(args.model)
    with cluster(args) as second, Client(second) as client:
        resident_models(client)
        remembered, preview_seconds = preview(args.model)
    result = {"machine": machine_info(), "args": vars(args), "engine_load_seconds": loading,
              "calibrate_seconds": runs, "costs": costs, "calibrated_preview": calibrated.to_dict(),
              "new_cluster_preview": remembered.to_dict(), "new_cluster_preview_seconds": preview_seconds}
    times = ", ".join(f"{s:.2f} s" for s in runs)
    estimate = lambda e: "?" if e.seconds is None else f"{e.seconds:.2f} s"  # noqa: E731
    print(f"| | {args.model}, {args.workers} workers |\n|---|---|\n"
          f"| engines loaded after the workers joined (not timed below) | {loading:.1f} s |\n"
          f"| `calibrate()`, {args.runs} runs | {times} |\n"
          f"| preview of a 40-call `map` after calibrating | {estimate(calibrated)} |\n"
          f"| the same preview on a new cluster, no calibrate() | {estimate(remembered)} "
          f"(previewed in {preview_seconds:.2f} s) |\n")
    print("\n".join(remembered.notes))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
