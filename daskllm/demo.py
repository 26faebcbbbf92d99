"""The main job: a batch of real generations through Dask tasks on resident engines.

A local cluster starts with the embedded engine on every worker; each worker's engine is
warmed with a shared system prompt by a prefill task; then the questions run as Dask
tasks, one per shard of questions, so concurrent requests batch inside each engine.
"""

from __future__ import annotations

import time

from distributed import Client, wait

from daskllm.cluster import LocalLLMCluster
from daskllm.engines import SamplingParams
from daskllm.worker import engine_stats, get_engine, prefill

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


def generate_shard(model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """A generate task over a shard of prompts; they join the engine's running batch together."""
    completions = get_engine(model).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [{"text": c.text, "prompt_tokens": c.num_prompt_tokens, "cached_tokens": c.num_cached_tokens,
             "generated_tokens": len(c.token_ids)} for c in completions]


def run(model: str = "small", n_workers: int = 1, n_requests: int = 32, max_tokens: int = 32,
        shard_size: int = 8, dashboard_address: str = ":8787", keep_alive: float = 0.0, echo=print) -> dict:
    t0 = time.perf_counter()
    echo(f"Starting a local cluster: {n_workers} worker(s), resident engine for model {model!r} ...")
    with LocalLLMCluster(models=[model], n_workers=n_workers, dashboard_address=dashboard_address) as cluster, \
            Client(cluster) as client:
        startup = time.perf_counter() - t0
        echo(f"Cluster up in {startup:.1f}s. Dashboard: {cluster.dashboard_link}")
        workers = list(client.scheduler_info()["workers"])
        prompts = [SYSTEM_PROMPT + q for q in questions(n_requests)]

        t1 = time.perf_counter()
        warm = [client.submit(prefill, model, SYSTEM_PROMPT, workers=[w], pure=False) for w in workers]
        handles = client.gather(warm)
        shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
        futures = client.map(generate_shard, [model] * len(shards), shards, [max_tokens] * len(shards))
        wait(futures)
        results = [r for shard in client.gather(futures) for r in shard]
        elapsed = time.perf_counter() - t1
        stats = client.run(engine_stats)

        generated = sum(r["generated_tokens"] for r in results)
        prompt_tokens = sum(r["prompt_tokens"] for r in results)
        cached = sum(r["cached_tokens"] for r in results)
        summary = {
            "model": model, "workers": n_workers, "requests": len(results), "seconds": elapsed,
            "startup_seconds": startup, "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
            "generated_tokens": generated, "generated_tokens_per_s": generated / elapsed,
            "requests_per_s": len(results) / elapsed, "prefix_cache_hit_rate": cached / prompt_tokens,
            "system_prompt_tokens": handles[0].num_tokens, "dashboard": cluster.dashboard_link,
            "engines": stats,
        }
        echo(f"\nShared system prompt: {handles[0].num_tokens} tokens, prefilled once per worker "
             f"({len(handles[0].block_hashes)} cached blocks).")
        for q, r in list(zip(prompts, results))[:3]:
            echo(f"  Q: {q[len(SYSTEM_PROMPT):].splitlines()[0]}\n  A: {r['text'][:100]!r}")
        echo("  (the model has random weights, so answers are noise; the work is real)\n")
        echo(f"{len(results)} requests in {elapsed:.2f}s through {len(futures)} Dask tasks: "
             f"{summary['requests_per_s']:.1f} requests/s, {summary['generated_tokens_per_s']:.0f} generated tokens/s")
        echo(f"Prefix cache: {cached} of {prompt_tokens} prompt tokens served from cache "
             f"({100 * summary['prefix_cache_hit_rate']:.0f}% hit rate)")
        for worker, engines in stats.items():
            for name, s in engines.items():
                echo(f"  {worker} {name}: prefill computed {s['prefill_tokens_computed']}, cached "
                     f"{s['prefill_tokens_cached']}, decoded {s['decode_tokens']}, mean batch {s['mean_batch_size']:.1f}")
        echo(f"Dashboard: {cluster.dashboard_link}")
        if keep_alive:
            echo(f"Keeping the cluster up for {keep_alive:.0f}s (Ctrl-C to stop) ...")
            try:
                time.sleep(keep_alive)
            except KeyboardInterrupt:
                pass
        return summary
