"""Benchmark of retrieval: quality on real text, sharded exactness, embedding and search throughput.

    python bench/retrieval.py --json /tmp/retrieval-bench.json
    python bench/retrieval.py --quick          # smoke run (< 60 s): part of the corpus, one repetition

What it measures:

1. **Quality.** The whole stdlib documentation corpus (``daskllm.datasets.load("stdlib-docs")``; text per
   row ``f"{qualname}{signature}: {doc[:300]}"``, id = row id) is embedded once with an in-process
   ``EmbedEngine`` (MiniLM) and the same vectors go into a flat, an IVF and an HNSW
   ``VectorIndex``. Queries are the first sentences of ``daskllm.datasets.load("stdlib-objects", n)`` (the
   part after "does the following: "), whose source row is known: recall@1/5/10 per index
   kind, the latency of one query at a time, and the throughput of one call with all queries.
   For reference, a raw faiss ``IndexFlatIP`` with faiss's default BLAS path (which daskllm
   turns off for exactness) is timed on the same vectors.
2. **Sharded exactness.** The same vectors in a 2-shard ``ShardedIndex`` on a 2-worker
   ``LocalLLMCluster`` versus one in-process flat ``VectorIndex``: are the top-10 lists
   (ids, scores, texts) identical for every query?
3. **Embedding throughput** at batch sizes 1, 32, 128: texts/s through Dask tasks
   (``client.submit(daskllm.worker.embed, model, batch, pure=False)`` on a 1-worker
   cluster, all batches in flight) versus calls to an in-process ``EmbedEngine.embed`` on the
   same batches from as many threads as the worker has task threads (the same concurrency,
   so the engine can batch the same way); the ratio is the cost of going through Dask.
4. **Search throughput** on 1 versus 2 shards (``ShardedIndex`` over the full corpus, on the
   2-worker cluster of part 2): queries/s for batches of pre-embedded vectors and of texts,
   one call at a time and with all calls in flight.

Measurements are interleaved (every repetition runs each variant once, alternating their
order) and the median of ``--repeats`` is reported; ratios are medians of per-repetition
ratios. The JSON keeps every raw number and the machine information.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from machine import log
from machine import machine_info as shared_machine_info

MODEL = "all-MiniLM-L6-v2"
QUERY_MARKER = "does the following: "


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=1000, help="stdlib_questions(n): how many queries")
    p.add_argument("--seed", type=int, default=0, help="seed of stdlib_questions")
    p.add_argument("--corpus-limit", type=int, default=None,
                   help="index only the first N corpus rows (default: all); questions outside are dropped")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement; the median is reported")
    p.add_argument("--k", type=int, default=10, help="hits per query (recall@k is reported for 1, 5 and this)")
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default: VectorIndex's 4*sqrt(n))")
    p.add_argument("--nprobe", type=int, default=8, help="IVF lists probed per query")
    p.add_argument("--hnsw-m", type=int, default=32, help="HNSW neighbours per node (M)")
    p.add_argument("--ef-search", type=int, default=64, help="HNSW efSearch")
    p.add_argument("--latency-queries", type=int, default=200, help="queries timed one at a time per index kind")
    p.add_argument("--corpus-chunk", type=int, default=128, help="texts per embed call when embedding the corpus")
    p.add_argument("--embed-texts", type=int, default=512,
                   help="texts per embedding-throughput measurement (split into batches of each size)")
    p.add_argument("--embed-batch-sizes", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--task-threads", type=int, default=4,
                   help="Dask threads per worker, and in-process caller threads in part 3")
    p.add_argument("--search-batch", type=int, default=64, help="queries per search call in part 4")
    p.add_argument("--no-trim-comparison", action="store_true",
                   help="part 3: skip the second 1-worker cluster started without MALLOC_TRIM_THRESHOLD_")
    p.add_argument("--search-text-queries", type=int, default=256,
                   help="text queries per measurement in part 4 (vector queries use all questions)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads of the in-process engine (default: all cores)")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true", help="smoke run: 1,200 corpus rows, one repetition, small counts")
    args = p.parse_args(argv)
    if args.quick:
        args.corpus_limit = args.corpus_limit or 1200
        args.questions = 500
        args.repeats = 1
        args.latency_queries = 20
        args.embed_texts = 64
        args.embed_batch_sizes = [1, 32]
        args.search_text_queries = 64
    for name in ("questions", "repeats", "k", "latency_queries", "corpus_chunk", "embed_texts", "task_threads",
                 "search_batch", "search_text_queries", "threads", "nprobe", "hnsw_m", "ef_search"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.k < 5:
        p.error("--k must be >= 5 (recall@5 is the target)")
    if any(b < 1 for b in args.embed_batch_sizes):
        p.error("--embed-batch-sizes must be >= 1")
    return args


def machine_info() -> dict:
    import faiss

    return shared_machine_info(faiss=faiss.__version__, faiss_omp_threads=faiss.omp_get_max_threads())


def _median(values):
    values = list(values)
    return statistics.median(values) if values else float("nan")


def _timed(fn, *a, **kw):
    start = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - start, out


def corpus_text(row) -> str:
    return f"{row.qualname}{row.signature}: {row.doc[:300]}"


def _key(hits) -> list[list[tuple]]:
    """What "identical top-k" compares: id, score (exact float) and text of every hit."""
    return [[(h.id, h.score, h.text) for h in row] for row in hits]


def _same_rows(a, b) -> int:
    return sum(x == y for x, y in zip(_key(a), _key(b), strict=True))


# --- part 1: quality and local search speed -----------------------------------------------------------


def recall(hits, truth: np.ndarray, at: int) -> float:
    return float(np.mean([t in [h.id for h in row[:at]] for t, row in zip(truth, hits, strict=True)]))


def bench_quality(args, corpus_vectors, ids, texts, query_vectors, truth, log) -> dict:
    import faiss

    from daskllm.index import VectorIndex

    options = {"flat": {}, "ivf": {"nlist": args.nlist, "nprobe": args.nprobe},
               "hnsw": {"hnsw_m": args.hnsw_m, "ef_search": args.ef_search}}
    indexes, out = {}, {"kinds": {}}
    for kind, opts in options.items():
        index = VectorIndex(corpus_vectors.shape[1], kind=kind, name=f"stdlib-{kind}", **opts)
        build_s, _ = _timed(index.add, corpus_vectors, ids, texts)
        indexes[kind] = index
        out["kinds"][kind] = {"build_s": build_s, "config": index.config(), "runs": []}
        log(f"  built {kind} in {build_s:.2f}s ({index.config()})")

    # References on the same vectors: a bare faiss IndexFlatIP searched once with the per-pair
    # kernels VectorIndex forces (no Hit objects, no tie check), and with faiss's default BLAS path
    # for batches of more than 20 queries (faster, but its scores depend on the batch).
    raw = faiss.IndexFlatIP(corpus_vectors.shape[1])
    raw.add(corpus_vectors)
    out["faiss_pairs"] = {"runs": []}
    out["faiss_blas"] = {"runs": []}

    def faiss_blas_search(queries):
        saved = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = 20  # faiss's default
        try:
            return raw.search(queries, args.k)
        finally:
            faiss.cvar.distance_compute_blas_threshold = saved

    latency_queries = query_vectors[:args.latency_queries]
    first_hits = {}
    names = [*options, "faiss_pairs", "faiss_blas"]
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            if name.startswith("faiss_"):
                search = faiss_blas_search if name == "faiss_blas" else (lambda q: raw.search(q, args.k))
                seconds, (scores, found) = _timed(search, query_vectors)
                out[name]["runs"].append({"rep": rep, "batch_s": seconds,
                                          "queries_per_s": len(query_vectors) / seconds})
                first_hits.setdefault(name, (scores, ids[found]))
                continue
            index = indexes[name]
            lat = []
            for q in latency_queries:
                start = time.perf_counter()
                index.search(q, args.k)
                lat.append(time.perf_counter() - start)
            seconds, hits = _timed(index.search, query_vectors, args.k)
            run = {"rep": rep, "latency_ms_median": 1000 * _median(lat),
                   "latency_ms_p95": 1000 * float(np.percentile(lat, 95)), "batch_s": seconds,
                   "queries_per_s": len(query_vectors) / seconds}
            if name in first_hits:
                run["same_hits_as_rep0"] = _key(hits) == _key(first_hits[name])
            else:
                first_hits[name] = hits
            out["kinds"][name]["runs"].append(run)
        log(f"  quality/latency repetition {rep + 1}/{args.repeats} done")

    for kind, r in out["kinds"].items():
        hits = first_hits[kind]
        r.update({f"recall@{at}": recall(hits, truth, at) for at in sorted({1, 5, args.k})})
        r["latency_ms_median"] = _median(x["latency_ms_median"] for x in r["runs"])
        r["latency_ms_p95"] = _median(x["latency_ms_p95"] for x in r["runs"])
        r["queries_per_s"] = _median(x["queries_per_s"] for x in r["runs"])
        r["deterministic"] = all(x.get("same_hits_as_rep0", True) for x in r["runs"])
        r["target_met"] = r["recall@5"] >= 0.8
    exact = first_hits["flat"]
    for name in ("faiss_pairs", "faiss_blas"):
        b = out[name]
        b["queries_per_s"] = _median(x["queries_per_s"] for x in b["runs"])
        raw_scores, raw_ids = first_hits[name]
        b["same_top_k_ids_as_flat"] = int(sum(list(row) == [h.id for h in hits]
                                              for row, hits in zip(raw_ids.tolist(), exact, strict=True)))
        b["same_top_k_ids_and_scores_as_flat"] = int(sum(
            list(zip(row_ids, row_scores)) == [(h.id, h.score) for h in hits]
            for row_ids, row_scores, hits in zip(raw_ids.tolist(), raw_scores.tolist(), exact, strict=True)))
        b["recall@5"] = float(np.mean([t in row[:5] for t, row in zip(truth, raw_ids.tolist(), strict=True)]))
    out["exact_flat_hits"] = exact  # kept for part 2; removed before writing JSON
    return out


# --- parts 2 and 4: a 2-worker cluster ----------------------------------------------------------------


def _task_threads() -> dict:
    import faiss

    return {"torch_threads": torch.get_num_threads(), "faiss_omp_threads": faiss.omp_get_max_threads()}


def _worker_threads(client) -> dict:
    """torch and faiss thread counts as a task on each worker sees them (not the event-loop thread)."""
    return {w: client.submit(_task_threads, workers=[w], pure=False).result()
            for w in client.scheduler_info()["workers"]}


def bench_sharded(args, client, corpus_vectors, ids, texts, query_vectors, queries, exact_hits, log) -> dict:
    from daskllm.index import VectorIndex
    from daskllm.retrieval import ShardedIndex
    from daskllm.worker import embed

    dim = corpus_vectors.shape[1]
    out = {"workers": _worker_threads(client)}
    handles = {}
    for shards in (1, 2):
        index = ShardedIndex.create(client, f"bench-{shards}-shard", dim=dim, shards=shards)
        seconds, _ = _timed(index.add_vectors, corpus_vectors, ids, texts)
        handles[shards] = index
        out[f"add_vectors_{shards}_shard_s"] = seconds
        log(f"  {shards}-shard index: sizes {index.sizes} on {index.workers} ({seconds:.2f}s to add)")
    try:
        # Part 2: exactness against one flat index over the same vectors (built in this process).
        flat = VectorIndex(dim, name="flat")
        flat.add(corpus_vectors, ids, texts)
        n = len(query_vectors)
        exact = {}
        for shards, index in handles.items():
            got = index.search(query_vectors, args.k)
            exact[f"{shards}_shard_vectors"] = {"identical": _same_rows(got, exact_hits), "total": n,
                                                "identical_ids": sum([h.id for h in a] == [h.id for h in b]
                                                                     for a, b in zip(got, exact_hits))}
        # Text queries: embedded on a worker (with its own torch thread count), searched on 2 shards.
        m = min(args.search_text_queries, len(queries))
        worker_vectors = client.submit(embed, MODEL, queries[:m], pure=False).result()
        got = handles[2].search(queries[:m], args.k)
        exact["2_shard_texts"] = {"identical": _same_rows(got, exact_hits[:m]), "total": m,
                                  "identical_ids": sum([h.id for h in a] == [h.id for h in b]
                                                       for a, b in zip(got, exact_hits[:m])),
                                  "worker_embeddings_bit_identical": int(
                                      (worker_vectors == query_vectors[:m]).all(axis=1).sum())}
        out["exactness"] = exact
        assert flat.search(query_vectors[:50], args.k) == exact_hits[:50]
        log(f"  exactness: { {k: (v['identical'], v['total']) for k, v in exact.items()} }")

        # Part 4: queries/s on 1 vs 2 shards.
        batch = args.search_batch
        vector_batches = [query_vectors[i:i + batch] for i in range(0, n, batch)]
        text_batches = [queries[i:i + batch] for i in range(0, m, batch)]
        runs = []
        variants = [(kind, mode) for kind in ("vectors", "texts") for mode in ("sequential", "in_flight")]
        for rep in range(args.repeats):
            order = (1, 2) if rep % 2 == 0 else (2, 1)
            for kind, mode in variants:
                batches = vector_batches if kind == "vectors" else text_batches
                for shards in order:
                    index = handles[shards]
                    start = time.perf_counter()
                    if mode == "sequential":
                        for b in batches:
                            index.search(b, args.k)
                    else:
                        client.gather([index.search_futures(b, args.k)[1] for b in batches])
                    seconds = time.perf_counter() - start
                    queries_done = sum(len(b) for b in batches)
                    runs.append({"rep": rep, "kind": kind, "mode": mode, "shards": shards, "seconds": seconds,
                                 "queries": queries_done, "calls": len(batches),
                                 "queries_per_s": queries_done / seconds})
            log(f"  search repetition {rep + 1}/{args.repeats} done")
        out["search_runs"] = runs
        out["search_breakdown"] = search_breakdown(client, handles, vector_batches, args.k)
        log(f"  breakdown: {out['search_breakdown']}")
        summary = {}
        for kind, mode in variants:
            row = {}
            for shards in (1, 2):
                row[f"{shards}_shard_queries_per_s"] = _median(
                    r["queries_per_s"] for r in runs if (r["kind"], r["mode"], r["shards"]) == (kind, mode, shards))
            ratios = []
            for rep in range(args.repeats):
                qps = {r["shards"]: r["queries_per_s"] for r in runs
                       if (r["rep"], r["kind"], r["mode"]) == (rep, kind, mode)}
                ratios.append(qps[2] / qps[1])
            row["ratio_2_over_1"] = _median(ratios)
            row["queries"] = runs[[(r["kind"], r["mode"]) for r in runs].index((kind, mode))]["queries"]
            summary[f"{kind}/{mode}"] = row
        out["search_summary"] = summary
    finally:
        for index in handles.values():
            index.drop()
    return out


def search_breakdown(client, handles, batches, k) -> dict:
    """One untimed pass of vector batches per shard count, under Dask's task stream: where a call's time goes."""
    from distributed import get_task_stream

    out = {}
    for shards, index in handles.items():
        calls = []
        with get_task_stream(client) as stream:
            for b in batches:
                start = time.perf_counter()
                index.search(b, k)
                calls.append(time.perf_counter() - start)
        spans: dict[tuple[str, str], list[float]] = {}
        for task in stream.data:
            name = str(task["key"]).split("-")[0]
            for part in task["startstops"]:
                spans.setdefault((name, part["action"]), []).append(part["stop"] - part["start"])
        out[shards] = {"call_ms": 1000 * _median(calls),
                       "search_shard_compute_ms": 1000 * _median(spans.get(("search_shard", "compute"), [])),
                       "merge_transfer_ms": 1000 * _median(spans.get(("_merge", "transfer"), [0.0])),
                       "merge_compute_ms": 1000 * _median(spans.get(("_merge", "compute"), []))}
    return out


# --- part 3: embedding throughput, Dask vs in-process -------------------------------------------------


def _stats(engine):
    s = engine.stats()
    return s.texts, s.batches


TRIM = "MALLOC_TRIM_THRESHOLD_"
EMBED_MODES = ("dask", "dask_no_trim", "in_process")
EMBED_LABELS = {"dask": "Dask", "dask_no_trim": "no trim"}


def bench_embed(args, clients: dict, engine, texts, log) -> dict:
    """``clients``: mode -> Client of a 1-worker cluster ("dask": Dask's default worker
    environment; "dask_no_trim": the same without MALLOC_TRIM_THRESHOLD_)."""
    from daskllm.worker import embed
    from daskllm.worker import engine_stats

    def worker_stats(client):
        (stats,) = client.run(engine_stats, kind="embed").values()
        return stats[MODEL]["texts"], stats[MODEL]["batches"]

    pool = concurrent.futures.ThreadPoolExecutor(args.task_threads)
    out = {"workers": {mode: _worker_threads(c) for mode, c in clients.items()}, "texts": len(texts), "runs": []}

    def dask_run(client, batches):
        futures = [client.submit(embed, MODEL, b, pure=False) for b in batches]
        return np.concatenate(client.gather(futures))

    def local_run(batches):
        return np.concatenate(list(pool.map(engine.embed, batches)))

    reference = engine.embed(texts)
    modes = [m for m in EMBED_MODES if m == "in_process" or m in clients]
    try:
        for rep in range(args.repeats):
            for j, size in enumerate(args.embed_batch_sizes):
                batches = [texts[i:i + size] for i in range(0, len(texts), size)]
                shift = (rep + j) % len(modes)
                for mode in modes[shift:] + modes[:shift]:  # rotate the order
                    if mode == "in_process":
                        stats, run = (lambda: _stats(engine)), local_run
                    else:
                        client = clients[mode]
                        stats = (lambda c=client: worker_stats(c))
                        run = (lambda b, c=client: dask_run(c, b))
                    before = stats()
                    seconds, vectors = _timed(run, batches)
                    after = stats()
                    engine_batches = after[1] - before[1]
                    out["runs"].append({"rep": rep, "batch": size, "mode": mode, "batches": len(batches),
                                        "seconds": seconds, "texts_per_s": len(texts) / seconds,
                                        "engine_batches": engine_batches,
                                        "mean_engine_batch": (after[0] - before[0]) / max(1, engine_batches),
                                        "bit_identical_to_one_call": bool(np.array_equal(vectors, reference))})
            log(f"  embed repetition {rep + 1}/{args.repeats} done")
    finally:
        pool.shutdown()
    summary = {}
    for size in args.embed_batch_sizes:
        runs = [r for r in out["runs"] if r["batch"] == size]

        def tps(rep, mode, runs=runs):
            return next(r["texts_per_s"] for r in runs if (r["rep"], r["mode"]) == (rep, mode))

        row = {m: _median(r["texts_per_s"] for r in runs if r["mode"] == m) for m in modes}
        row["mean_engine_batch"] = {m: _median(r["mean_engine_batch"] for r in runs if r["mode"] == m)
                                    for m in modes}
        for m in modes:
            if m != "in_process":
                row[f"ratio_in_process_over_{m}"] = _median(tps(rep, "in_process") / tps(rep, m)
                                                            for rep in range(args.repeats))
        row["batches"] = runs[0]["batches"]
        row["bit_identical"] = all(r["bit_identical_to_one_call"] for r in runs)
        summary[size] = row
    out["summary"] = summary
    return out


def _worker_env(dask_worker=None) -> dict:
    return {k: os.environ.get(k) for k in (TRIM, "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


# --- report ---------------------------------------------------------------------------------------


def markdown(res: dict, args) -> str:
    q = res["quality"]
    n, rows = res["queries"], res["corpus"]["rows"]
    lines = [(f"1. Retrieval quality and speed: {rows:,} corpus rows, {n:,} queries "
              f"(stdlib_questions({args.questions}, seed={args.seed}) first sentences), k={args.k}; "
              f"latency: one query per call (median of {args.latency_queries} queries), throughput: all "
              f"{n:,} queries in one call (median of {args.repeats})\n"),
             (f"| index | settings | recall@1 | recall@5 | recall@{args.k} | recall@5 >= 0.8 | build | "
              f"latency (median / p95) | throughput |"),
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for kind, r in q["kinds"].items():
        c = r["config"]
        settings = {"flat": "exact, inner product", "ivf": f"nlist={c['nlist']}, nprobe={c['nprobe']}",
                    "hnsw": f"M={c['hnsw_m']}, efSearch={c['ef_search']}"}[kind]
        lines.append(f"| {kind} | {settings} | {r['recall@1']:.3f} | {r['recall@5']:.3f} | "
                     f"{r[f'recall@{args.k}']:.3f} | {'met' if r['target_met'] else 'NOT met'} | "
                     f"{r['build_s']:.2f} s | {r['latency_ms_median']:.2f} / {r['latency_ms_p95']:.2f} ms | "
                     f"{r['queries_per_s']:,.0f} q/s |")
    refs = {"faiss_pairs": ("bare faiss `IndexFlatIP`, per-pair kernels (reference)", "what flat uses, one pass"),
            "faiss_blas": ("bare faiss `IndexFlatIP`, BLAS path (reference)", "faiss default: BLAS above 20 queries")}
    for name, (label, settings) in refs.items():
        b = q[name]
        lines.append(f"| {label} | {settings} | | {b['recall@5']:.3f} | | | | | {b['queries_per_s']:,.0f} q/s |")
    lines.append("")
    for name, (label, _) in refs.items():
        b = q[name]
        lines.append(f"{label.split(' (')[0]} vs daskllm's flat index, same {n:,} queries: identical top-{args.k} ids "
                     f"for {b['same_top_k_ids_as_flat']:,}, identical ids and scores for "
                     f"{b['same_top_k_ids_and_scores_as_flat']:,}.")
    lines.append("")
    e = res["sharded"]["exactness"]
    lines += [f"2. Sharded vs one flat index: identical top-{args.k} lists (ids, scores and texts)\n",
              "| search | queries | identical / total | same ids |", "|---|---|---:|---:|"]
    for key, (where, what) in {"2_shard_vectors": ("2 shards on 2 workers", "pre-embedded vectors"),
                               "1_shard_vectors": ("1 shard on 1 worker", "pre-embedded vectors"),
                               "2_shard_texts": ("2 shards on 2 workers", "texts, embedded by a worker's engine")}.items():
        lines.append(f"| {where} | {what} | {e[key]['identical']:,} / {e[key]['total']:,} | "
                     f"{e[key]['identical_ids']:,} |")
    lines.append("")
    lines.append(f"Query embeddings computed on a worker ({_threads(res['sharded']['workers'])}) that are "
                 f"bit-identical to the in-process engine's ({res['machine']['torch_threads']} torch threads): "
                 f"{e['2_shard_texts']['worker_embeddings_bit_identical']:,} / {e['2_shard_texts']['total']:,}.")
    lines.append("")
    em = res["embed"]
    trim = "dask_no_trim" in em["workers"]
    lines += [f"3. Embedding throughput: {em['texts']} texts (query sentences, {res['embed_tokens_mean']:.1f} tokens "
              f"on average) split into batches, all in flight. Dask: `client.submit(embed, ...)` per batch on a "
              f"1-worker `LocalLLMCluster` ({_threads(em['workers']['dask'])}, {args.task_threads} task threads)"
              + (f"; \"no trim\": a second such cluster started without Dask's default `{TRIM}=65536`"
                 if trim else "")
              + f". In-process: {args.task_threads} threads calling `EmbedEngine.embed`. Median of {args.repeats}; "
              f"ratios: medians of per-repetition ratios.\n"]
    head = "| batch size | batches | Dask texts/s |"
    align = "|---:|---:|---:|"
    if trim:
        head += " Dask, no trim texts/s |"
        align += "---:|"
    head += " in-process texts/s | in-process / Dask |"
    align += "---:|---:|"
    if trim:
        head += " in-process / Dask no trim |"
        align += "---:|"
    head += f" mean engine batch ({' / '.join(EMBED_LABELS[m] for m in EMBED_MODES if m in em['workers'])}" \
            f" / in-process) | bit-identical |"
    align += "---:|---|"
    lines += [head, align]
    for size, r in em["summary"].items():
        cells = [str(size), str(r["batches"]), f"{r['dask']:,.0f}"]
        if trim:
            cells.append(f"{r['dask_no_trim']:,.0f}")
        cells += [f"{r['in_process']:,.0f}", f"{r['ratio_in_process_over_dask']:.2f}x"]
        if trim:
            cells.append(f"{r['ratio_in_process_over_dask_no_trim']:.2f}x")
        cells += [" / ".join(f"{v:.1f}" for v in r["mean_engine_batch"].values()),
                  "yes" if r["bit_identical"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    s = res["sharded"]["search_summary"]
    lines += [(f"4. Search throughput, 1 vs 2 shards ({rows:,} vectors, k={args.k}, {args.search_batch} queries "
               f"per call; median of {args.repeats}; ratio: median of per-repetition ratios)\n"),
              "| queries | calls | 1 shard q/s | 2 shards q/s | 2 / 1 |", "|---|---|---:|---:|---:|"]
    labels = {"sequential": "one call at a time", "in_flight": "all calls in flight"}
    for key, r in s.items():
        kind, mode = key.split("/")
        lines.append(f"| {r['queries']:,} {'pre-embedded vectors' if kind == 'vectors' else 'texts'} | {labels[mode]} "
                     f"| {r['1_shard_queries_per_s']:,.0f} | {r['2_shard_queries_per_s']:,.0f} | "
                     f"{r['ratio_2_over_1']:.2f}x |")
    bd = res["sharded"]["search_breakdown"]
    lines.append("")
    lines.append(f"Where a call of {args.search_batch} pre-embedded vectors goes (one untimed pass under Dask's task "
                 f"stream, medians): " + "; ".join(
                     f"{shards} shard{'s' if int(shards) > 1 else ''}: {b['call_ms']:.1f} ms per call, search task "
                     f"{b['search_shard_compute_ms']:.1f} ms, merge input transfer {b['merge_transfer_ms']:.1f} ms"
                     for shards, b in bd.items()) + ".")
    c = res["corpus"]
    lines.append("")
    lines.append(f"Corpus embedding (in-process, {res['machine']['torch_threads']} torch threads, "
                 f"{args.corpus_chunk} texts per call): {c['rows']:,} texts, {c['tokens']:,} tokens "
                 f"({c['tokens'] / c['rows']:.1f} per text) in {c['embed_s']:.1f} s = {c['rows'] / c['embed_s']:,.0f} "
                 f"texts/s, {c['tokens'] / c['embed_s']:,.0f} tokens/s.")
    return "\n".join(lines)


def _threads(workers: dict) -> str:
    t = sorted({(w["torch_threads"], w["faiss_omp_threads"]) for w in workers.values()})
    return "; ".join(f"{a} torch thread{'s' if a != 1 else ''}, faiss {b} OpenMP thread{'s' if b != 1 else ''}"
                     for a, b in t)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import dask
    from distributed import Client

    from daskllm.cluster import LocalLLMCluster
    from daskllm import datasets
    from daskllm.engines.embedder import EmbedEngine

    info = machine_info()
    log(f"torch {info['torch']} ({info['torch_threads']} threads), faiss {info['faiss']} "
        f"({info['faiss_omp_threads']} OpenMP threads), {info['cpu_count']} CPUs ({info['cpu_model']})")
    started = time.perf_counter()
    load_before = os.getloadavg()
    phases = {}

    docs = datasets.load("stdlib-docs", args.corpus_limit)
    texts = [corpus_text(r) for r in docs.itertuples()]
    ids = docs["id"].to_numpy(dtype=np.int64)
    questions = datasets.load("stdlib-objects", args.questions, seed=args.seed)
    questions = questions[questions["id"].isin(ids)]
    queries = [q.split(QUERY_MARKER, 1)[1] for q in questions["question"]]
    truth = questions["id"].to_numpy()
    if len(queries) < args.search_batch:
        log(f"warning: only {len(queries)} queries")

    engine = EmbedEngine(MODEL, num_threads=args.threads)
    try:
        t0 = time.perf_counter()
        tokens = sum(len(t) for t in engine.tokenize(texts))
        engine.embed(texts[:8])  # warm-up
        log(f"embedding {len(texts):,} corpus texts ({tokens:,} tokens) ...")
        embed_s, chunks = _timed(lambda: [engine.embed(texts[i:i + args.corpus_chunk])
                                          for i in range(0, len(texts), args.corpus_chunk)])
        corpus_vectors = np.concatenate(chunks)
        query_vectors = engine.embed(queries)
        log(f"  {embed_s:.1f}s ({len(texts) / embed_s:.0f} texts/s); {len(queries)} queries embedded")
        phases["embed_corpus_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        log("part 1: quality and local search ...")
        quality = bench_quality(args, corpus_vectors, ids, texts, query_vectors, truth, log)
        exact_hits = quality.pop("exact_flat_hits")
        phases["quality_s"] = time.perf_counter() - t0

        cluster_options = {"models": ["tiny"], "threads_per_worker": args.task_threads, "dashboard_address": "127.0.0.1:0",
                           "engine_options": {"kv_cache_tokens": 1024}}
        t0 = time.perf_counter()
        log("parts 2 and 4: 2-worker cluster ...")
        with LocalLLMCluster(n_workers=2, **cluster_options) as cluster, Client(cluster) as client:
            phases["cluster2_start_s"] = time.perf_counter() - t0
            sharded = bench_sharded(args, client, corpus_vectors, ids, texts, query_vectors, queries, exact_hits, log)
        phases["sharded_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        log("part 3: 1-worker clusters ...")
        embed_texts = (queries * (args.embed_texts // max(1, len(queries)) + 1))[:args.embed_texts]
        with contextlib.ExitStack() as stack:
            clients = {}
            if not args.no_trim_comparison:
                # Dask's Nanny puts its pre-spawn-environ into this process's os.environ (the 2-worker
                # cluster above did), so remove it here too, or the worker would inherit it anyway.
                saved = os.environ.pop(TRIM, None)
                with dask.config.set({f"distributed.nanny.pre-spawn-environ.{TRIM}": None}):
                    cluster = stack.enter_context(LocalLLMCluster(n_workers=1, **cluster_options))
                clients["dask_no_trim"] = stack.enter_context(Client(cluster))
                if saved is not None:
                    os.environ[TRIM] = saved
            cluster = stack.enter_context(LocalLLMCluster(n_workers=1, **cluster_options))
            clients["dask"] = stack.enter_context(Client(cluster))
            phases["cluster1_start_s"] = time.perf_counter() - t0
            envs = {mode: next(iter(c.run(_worker_env).values())) for mode, c in clients.items()}
            log(f"  worker environments: {envs}")
            if not args.no_trim_comparison and envs["dask_no_trim"][TRIM] is not None:
                log(f"warning: {TRIM} is still set on the no-trim worker")
            embed_res = bench_embed(args, clients, engine, embed_texts, log)
            embed_res["worker_env"] = envs
        phases["embed_s"] = time.perf_counter() - t0
        embed_tokens_mean = float(np.mean([len(t) for t in engine.tokenize(embed_texts)]))
    finally:
        engine.close()

    total_s = time.perf_counter() - started
    load_after = os.getloadavg()
    res = {"machine": info, "queries": len(queries), "quality": quality, "sharded": sharded, "embed": embed_res,
           "embed_tokens_mean": embed_tokens_mean,
           "corpus": {"rows": len(texts), "tokens": tokens, "embed_s": embed_s}}
    table = markdown(res, args)
    print(table)
    print(f"\ntotal {total_s:.0f}s (phases: {', '.join(f'{k} {v:.0f}s' for k, v in phases.items())}); "
          f"{info['cpu_count']} CPUs; load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    if args.json:
        payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args), "machine": info,
                   "load_average_before": load_before, "load_average_after": load_after, "total_seconds": total_s,
                   "phases": phases, **{k: v for k, v in res.items() if k != "machine"}, "markdown": table}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        log(f"wrote {args.json}")
    exact = sharded["exactness"]
    if exact["2_shard_vectors"]["identical"] != exact["2_shard_vectors"]["total"]:
        log("ERROR: the 2-shard index and the flat index disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
