"""The ``.llm`` accessor against what a user would write with Dask alone.

    python bench/dataframe.py --json out.json
    python bench/dataframe.py --quick            # smoke run: fewer rows

Cluster: ``LocalLLMCluster(models=[MODEL], n_workers=2, threads_per_worker=4)``; tables are
dask dataframes of ``--partitions`` partitions with pyarrow strings:

* **stdlib**: the first ``--rows`` rows of the standard-library table, prompt
  ``"Explain {qualname} in one line: {first_sentence}"`` (mostly distinct prompts);
* **duplicates**: the same rows, prompt ``"In one line, what is the {module} module for?"``
  (few distinct prompts: one per module).

Systems, each computing ``out`` for every row with ``max_tokens=--max-tokens``, greedy:

* ``rowwise``: ``ddf.map_partitions`` calling the worker's resident engine one row at a time
  (what a user writes with Dask alone);
* ``batched``: ``map_partitions`` sending each partition's prompts to the engine at once
  (batching, no dedup, no prefix ordering);
* ``daskllm``: ``ddf.llm.map(template, ...)``.

All three use the same token ids for a prompt (the template's segments tokenized separately,
as daskllm does), so their outputs must be identical. Systems run interleaved, from a cold
start each time (prefix caches reset, result cache cleared). Recorded: wall time, rows/s,
ratio to each baseline, and daskllm's physical calls (must equal the distinct prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import log, machine_info  # noqa: E402

TABLES = {"stdlib": "Explain {qualname} in one line: {first_sentence}",
          "duplicates": "In one line, what is the {module} module for?"}


def _text(template: str, row: dict) -> str:
    """The prompt a plain Dask user sends: the template filled as daskllm fills it (the engine
    tokenizes the whole string, as daskllm does)."""
    from daskllm.prompts import Text, parse_template, render_value

    return "".join(seg.text if isinstance(seg, Text) else render_value(row[seg.name])
                   for seg in parse_template(template))


def _rowwise(part, template, model, max_tokens):
    from daskllm import SamplingParams, get_engine

    engine, params = get_engine(model), SamplingParams(max_tokens=max_tokens)
    out = [engine.generate([_text(template, row)], params)[0].text for row in part.to_dict("records")]
    return part.assign(out=out)


def _batched(part, template, model, max_tokens):
    from daskllm import SamplingParams, get_engine

    engine, params = get_engine(model), SamplingParams(max_tokens=max_tokens)
    prompts = [_text(template, row) for row in part.to_dict("records")]
    return part.assign(out=[c.text for c in engine.generate(prompts, params)] if prompts else [])


def run(system: str, ddf, template: str, model: str, max_tokens: int):
    import pandas as pd

    import daskllm

    meta = ddf._meta.assign(out=pd.Series([], dtype=object))
    usage = None
    start = time.perf_counter()
    if system == "daskllm":
        with daskllm.usage() as usage:
            out = ddf.llm.map(template, model=model, max_tokens=max_tokens, out="out").compute()
    else:
        fn = _rowwise if system == "rowwise" else _batched
        out = ddf.map_partitions(fn, template, model, max_tokens, meta=meta).compute()
    wall = time.perf_counter() - start
    return wall, out["out"].astype(str).tolist(), usage


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=["rowwise", "batched", "daskllm"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.reps, args.partitions = 200, 1, 4

    import dask.dataframe as dd
    from distributed import Client

    import daskllm
    from daskllm.datasets import load
    from daskllm.worker.results import RESULTS
    from daskllm.worker import reset_prefix_caches

    docs = load("stdlib-docs", args.rows)[["qualname", "module", "first_sentence"]].reset_index(drop=True)
    ddf = dd.from_pandas(docs, npartitions=args.partitions)
    results = {"machine": machine_info(model=args.model, rows=len(docs), partitions=args.partitions,
                                       max_tokens=args.max_tokens, reps=args.reps,
                                       cluster="LocalLLMCluster(n_workers=2, threads_per_worker=4)"),
               "tables": {}}
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=2, threads_per_worker=4) as cluster, \
            Client(cluster) as client:
        for name, template in TABLES.items():
            distinct = int(docs.apply(lambda r: template.format(**r), axis=1).nunique())
            walls = {s: [] for s in args.systems}
            outputs, calls = {}, []
            for rep in range(args.reps):
                for system in (args.systems if rep % 2 == 0 else args.systems[::-1]):
                    RESULTS.clear()
                    client.run(reset_prefix_caches)
                    wall, out, usage = run(system, ddf, template, args.model, args.max_tokens)
                    walls[system].append(wall)
                    outputs[system] = out
                    if usage is not None:
                        calls.append(usage.executed.get("generate", 0))
                    log(f"{name} rep {rep} {system}: {wall:.2f} s ({len(docs) / wall:.1f} rows/s)")
            first = next(iter(outputs.values()))
            results["tables"][name] = {"rows": len(docs), "distinct_prompts": distinct, "walls": walls,
                                       "daskllm_calls": calls,
                                       "identical": all(o == first for o in outputs.values())}
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def report(results) -> str:
    m = results["machine"]
    lines = [f"model `{m['model']}`, {m['rows']} rows in {m['partitions']} partitions, max_tokens={m['max_tokens']}, "
             f"{m['reps']} repetitions", "",
             "| table | distinct prompts | daskllm calls | rowwise | batched | daskllm | vs rowwise | vs batched | "
             "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for name, t in results["tables"].items():
        w = {s: statistics.median(v) for s, v in t["walls"].items()}
        rate = {s: t["rows"] / w[s] for s in w}
        cells = [f"{w[s]:.1f} s ({rate[s]:.0f} rows/s)" if s in w else "-" for s in ("rowwise", "batched", "daskllm")]
        ratio = [f"{w[s] / w['daskllm']:.2f}x" if s in w and "daskllm" in w else "-" for s in ("rowwise", "batched")]
        calls = ", ".join(str(c) for c in sorted(set(t["daskllm_calls"]))) or "-"
        lines.append(f"| {name} | {t['distinct_prompts']} | {calls} | {' | '.join(cells)} | {' | '.join(ratio)} | "
                     f"{'yes' if t['identical'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
