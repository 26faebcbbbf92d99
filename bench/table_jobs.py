"""Tables that share context: daskllm's table jobs against vLLM alone (``bench/dataframe.py
--shared-context JOB``; run it in .venv-vllm).

Jobs, over the stdlib documentation table, rows shuffled (seed 0):

* ``columns``: four questions as four ``map`` columns over the rows whose ``doc`` has at least
  256 tokens (cut at 1,200 characters): each document is the prefix of four prompts.
* ``modules``: one question about each function, after its module's documentation (modules
  whose documentation has at least 256 tokens): rows share their module's text.
* ``filter-map``: a ``filter`` on the ``columns`` documents, then a ``map`` on the rows it keeps.

Systems, each with prefix caching and the same total KV cache (sized to hold at most 10% of
the job's distinct prefix tokens), one engine on every core:

* ``daskllm``: the ``ddf.llm`` job on one vLLM worker (``daskllm-torch``: one torch worker);
* ``vllm-loop``: vLLM's ``LLM.generate`` once per operator, rows in table order (the natural loop);
* ``vllm-sorted``: every prompt of the job in one ``LLM.generate``, sorted by the shared column
  (the strongest user; for ``filter-map`` two calls, the map's after the filter's).
* ``dask-batched``: plain Dask on the same vLLM workers as ``daskllm``: one ``map_partitions``
  per operator, each sending its partition's prompts (the same token ids) to the worker's
  resident engine in one batch; all operators in one ``compute`` (a filter's map on the rows
  it keeps), so their batches reach the engine together.

Reported per system: wall time (median of interleaved repeats), prefill tokens computed against
the distinct-prefix bound (distinct full KV blocks plus each distinct prompt's partial last
block, counted here from the prompts' token ids, and checked against daskllm's
``usage().distinct_prompt_tokens``), and whether the answers equal ``vllm-loop``'s.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]  # pipelines.vllm_alone: the harness's vLLM-alone engines

JOBS = ("columns", "modules", "filter-map")
SYSTEMS = ("daskllm", "daskllm-torch", "dask-batched", "vllm-loop", "vllm-sorted")
QUESTIONS = ("What does it return?", "Which arguments does it take?", "Is it deprecated?",
             "Give one example of its use.")
COLUMNS_TEMPLATE = "Documentation of {qualname}:\n{doc}\n\nQuestion: "
MODULES_TEMPLATE = "Documentation of the {module} module:\n{module_doc}\n\nQuestion: what does {qualname} do?"
FILTER = COLUMNS_TEMPLATE + "Is this about files?"
MIN_TOKENS = 256


def table(job: str, model: str, rows: int | None) -> pd.DataFrame:
    """The job's rows, shuffled (seed 0)."""
    from daskllm.corpus import stdlib_docs
    from daskllm.prompts import tokenizer_for

    docs = stdlib_docs()
    tok = tokenizer_for(model)
    long = docs["doc"].map(lambda d: len(tok.encode(d)) >= MIN_TOKENS)
    if job in ("columns", "filter-map"):
        picked = docs[long & (docs["kind"] != "module")]
        picked = picked.assign(doc=picked["doc"].str.slice(0, 1200))[["qualname", "doc"]]
    else:
        modules = docs[long & (docs["kind"] == "module")][["module", "doc"]].rename(columns={"doc": "module_doc"})
        modules = modules.assign(module_doc=modules["module_doc"].str.slice(0, 1200))
        functions = docs[docs["kind"] == "function"][["module", "qualname"]]
        picked = functions.merge(modules, on="module")
    picked = picked.sample(frac=1.0, random_state=0).reset_index(drop=True)
    return picked.iloc[:rows] if rows else picked


def operators(job: str) -> list[tuple[str, str]]:
    """(kind, template) per operator, in order."""
    if job == "columns":
        return [("map", COLUMNS_TEMPLATE + q) for q in QUESTIONS]
    if job == "modules":
        return [("map", MODULES_TEMPLATE)]
    return [("filter", FILTER), ("map", COLUMNS_TEMPLATE + QUESTIONS[0])]


def daskllm_job(ddf, job: str, model: str, max_tokens: int):
    for i, (kind, template) in enumerate(operators(job)):
        if kind == "filter":
            ddf = ddf.llm.filter(template, model=model)
        else:
            ddf = ddf.llm.map(template, model=model, max_tokens=max_tokens, out=f"a{i}")
    return ddf


def plain_dask_job(ddf, job: str, model: str, max_tokens: int):
    """What a competent plain Dask user writes: one ``map_partitions`` per operator, each
    partition's prompts (token ids, operator i's in column ``_ids{i}``) sent to the worker's engine at
    once; a map after a filter runs on the rows the filter keeps."""
    from daskllm.dataframe.ops import yes_no

    for i, (kind, _) in enumerate(operators(job)):
        if kind == "filter":
            ddf = ddf[ddf.map_partitions(_said_yes, f"_ids{i}", model, tuple(yes_no(model)), meta=pd.Series([], dtype=bool))]
        else:
            ddf = ddf.assign(**{f"a{i}": ddf.map_partitions(_generate_part, f"_ids{i}", model, max_tokens, (),
                                                             meta=pd.Series([], dtype=object))})
    return ddf


def _generate_part(part: pd.DataFrame, column: str, model: str, max_tokens: int, allowed: tuple) -> pd.Series:
    from daskllm import SamplingParams, get_engine

    params = SamplingParams(max_tokens=max_tokens, allowed_token_ids=allowed)
    prompts = [list(ids) for ids in part[column]]
    texts = [c.text for c in get_engine(model).generate(prompts, params)] if prompts else []
    return pd.Series(texts, index=part.index, dtype=object)


def _said_yes(part: pd.DataFrame, column: str, model: str, allowed: tuple) -> pd.Series:
    said = _generate_part(part, column, model, 1, allowed)
    return pd.Series([t.strip().lower().startswith("y") for t in said], index=part.index, dtype=bool)


def prompt_ids(frame: pd.DataFrame, kind: str, template: str, model: str, max_tokens: int) -> list:
    """The token ids daskllm sends for these rows (its rendering, its chat template)."""
    from daskllm.dataframe.ops import Op, prompt_ids as ids_of
    from daskllm.engines import SamplingParams
    from daskllm.prompts import tokenizer_for

    name = "filter" if kind == "filter" else "generate"
    op = Op(name, model, kind, template, SamplingParams(max_tokens=1 if kind == "filter" else max_tokens),
            chat=tokenizer_for(model).has_chat_template)
    return [list(ids) for ids in ids_of(frame, op)]


def bound(prompts: list, block: int) -> int:
    """Distinct full KV blocks (as prefix chains) plus each distinct prompt's partial last block."""
    full, tails = set(), set()
    for ids in prompts:
        ids = tuple(ids)
        n = len(ids) // block
        full.update(ids[:(i + 1) * block] for i in range(n))
        if len(ids) % block:
            tails.add(ids)
    return len(full) * block + sum(len(t) % block for t in tails)


def main(args) -> int:
    import dask
    import dask.dataframe as dd
    from distributed import Client

    import daskllm
    from daskllm import config

    sys.path.insert(0, str(ROOT))
    from pipelines.vllm_alone import Call, OfflineEngine
    from daskllm.dataframe.ops import max_len, yes_no
    from daskllm.worker import reset_prefix_caches

    job, model, max_tokens = args.shared_context, args.model, args.max_tokens
    if any(s != "daskllm-torch" for s in args.systems):  # vLLM's CPU attention takes blocks of 32
        from daskllm.engines.vllm import CPU_BLOCK_MULTIPLE

        dask.config.set({"daskllm.engine.block-size": CPU_BLOCK_MULTIPLE})
    rows = table(job, model, args.rows)
    block = config.get("engine.block-size")
    ops = operators(job)
    every = [prompt_ids(rows, kind, template, model, max_tokens) for kind, template in ops]
    distinct = bound([p for ids in every for p in ids], block)
    # vLLM starts an engine only with a cache that holds one whole context (and a block to spare).
    kv = max((max_len(model) // block + 1) * block, int(0.1 * distinct) // block * block)
    print(f"{job}: {len(rows)} rows, {len(ops)} operators, distinct-prefix bound {distinct} tokens, "
          f"KV cache {kv} tokens, {model}, max_tokens {max_tokens}, daskllm workers {args.job_workers}", flush=True)
    results: dict[str, dict] = {s: {"seconds": [], "computed": None, "answers": None, "batch": None}
                                for s in args.systems}

    def alone_run(engine, sorted_: bool):
        before = engine.counters.prefill_tokens_computed
        steps, sequences = engine.counters.steps, engine.counters.batched_sequences
        answers = []
        keep = None
        started = time.perf_counter()
        for (kind, template), ids in zip(ops, every):
            allowed = tuple(yes_no(model)) if kind == "filter" else ()
            todo = list(range(len(rows))) if keep is None else keep
            calls = [Call(model, tuple(ids[i]), 1 if kind == "filter" else max_tokens, False, allowed) for i in todo]
            order = sorted(range(len(calls)), key=lambda j: calls[j].prompt_ids) if sorted_ else range(len(calls))
            outs = [None] * len(calls)
            for j, o in zip(order, engine.generate([calls[j] for j in order])):
                outs[j] = o.text
            if kind == "filter":
                keep = [i for i, o in zip(todo, outs) if o.strip().lower().startswith("y")]
            else:
                answers.append(outs)
        seconds = time.perf_counter() - started
        engine.reset_prefix_cache()
        batch = (engine.counters.batched_sequences - sequences) / max(1, engine.counters.steps - steps)
        return seconds, engine.counters.prefill_tokens_computed - before, answers, batch

    engine = None
    if any(s.startswith("vllm") for s in args.systems):
        engine = OfflineEngine(model, kv_cache_tokens=kv)
    clusters = {}
    try:
        settings = {"daskllm.engine.kv-cache-tokens": kv, "daskllm.metering.prompt-blocks": True,
                    "daskllm.result-store.enabled": False}
        workers = args.job_workers
        # The same KV cache in all: split between daskllm's workers (each at least vLLM's floor).
        per_worker = max((max_len(model) // block + 1) * block, kv // workers // block * block)
        # daskllm and plain Dask share the vLLM workers (each run starts with an empty prefix cache).
        backends = {s: "torch" if s == "daskllm-torch" else "vllm" for s in args.systems if not s.startswith("vllm")}
        for backend in sorted(set(backends.values())):
            with dask.config.set(settings):
                clusters[backend] = daskllm.LocalLLMCluster(
                    models=[model], n_workers=workers, backend=backend, embedders=(), rerankers=(),
                    engine_options={"kv_cache_tokens": per_worker}, dashboard_address="127.0.0.1:0")
        for rep in range(args.reps):
            for system in args.systems:
                if system.startswith("vllm"):
                    seconds, computed, answers, batch = alone_run(engine, system == "vllm-sorted")
                else:
                    with Client(clusters[backends[system]], set_as_default=False) as client, \
                            dask.config.set(settings):
                        client.run(reset_prefix_caches)  # a cold cache, as vLLM alone's
                        steps, sequences, prefilled = _engine_steps(client)
                        if system == "dask-batched":  # the prompts' ids, as daskllm sends them (lists, not strings)
                            with dask.config.set({"dataframe.convert-string": False}):
                                ddf = dd.from_pandas(rows.assign(**{f"_ids{i}": ids for i, ids in enumerate(every)}),
                                                     npartitions=max(2, args.partitions))
                            job_of = plain_dask_job
                        else:
                            ddf = dd.from_pandas(rows, npartitions=max(2, args.partitions))
                            job_of = daskllm_job
                        started = time.perf_counter()
                        with client.as_current(), daskllm.usage() as u:
                            out = job_of(ddf, job, model, max_tokens).compute()
                        seconds = time.perf_counter() - started
                        after_steps, after_sequences, after_prefilled = _engine_steps(client)
                        batch = (after_sequences - sequences) / max(1, after_steps - steps)
                        # Plain Dask's calls are not metered: the engines' counter says what they computed.
                        computed = u.prefill_tokens_computed if system != "dask-batched" else after_prefilled - prefilled
                        if u.distinct_prompt_tokens is not None and u.distinct_prompt_tokens != distinct:
                            print(f"  note: {system}'s usage counts a bound of {u.distinct_prompt_tokens}", flush=True)
                        answers = [out[f"a{i}"].tolist() for i, (kind, _) in enumerate(ops) if kind == "map"]
                r = results[system]
                r["seconds"].append(seconds)
                r["computed"], r["answers"], r["batch"] = computed, answers, batch
                print(f"  rep {rep} {system}: {seconds:.1f} s, prefill computed {computed}, mean batch {batch:.1f}",
                      flush=True)
    finally:
        for cluster in clusters.values():
            cluster.close()
        if engine is not None:
            engine.close()
    reference = results.get("vllm-loop", {}).get("answers")
    loop = statistics.median(results["vllm-loop"]["seconds"]) if "vllm-loop" in results else None
    sorted_ = statistics.median(results["vllm-sorted"]["seconds"]) if "vllm-sorted" in results else None
    print("\n| system | wall s | vs vllm-loop | vs vllm-sorted | prefill computed / bound | mean batch "
          "| answers = vllm-loop |")
    print("|---|---|---|---|---|---|---|")
    for system, r in results.items():
        wall = statistics.median(r["seconds"])
        same = "-" if reference is None else ("yes" if r["answers"] == reference else
                                             f"{_agreement(r['answers'], reference):.1%}")
        print(f"| {system} | {wall:.1f} | {loop / wall if loop else float('nan'):.2f}x | "
              f"{sorted_ / wall if sorted_ else float('nan'):.2f}x | {r['computed'] / distinct:.2f} | "
              f"{r['batch']:.1f} | {same} |")
    return 0


def _engine_steps(client) -> tuple[int, int, int]:
    """The cluster's LLM engines' steps, the sequences they carried (a step's mean batch is
    their ratio) and the prefill tokens they computed, summed."""
    from daskllm.worker import engine_stats

    stats = [s for per_worker in client.run(engine_stats).values() for s in per_worker.values()]
    return (sum(s["steps"] for s in stats), sum(s["batched_sequences"] for s in stats),
            sum(s["prefill_tokens_computed"] for s in stats))


def _agreement(answers: list, reference: list) -> float:
    pairs = [(a, b) for col_a, col_b in zip(answers, reference) for a, b in zip(col_a, col_b)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


# --- at scale: planning time and the client's memory (--job-scale ROWS ...) --------------------

SCALE_PARTITION_ROWS = 50_000


def scale_main(args) -> int:
    """``--job-scale N ...``: the ``columns`` job (four question columns) over N rows read from
    parquet, built by repeating its table, written back to parquet (no table comes to the
    client). Each N runs in a process of its own, so the client's peak memory is its own.
    Reported: the planning time (the four operators added and the graph built and optimized,
    before anything runs), the run's wall time, and the client's peak RSS."""
    import json
    import subprocess

    rows = []
    for n in args.job_scale:
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("dataframe.py")), "--job-scale-one",
                              str(n), "--model", args.model, "--max-tokens", str(args.max_tokens)],
                             check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {n:,} rows: {rows[-1]}", flush=True)
    base = rows[0]["client_peak_mib"]
    print(f"\n| rows | partitions | planning | run | client peak RSS | vs {rows[0]['rows']:,} rows |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']:,} | {r['partitions']} | {r['planning_s']:.2f} s | {r['run_s']:.0f} s | "
              f"{r['client_peak_mib']:.0f} MiB | {r['client_peak_mib'] / base:.2f}x |")
    return 0


def scale_one(rows: int, model: str, max_tokens: int) -> dict:
    """One ``--job-scale`` size, in this process (see :func:`scale_main`)."""
    import json
    import resource
    import tempfile

    import dask
    import dask.dataframe as dd
    from distributed import Client

    import daskllm

    base = table("columns", model, None)
    with tempfile.TemporaryDirectory() as tmp, daskllm.LocalLLMCluster(
            models=[model], n_workers=2, threads_per_worker=2, embedders=(), rerankers=(),
            dashboard_address="127.0.0.1:0") as cluster, Client(cluster):
        partitions = max(1, rows // SCALE_PARTITION_ROWS)
        repeat = dd.from_pandas(pd.DataFrame({"part": range(partitions)}), npartitions=partitions)
        per = rows // partitions

        def build(part: pd.DataFrame) -> pd.DataFrame:  # on the workers: the client never holds the table
            number = int(part["part"].iat[0]) if len(part) else 0
            index = [(number * per + i) % len(base) for i in range(per)]
            return base.iloc[index].reset_index(drop=True).assign(row=range(number * per, (number + 1) * per))
        repeat.map_partitions(build, meta=base.iloc[:0].assign(row=pd.Series([], dtype="int64"))) \
            .to_parquet(f"{tmp}/in", write_index=False)
        started = time.perf_counter()
        ddf = dd.read_parquet(f"{tmp}/in")
        job = ddf
        for i, question in enumerate(QUESTIONS):
            job = job.llm.map(COLUMNS_TEMPLATE + question, model=model, max_tokens=max_tokens, out=f"a{i}")
        graph = job.optimize().__dask_graph__()
        planning = time.perf_counter() - started
        started = time.perf_counter()
        with dask.config.set({"daskllm.result-store.enabled": False}):
            job.to_parquet(f"{tmp}/out", write_index=False)
        run = time.perf_counter() - started
        written = len(dd.read_parquet(f"{tmp}/out", columns=["row"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert written == rows, (written, rows)
    result = {"rows": rows, "partitions": partitions, "tasks": len(graph), "planning_s": planning, "run_s": run,
              "client_peak_mib": peak}
    print(json.dumps(result), flush=True)
    return result
