"""The ``.llm`` accessor against what a user would write with Dask alone.

    python bench/dataframe.py --json out.json
    python bench/dataframe.py --quick            # smoke run: fewer rows
    python bench/dataframe.py --scale 100000     # map then filter on 100,000 rows: peak memory
    python bench/dataframe.py --scale 100000 --kill-after 300   # ... with a worker killed 300 s in
    python bench/dataframe.py --cascade          # filter cascades on labelled yes/no questions
    .venv-vllm/bin/python bench/dataframe.py --shared-context columns --reps 3   # table jobs vs vLLM alone

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
* ``daskllm``: ``ddf.llm.map(template, ...)`` (``dedupe="auto"``, the default);
* ``daskllm-global`` / ``daskllm-local``: the same with ``dedupe="global"`` (the shuffle-based
  dedupe, the plan before ``"auto"``) and ``dedupe="local"`` (each partition on its own).

All three use the same token ids for a prompt (the template's segments tokenized separately,
as daskllm does), so their outputs must be identical. Systems run interleaved, from a cold
start each time (prefix caches reset, result cache cleared). Recorded: wall time, rows/s,
ratio to each baseline, and daskllm's physical calls (must equal the distinct prompts).

``--scale N``: N distinct synthetic rows (``--partitions``) through ``map`` then ``filter``
(one job), and the peak resident memory (``ru_maxrss``) of the client and of each worker
process before and after it, with the usage counts.
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
import table_jobs  # noqa: E402

SYSTEMS = ("rowwise", "batched", "daskllm", "daskllm-global", "daskllm-local")
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
    if system.startswith("daskllm"):
        dedupe = system.partition("-")[2] or "auto"
        with daskllm.usage() as usage:
            out = ddf.llm.map(template, model=model, max_tokens=max_tokens, out="out", dedupe=dedupe,
                              chat=False).compute()  # the bare prompt, as the baselines send it
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
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale", type=int, metavar="ROWS", help="map then filter on ROWS rows: peak memory")
    parser.add_argument("--kill-after", type=float, metavar="S", help="with --scale: SIGKILL a worker S seconds in")
    parser.add_argument("--json")
    parser.add_argument("--cascade", action="store_true", help="oracle-only filter against cascades (see cascade_main)")
    parser.add_argument("--shared-context", choices=table_jobs.JOBS, metavar="JOB",
                        help=f"a table job against vLLM alone (bench/table_jobs.py): one of {table_jobs.JOBS}")
    parser.add_argument("--job-systems", nargs="+", default=list(table_jobs.SYSTEMS), dest="job_systems")
    parser.add_argument("--job-workers", type=int, default=1, dest="job_workers",
                        help="daskllm's workers in the table job (they share the KV cache the others get)")
    parser.add_argument("--job-scale", type=int, nargs="+", metavar="ROWS", dest="job_scale",
                        help="the columns table job over ROWS rows from parquet: planning time, client peak memory")
    parser.add_argument("--job-scale-one", type=int, dest="job_scale_one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job_scale_one:
        table_jobs.scale_one(args.job_scale_one, args.model, args.max_tokens)
        return 0
    if args.job_scale:
        return table_jobs.scale_main(args)
    if args.shared_context:
        args.systems = args.job_systems
        args.rows = args.rows if "--rows" in (argv or sys.argv) else None
        return table_jobs.main(args)
    if args.scale:
        return scale(args)
    if args.cascade:
        return cascade_main(args)
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
    return emit(report(results), results, args.json)


def emit(text: str, results: dict, json_path: str | None) -> int:
    """Print the report; with ``--json``, write the raw results too."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0


def report(results) -> str:
    m = results["machine"]
    lines = [f"model `{m['model']}`, {m['rows']} rows in {m['partitions']} partitions, max_tokens={m['max_tokens']}, "
             f"{m['reps']} repetitions", "",
             "| table | distinct prompts | daskllm calls | " + " | ".join(SYSTEMS) + " | vs rowwise | vs batched | "
             "identical |", "|---|---|---|" + "---|" * len(SYSTEMS) + "---|---|---|"]
    for name, t in results["tables"].items():
        w = {s: statistics.median(v) for s, v in t["walls"].items()}
        rate = {s: t["rows"] / w[s] for s in w}
        cells = [f"{w[s]:.1f} s ({rate[s]:.0f} rows/s)" if s in w else "-" for s in SYSTEMS]
        ratio = [f"{w[s] / w['daskllm']:.2f}x" if s in w and "daskllm" in w else "-" for s in ("rowwise", "batched")]
        calls = ", ".join(str(c) for c in sorted(set(t["daskllm_calls"]))) or "-"
        lines.append(f"| {name} | {t['distinct_prompts']} | {calls} | {' | '.join(cells)} | {' | '.join(ratio)} | "
                     f"{'yes' if t['identical'] else 'NO'} |")
    return "\n".join(lines)


def _peak_rss_mib(dask_worker=None) -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _kill_a_caller(client, future, after_s: float) -> str | None:
    """SIGKILL the worker process running a partition's calls ``after_s`` seconds into the job
    (its nanny starts a new one): the job must still finish, counting each row once."""
    import os
    import signal

    deadline = time.monotonic() + after_s
    while time.monotonic() < deadline and not future.done():
        time.sleep(0.5)  # a benchmark's clock, not a synchronization
    for worker, keys in client.processing().items():
        if any("run_calls" in str(k) or "call_owned" in str(k) for k in keys):
            os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
            log(f"killed {worker} at {after_s:.0f} s")
            return worker
    return None


def scale(args) -> int:
    """``--scale N``: N all-distinct rows through ``map`` then ``filter``, one job; peak memory."""
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client

    import daskllm

    rows = args.scale
    frame = pd.DataFrame({"id": range(rows), "item": [f"item {i}" for i in range(rows)]})
    frame["item"] = frame["item"].astype("string[pyarrow]")
    partitions = max(args.partitions, rows // 1000)
    ddf = dd.from_pandas(frame, npartitions=partitions)
    del frame
    results = {"machine": machine_info(model=args.model, rows=rows, partitions=partitions,
                                       max_tokens=args.max_tokens,
                                       cluster="LocalLLMCluster(n_workers=2, threads_per_worker=4)")}
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=2, threads_per_worker=4) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2)
        before = {"client": _peak_rss_mib(), **client.run(_peak_rss_mib)}
        mapped = ddf.llm.map("Name {item} in two words:", model=args.model, max_tokens=args.max_tokens, out="name")
        job = mapped.llm.filter("Is {name} a fruit?", model=args.model)
        start = time.perf_counter()
        killed = None
        with daskllm.usage() as usage:
            future = client.compute(job.id.count())  # a scalar back: the client holds no table
            if args.kill_after:
                killed = _kill_a_caller(client, future, args.kill_after)
            kept = future.result()
        wall = time.perf_counter() - start
        client.wait_for_workers(2)
        after = {"client": _peak_rss_mib(), **client.run(_peak_rss_mib)}
    results.update(wall_s=wall, kept=int(kept), operators=usage.operators, executed=dict(usage.executed),
                   peak_rss_mib={"before": before, "after": after}, killed=killed)
    log(json.dumps(results, indent=1, default=str))
    lines = [f"{rows:,} rows in {partitions} partitions, `map` (max_tokens={args.max_tokens}) then `filter`, "
             f"model `{args.model}`: {wall:.0f} s ({rows / wall:.0f} rows/s), {kept} rows kept"
             + (f"; worker {killed} killed (SIGKILL) {args.kill_after:.0f} s in" if killed else ""), "",
             "| process | peak RSS before the job | peak RSS after the job |", "|---|---|---|"]
    mib = lambda peaks, p: f"{peaks[p]:.0f} MiB" if p in peaks else "-"  # noqa: E731 - a killed worker's successor has a new address
    lines += [f"| {'client' if p == 'client' else 'worker ' + p} | {mib(before, p)} | {mib(after, p)} |"
              for p in dict.fromkeys([*before, *after])]
    lines += ["", "| operator | rows | distinct | executed | failed |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {o['rows']} | {o['distinct']} | {o['executed']} | {o['failed']} |"
              for name, o in usage.operators.items()]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


# --- cascades (issue 20 item 9) ----------------------------------------------------------------------

CASCADE_PREDICATE = "{question}"
CASCADE_ORACLE = "smollm2"
CASCADE_SYSTEMS = {"oracle only": None, "cascade tiny -> smollm2": "tiny", "cascade smollm2 -> smollm2": "smollm2"}


def cascade_table(rows: int):
    """HotpotQA's comparison questions whose answer is yes or no (../shared/data), with the label."""
    from daskllm.datasets import load_questions

    qs = load_questions("hotpotqa")
    qs = qs[qs["answer"].isin(["yes", "no"])].reset_index(drop=True)
    qs = qs.head(rows)
    return qs[["question"]].assign(label=(qs["answer"] == "yes").to_numpy())


def clear_results() -> None:
    """Empty this process's in-memory result cache (the client's, or a worker's)."""
    from daskllm.worker.results import RESULTS

    RESULTS.clear()


def cascade_run(ddf, proxy: str | None, seed: int):
    import daskllm

    start = time.perf_counter()
    with daskllm.usage() as usage:
        if proxy is None:
            kept = ddf.llm.filter(CASCADE_PREDICATE, model=CASCADE_ORACLE).compute()
        else:
            cascade = daskllm.Cascade(proxy=proxy, oracle=CASCADE_ORACLE, target_precision=0.9, seed=seed)
            kept = ddf.llm.filter(CASCADE_PREDICATE, cascade=cascade).compute()
    return time.perf_counter() - start, set(kept.index), usage.operators


def cascade_main(args) -> int:
    """Oracle-only ``filter(model="smollm2")`` against ``filter(cascade=Cascade(proxy, "smollm2",
    target_precision=0.9))`` on the labelled yes/no questions: wall time, oracle calls, calls
    saved, agreement with oracle-only, precision and recall against the labels. The result
    store is off and the client's result cache cleared: every run computes its calls."""
    import os

    os.environ["DASK_DASKLLM__RESULT_STORE__ENABLED"] = "False"  # read by the worker processes too
    import dask
    import dask.dataframe as dd
    from distributed import Client

    import daskllm
    from daskllm.worker import reset_prefix_caches

    dask.config.set({"daskllm.result-store.enabled": False})
    table = cascade_table(100 if args.quick else args.rows)  # --rows beyond 458: every labelled question
    labels = set(table.index[table["label"]])
    ddf = dd.from_pandas(table[["question"]], npartitions=args.partitions)
    results = {"machine": machine_info(oracle=CASCADE_ORACLE, rows=len(table), partitions=args.partitions,
                                       cluster="LocalLLMCluster(n_workers=2, threads_per_worker=4)"), "systems": {}}
    with daskllm.LocalLLMCluster(models=["tiny", CASCADE_ORACLE], n_workers=2, threads_per_worker=4) as cluster, \
            Client(cluster) as client:
        for model in ("tiny", CASCADE_ORACLE):  # engines load and warm up outside the timings
            for attempt in range(3):  # a worker's first transformers import can race its engine's load
                try:
                    ddf.head(8, npartitions=-1, compute=False).llm.filter(CASCADE_PREDICATE, model=model).compute()
                    break
                except ImportError as exc:
                    log(f"warm-up {model}: {exc!r}, again")
        baseline = None
        for name, proxy in CASCADE_SYSTEMS.items():
            clear_results()
            client.run(clear_results)
            client.run(reset_prefix_caches)
            wall, kept, ops = cascade_run(ddf, proxy, seed=0)
            baseline = kept if proxy is None else baseline
            stats = ops.get("filter-cascade", {})
            oracle_calls = stats.get("oracle_calls", ops.get("filter", {}).get("executed", 0))
            agree = sum((i in kept) == (i in baseline) for i in table.index) / len(table)
            tp = len(kept & labels)
            results["systems"][name] = {
                "wall_s": wall, "oracle_calls": oracle_calls, "oracle_calls_saved": stats.get("oracle_calls_saved", 0),
                "proxy_rows": stats.get("proxy_rows", 0), "thresholds": (stats.get("low"), stats.get("high")),
                "sample_precision": stats.get("sample_precision"), "agreement_with_oracle": agree,
                "precision": tp / len(kept) if kept else float("nan"), "recall": tp / len(labels) if labels else float("nan")}
            log(f"{name}: {wall:.1f} s, {oracle_calls} oracle calls, agreement {agree:.3f}")
    return emit(cascade_report(results), results, args.json)


def cascade_report(results) -> str:
    m = results["machine"]
    lines = [f"{m['rows']} labelled yes/no questions (HotpotQA comparison), {m['partitions']} partitions, "
             f"oracle `{m['oracle']}`, target precision 0.9, sample 100, seed 0", "",
             "| system | wall | oracle calls | calls saved | proxy rows | thresholds (low, high) | sample precision | "
             "agreement with oracle only | precision vs labels | recall vs labels |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["systems"].items():
        low, high = r["thresholds"]
        thresholds = "-" if low is None else f"{low:.3f}, {high:.3f}"
        sample = "-" if r["sample_precision"] is None else f"{r['sample_precision']:.2f}"
        lines.append(f"| {name} | {r['wall_s']:.1f} s | {r['oracle_calls']} | {r['oracle_calls_saved']} | "
                     f"{r['proxy_rows']} | {thresholds} | {sample} | {r['agreement_with_oracle']:.3f} | "
                     f"{r['precision']:.3f} | {r['recall']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
