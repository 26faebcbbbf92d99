"""The main job, a tour on the embedded engine: a batch through the task graph, a table job
and a RAG pipeline, with the dashboard up while it runs.

A local cluster starts with the embedded engine on every worker. The questions are one
batched ``daskllm.generate`` over a shared system prompt: the rewrite passes give the shared
prefix its own prefill task and cut the batch into shards, the placement plugin puts each
shard where its prefix is cached, and ``daskllm.usage()`` reports what really ran. The table
job runs ``ddf.llm`` map, filter and extract over rows of the standard-library table, and the
map again as plain Dask for comparison. The RAG pipeline embeds documentation passages into a
vector index on the workers and answers questions generated from the same table.
"""

from __future__ import annotations

import time

import dask

from distributed import Client

from daskllm.cluster import LocalLLMCluster
from daskllm.graph.prompt import tokenizer_for
from daskllm.worker import engine_stats

SYSTEM_PROMPT = (
    "You are a senior Python engineer who answers questions about the Python standard library. "
    "Answer in one or two short sentences, name the module and the function you would use, "
    "and mention one pitfall a newcomer is likely to hit. Prefer the standard library to "
    "third-party packages, and say so when a task really needs one. Be precise about "
    "versions: the interpreter running this demo is CPython 3.11.\n\n"
)

TOPICS = [
    "read a JSON file", "parse command-line arguments", "walk a directory tree", "time a function",
    "run a subprocess and capture its output", "compute a SHA-256 digest", "parse a date string",
    "make a temporary directory", "sort a list of dicts by a key", "count words in a text",
    "merge two sorted iterables", "cache a function's results", "read a CSV file",
    "serialize an object with pickle", "compress a file with gzip", "match a regular expression",
    "format a table of numbers", "start a thread pool", "send an HTTP request", "log to a file",
    "copy a file tree", "compare two text files", "generate random passwords", "parse an INI file",
    "work with fractions exactly", "handle signals", "build a priority queue", "zip a folder",
    "read environment variables", "encode bytes as base64", "deep-copy a nested structure",
    "measure memory use of an object",
]


def questions(n: int) -> list[str]:
    return [f"User: How do I {TOPICS[i % len(TOPICS)]}{' (variant %d)' % (i // len(TOPICS)) if i >= len(TOPICS) else ''}?\n"
            f"Assistant:" for i in range(n)]


MAP_TEMPLATE = "In one line, what is the {module} module for?"


def table_job(model: str, rows: int = 300, max_tokens: int = 12, echo=print) -> dict:
    """Batch analytics over the standard-library table: ``ddf.llm`` map, filter and extract,
    and the same map written as plain Dask (each partition's prompts sent to the engine)."""
    import dask.dataframe as dd

    import daskllm
    from daskllm.corpus import stdlib_docs

    docs = dd.from_pandas(stdlib_docs(limit=rows)[["qualname", "module", "first_sentence"]], npartitions=4)
    echo(f"\nA table job over {rows} rows of the standard-library table: ddf.llm.map, .filter, .extract ...")
    t0 = time.perf_counter()
    with daskllm.usage() as usage:
        purpose = docs.llm.map(MAP_TEMPLATE, model=model, max_tokens=max_tokens, out="purpose")
        public = docs.llm.filter("Is the {module} module about files or the operating system?", model=model)
        fields = docs.llm.extract("The {module} module", {"topic": str}, model=model, max_tokens=max_tokens,
                                  on_error="null")
        out, kept, extracted = dask.compute(purpose, public, fields)
    elapsed = time.perf_counter() - t0
    echo(out[["module", "purpose"]].head(3).to_string(max_colwidth=60))
    echo(f"filter kept {len(kept)} of {rows} rows; extract parsed {int(extracted['topic'].notna().sum())} of {rows} "
         f"(the model has random weights: its JSON rarely parses, and failed rows say why in extract_error)")
    for name, stats in usage.operators.items():
        echo(f"  ddf.llm.{name}: {stats['rows']} rows, {stats['distinct']} distinct prompts, "
             f"{stats['executed']} model calls")
    echo(f"all three in {elapsed:.2f}s")

    t1 = time.perf_counter()
    with daskllm.usage() as map_usage:
        docs.llm.map(MAP_TEMPLATE, model=model, max_tokens=max_tokens, out="purpose").compute()
    ours = time.perf_counter() - t1
    t2 = time.perf_counter()
    plain = docs.map_partitions(_plain_dask_map, model, max_tokens, meta=docs._meta.assign(purpose="")).compute()
    theirs = time.perf_counter() - t2
    same = plain["purpose"].tolist() == out["purpose"].tolist()
    echo(f"the map alone: {ours:.2f}s with ddf.llm ({map_usage.executed.get('generate', 0)} calls) vs {theirs:.2f}s "
         f"as plain Dask map_partitions ({rows} calls): {theirs / ours:.1f}x faster, same answers: {same}")
    return {"rows": rows, "seconds": elapsed, "operators": usage.operators, "map_seconds": ours,
            "plain_dask_map_seconds": theirs, "speedup_over_plain_dask": theirs / ours, "same_answers": same,
            "filter_kept": len(kept), "calls": usage.operators.get("map", {}).get("executed", 0),
            "distinct_prompts": int(out["module"].nunique())}


def _plain_dask_map(part, model, max_tokens):
    """What a Dask user writes without daskllm: the partition's prompts to the worker's engine."""
    from daskllm import SamplingParams, get_engine, prompt
    from daskllm.graph.prompt import Text, tokenizer_for

    engine, tok = get_engine(model), tokenizer_for(model)
    prompts = []
    for row in part.to_dict("records"):  # the prompt's pieces tokenized as daskllm.prompt does
        p = prompt(MAP_TEMPLATE, module=row["module"])
        prompts.append(list(tok.prefix_ids) + [t for seg in p.segments for t in
                                               tok.encode(seg.text if isinstance(seg, Text) else p.values[seg.name])])
    completions = engine.generate(prompts, SamplingParams(max_tokens=max_tokens)) if prompts else []
    return part.assign(purpose=[c.text for c in completions])


def rag_job(client, model: str, questions: int = 6, passages: int = 1000, max_tokens: int = 24, echo=print) -> dict:
    """Retrieval-augmented answers over the same corpus: real MiniLM embeddings in a sharded
    vector index, top-3 search per question, answers generated from the passages."""
    import daskllm
    from daskllm.corpus import stdlib_docs
    from daskllm.qa import stdlib_questions

    asked = stdlib_questions(questions, seed=1)
    docs = stdlib_docs()
    keep = sorted(set(range(min(passages, len(docs)))) | set(asked["id"].tolist()))
    texts = [f"{r.qualname}{r.signature or ''}: {r.first_sentence}" for r in docs.iloc[keep].itertuples()]
    echo(f"\nA RAG pipeline: {len(texts)} documentation passages embedded into a vector index on the workers ...")
    t0 = time.perf_counter()
    index = daskllm.ShardedIndex.from_texts(client, "demo-stdlib", texts, ids=keep)
    indexed = time.perf_counter() - t0
    qs = asked["question"].tolist()
    hits = daskllm.search(index, qs, k=3)
    answers = daskllm.generate(daskllm.prompt("Documentation:\n{docs}\nQuestion: {q}\nAnswer:", docs=hits, q=qs),
                               model=model, max_tokens=max_tokens)
    t1 = time.perf_counter()
    found, said = daskllm.compute(hits, answers)
    elapsed = time.perf_counter() - t1
    right = sum(int(row.id) in {h.id for h in h3} for row, h3 in zip(asked.itertuples(), found))
    for q, h3, a in list(zip(qs, found, said))[:3]:
        echo(f"  Q: {q}\n     retrieved: {', '.join(h.text.split(':')[0] for h in h3)}\n     A: {a[:80]!r}")
    echo(f"{len(qs)} questions in {elapsed:.2f}s (index built in {indexed:.1f}s); the right passage was in the top 3 "
         f"for {right} of {len(qs)} (real MiniLM embeddings; the answers come from the random-weight model)")
    index.drop()
    return {"questions": len(qs), "seconds": elapsed, "index_seconds": indexed, "passages": len(texts),
            "recall_at_3": right / len(qs)}


def run(model: str | None = None, n_workers: int = 1, n_requests: int = 32, max_tokens: int = 32,
        dashboard_address: str = ":8787", keep_alive: float = 0.0, echo=print) -> dict:
    import daskllm

    model = model or daskllm.config.get("model")

    t0 = time.perf_counter()
    echo(f"Starting a local cluster: {n_workers} worker(s), resident engine for model {model!r} ...")
    with LocalLLMCluster(models=[model], n_workers=n_workers, dashboard_address=dashboard_address) as cluster, \
            Client(cluster) as client:
        startup = time.perf_counter() - t0
        llm_page = cluster.dashboard_link.rsplit("/", 1)[0] + "/llm"
        echo(f"Cluster up in {startup:.1f}s. Dashboard: {cluster.dashboard_link} (LLM page: {llm_page})")
        asked = questions(n_requests)
        answers = daskllm.generate(daskllm.prompt(SYSTEM_PROMPT + "{q}", q=asked), model=model,
                                   max_tokens=max_tokens, ignore_eos=True)
        echo("\nThe plan:")
        report = daskllm.explain(answers, file=None)

        t1 = time.perf_counter()
        with daskllm.usage() as usage:
            texts = daskllm.compute(answers, result_cache=False)[0]
        elapsed = time.perf_counter() - t1
        stats = client.run(engine_stats)
        system_tokens = len(tokenizer_for(model).prefix_ids) + len(tokenizer_for(model).encode(SYSTEM_PROMPT))

        generated = usage.decode_tokens
        prompt_tokens = usage.prefill_tokens
        cached = usage.prefill_tokens_cached
        summary = {
            "model": model, "workers": n_workers, "requests": len(texts), "seconds": elapsed,
            "startup_seconds": startup, "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
            "generated_tokens": generated, "generated_tokens_per_s": generated / elapsed,
            "requests_per_s": len(texts) / elapsed, "prefix_cache_hit_rate": cached / max(1, prompt_tokens),
            "system_prompt_tokens": system_tokens, "dashboard": cluster.dashboard_link,
            "tasks": dict(report.get("tasks", {})), "usage": usage.as_dict(), "engines": stats,
        }
        for q, text in list(zip(asked, texts))[:3]:
            echo(f"  Q: {q.splitlines()[0]}\n  A: {text[:100]!r}")
        echo("  (the model has random weights, so answers are noise; the work is real)\n")
        echo(f"{len(texts)} requests in {elapsed:.2f}s through {sum(report['tasks'].values())} Dask tasks "
             f"({', '.join(f'{n} {op}' for op, n in sorted(report['tasks'].items()))}): "
             f"{summary['requests_per_s']:.1f} requests/s, {summary['generated_tokens_per_s']:.0f} generated tokens/s")
        echo(f"Prefix cache: {cached} of {prompt_tokens} prompt tokens served from cache "
             f"({100 * summary['prefix_cache_hit_rate']:.0f}% hit rate); shared system prompt: {system_tokens} tokens")
        echo(str(usage))
        for worker, engines in stats.items():
            for name, s in engines.items():
                echo(f"  {worker} {name}: prefill computed {s['prefill_tokens_computed']}, cached "
                     f"{s['prefill_tokens_cached']}, decoded {s['decode_tokens']}, mean batch {s['mean_batch_size']:.1f}")
        summary["table"] = table_job(model, max_tokens=min(max_tokens, 12), echo=echo)
        summary["rag"] = rag_job(client, model, max_tokens=min(max_tokens, 24), echo=echo)
        echo(f"Dashboard: {cluster.dashboard_link}; the LLM page: {llm_page}")
        if keep_alive:
            echo(f"Keeping the cluster up for {keep_alive:.0f}s (Ctrl-C to stop) ...")
            try:
                time.sleep(keep_alive)
            except KeyboardInterrupt:
                pass
        return summary
