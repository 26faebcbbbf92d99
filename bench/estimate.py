"""The cost preview's estimate against the run it previews.

    python bench/estimate.py --rows 400 --distinct 100 --max-tokens 16 --json estimate.json
    python bench/estimate.py --job claims --model smollm2 --json estimate-claims.json

Cluster: ``LocalLLMCluster(models=[--model], n_workers=--workers, threads_per_worker=4)``,
result store off. Once its engines are loaded (the wait is logged, not timed), the engines'
per-token costs are measured (``daskllm.dataframe.calibrate()``, timed); then the job is
previewed (``ddf.llm.estimate()``) and run from a cold start. Jobs:

* ``map`` (default): ``ddf.llm.map`` over ``--rows`` rows holding ``--distinct`` distinct
  questions, free text up to ``--max-tokens``;
* ``claims``: the shape of a first table job on real questions: ``--rows`` HotpotQA
  comparison questions (``../shared/data/hotpotqa_comparison.json``) of which 20 repeated and 10
  null, then ``map(choices=["yes", "no", "unsure"])`` and a ``filter`` on the question.

Reported: the preview's counts next to what ``daskllm.usage()`` counted (each exact operator's
distinct inputs and the prompt tokens must be equal; the script exits 1 if not), the estimated
seconds (per-token costs and the per-operator overhead ``calibrate()`` measured), the run's wall
seconds and the engines' busy seconds, and the ratio of the run's wall time to the estimate
(1 is a perfect estimate; above 1 the preview was too optimistic, below 1 too pessimistic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import log, machine_info  # noqa: E402

CLAIMS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "hotpotqa_comparison.json"


def table(args):
    import pandas as pd

    if args.job == "map":
        questions = [f"In one sentence, what is {i} times {i + 3}?" for i in range(args.distinct)]
        return pd.DataFrame({"q": [questions[i % args.distinct] for i in range(args.rows)]})
    questions = [q["question"] for q in json.loads(CLAIMS.read_text())][:args.rows - 30]
    questions += questions[:20] + [None] * 10  # 20 repeated, 10 null
    return pd.DataFrame({"q": pd.Series(questions, dtype="string[pyarrow]")})


def job_of(args, ddf):
    if args.job == "map":
        return ddf.llm.map("Q: {q}\nA:", max_tokens=args.max_tokens, out="answer")
    return (ddf.llm.map("Answer yes, no or unsure: {q}", choices=["yes", "no", "unsure"], out="verdict")
            .llm.filter("Is this question about people? {q}"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["map", "claims"], default="map")
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
    from distributed import Client

    import daskllm
    from daskllm.runtime.control import cold_start
    from daskllm.worker.control import resident_models

    dask.config.set({"daskllm.model": args.model})
    rows = table(args)
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=4,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        start = time.perf_counter()
        resident_models(client)  # a new worker joins first and loads its engines after: no part of calibrating
        log(f"engines loaded {time.perf_counter() - start:.1f} s after the workers joined; calibrating")
        start = time.perf_counter()
        daskllm.dataframe.calibrate()
        calibrate_seconds = time.perf_counter() - start
        job = job_of(args, dd.from_pandas(rows, npartitions=args.partitions))
        preview = job.llm.estimate()
        print(preview)
        cold_start(client)
        log("running the job")
        with daskllm.usage() as usage:
            start = time.perf_counter()
            job.compute()
            wall = time.perf_counter() - start
        busy = sum(e["busy_seconds"] for e in usage.engines.values()) / args.workers
        first = preview.operators[0]
        actual = usage.operators[first.operator]
        result = {"machine": machine_info(), "args": vars(args), "preview": preview.to_dict(),
                  "calibrate_seconds": calibrate_seconds,
                  "actual": {"distinct": actual["distinct"], "prompt_tokens": usage.prefill_tokens,
                             "decode_tokens": usage.decode_tokens, "wall_seconds": wall,
                             "engine_busy_seconds_per_worker": busy},
                  "wall_over_estimate": wall / preview.seconds if preview.seconds else None,
                  "busy_over_estimate": busy / preview.seconds if preview.seconds else None}
    known = sum(o.prompt_tokens or 0 for o in preview.operators)
    output = sum(o.output_tokens or 0 for o in preview.operators)
    estimate = f"{preview.seconds:.2f}" if preview.seconds else "?"
    distinct = "".join(f"| distinct prompts ({o.operator}, {o.method}) | {o.distinct} | "
                       f"{usage.operators[o.operator]['distinct']} |\n" for o in preview.operators)
    print(f"| | preview | run |\n|---|---|---|\n{distinct}"
          f"| prompt tokens | {known} | {usage.prefill_tokens} |\n"
          f"| output tokens | {output} | {usage.decode_tokens} |\n"
          f"| seconds | {estimate} (estimate) | {wall:.2f} wall, {busy:.2f} engine busy per worker |\n\n"
          f"calibrate: {calibrate_seconds:.1f} s; wall / estimate = {result['wall_over_estimate'] or float('nan'):.2f}, "
          f"engine busy / estimate = {result['busy_over_estimate'] or float('nan'):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    exact = all(o.distinct == usage.operators[o.operator]["distinct"] for o in preview.operators
                if o.method == "exact") and (args.job != "map" or known == usage.prefill_tokens)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
