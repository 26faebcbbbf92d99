"""The cost preview's estimate against the run it previews.

    python bench/estimate.py --rows 400 --distinct 100 --max-tokens 16 --json estimate.json

Cluster: ``LocalLLMCluster(models=[--model], n_workers=--workers, threads_per_worker=4)``,
result store off. The engines' per-token costs are measured first
(``daskllm.dataframe.calibrate()``); then ``ddf.llm.map`` over ``--rows`` rows holding
``--distinct`` distinct questions is previewed (``ddf.llm.estimate()``) and run from a cold
start. Reported: the preview's counts next to what ``daskllm.usage()`` counted (distinct and
prompt tokens must be equal; the script exits 1 if not), the estimated engine seconds, the
run's wall seconds and the engines' busy seconds, and their ratios to the estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import log, machine_info  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--distinct", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import dask
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client

    import daskllm
    from daskllm.runtime.control import cold_start

    dask.config.set({"daskllm.model": args.model})
    questions = [f"In one sentence, what is {i} times {i + 3}?" for i in range(args.distinct)]
    rows = pd.DataFrame({"q": [questions[i % args.distinct] for i in range(args.rows)]})
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=4,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        log("calibrating the engines' per-token costs")
        daskllm.dataframe.calibrate()
        job = dd.from_pandas(rows, npartitions=args.partitions).llm.map("Q: {q}\nA:", max_tokens=args.max_tokens,
                                                                         out="answer")
        preview = job.llm.estimate()
        (op,) = preview.operators
        cold_start(client)
        log("running the job")
        with daskllm.usage() as usage:
            start = time.perf_counter()
            job.compute()
            wall = time.perf_counter() - start
        busy = sum(e["busy_seconds"] for e in usage.engines.values()) / args.workers
        result = {"machine": machine_info(), "args": vars(args), "preview": preview.to_dict(),
                  "actual": {"distinct": usage.operators["map"]["distinct"], "prompt_tokens": usage.prefill_tokens,
                             "decode_tokens": usage.decode_tokens, "wall_seconds": wall,
                             "engine_busy_seconds_per_worker": busy},
                  "wall_over_estimate": wall / op.seconds, "busy_over_estimate": busy / op.seconds}
    print(f"| | preview | run |\n|---|---|---|\n| distinct prompts | {op.distinct} | {result['actual']['distinct']} |\n"
          f"| prompt tokens | {op.prompt_tokens} | {usage.prefill_tokens} |\n"
          f"| output tokens | <= {op.output_tokens} | {usage.decode_tokens} |\n"
          f"| seconds | {op.seconds:.2f} (engine estimate) | {wall:.2f} wall, {busy:.2f} engine busy per worker |\n\n"
          f"wall / estimate = {result['wall_over_estimate']:.2f}, engine busy / estimate = "
          f"{result['busy_over_estimate']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    exact = op.distinct == result["actual"]["distinct"] and op.prompt_tokens == usage.prefill_tokens
    return 0 if exact and usage.decode_tokens <= op.output_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
