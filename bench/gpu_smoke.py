"""GPU smoke test: a one-worker cluster with a resident vLLM engine, a shared-prefix batch
through the task graph, exactness against the naive graph, throughput and hit rate.

    pip install -e '.[vllm]'            # on a machine with one CUDA GPU
    python bench/gpu_smoke.py --model llama-1b --queries 256
    python bench/gpu_smoke.py --model llama-8b --queries 1024 --json gpu.json
    python bench/gpu_smoke.py --model /models/Llama-3.1-8B-Instruct   # real weights

``llama-1b`` and ``llama-8b`` are recipes with Llama-3.2-1B's and Llama-3-8B's shapes (with
our 16K-token vocabulary) and dummy weights (vLLM's ``load_format="dummy"``): the text is
noise, the work is real, and every token decodes to text, so comparing texts compares tokens.
``--backend torch`` runs the same script on the embedded engine (any machine).

The workload: ``--systems`` system prompts of ~``--system-tokens`` tokens, each shared by
``--queries / --systems`` questions, ``--max-tokens`` greedy tokens per answer. It runs the
same nodes naive (no rewrites, one task per call, no result cache) and optimized (the
defaults), interleaved ``--repeats`` times with the engine's prefix cache emptied before
every run. Exit status 1 if any optimized answer differs from the naive one. On vLLM the
engine runs with ``VLLM_BATCH_INVARIANT=1`` (vLLM's batch-invariant kernels), without
which batching alone may change greedy tokens; ``--no-batch-invariant`` measures vLLM's
default kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from machine import log, machine_info

import daskllm

WORDS = ("parse", "stream", "cache", "index", "thread", "socket", "decode", "table", "shard", "merge", "query",
         "batch", "vector", "token", "graph", "worker", "lock", "queue", "retry", "schema")


def workload(args) -> list:
    import random

    rng = random.Random(0)
    nodes = []
    per_system = max(1, args.queries // args.systems)
    for s in range(args.systems):
        system = f"System {s}. You are a precise assistant for data engineers. " + " ".join(
            rng.choice(WORDS) for _ in range(args.system_tokens))
        questions = [f"Question {s}-{i}: how do I {' '.join(rng.sample(WORDS, 4))}?" for i in range(per_system)]
        prompt = daskllm.prompt(system + "\n{q}\nAnswer:", q=questions)
        nodes.append(daskllm.generate(prompt, model=args.model, max_tokens=args.max_tokens, ignore_eos=True))
    return nodes


def run(client, nodes, settings: dict) -> dict:
    from daskllm.runtime.control import cold_start
    from harness import engine_totals

    cold_start(client)
    before = engine_totals(client)
    start = time.perf_counter()
    results = daskllm.compute(*nodes, **settings)
    seconds = time.perf_counter() - start
    after = engine_totals(client)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    prompt = delta["prefill_tokens_computed"] + delta["prefill_tokens_cached"]
    return {"seconds": seconds, "outputs": results,
            "decode_tokens_per_s": delta["decode_tokens"] / seconds,
            "tokens_per_s": (delta["decode_tokens"] + prompt) / seconds,
            "hit_rate": delta["prefill_tokens_cached"] / prompt if prompt else 0.0,
            "mean_batch": delta["batched_sequences"] / delta["steps"] if delta["steps"] else 0.0, **delta}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "torch", "auto"])
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=64, help="Dask threads on the worker (concurrent tasks)")
    parser.add_argument("--option", action="append", default=[], help="engine option KEY=VALUE")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="vLLM's default kernels (faster; batching may then change greedy tokens)")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args(argv)

    from daskllm.cluster import LocalLLMCluster
    from daskllm.preload import _parse_option
    from distributed import Client

    options = dict(_parse_option(o) for o in args.option)
    if args.backend == "vllm":
        options.setdefault("batch_invariant", args.batch_invariant)
    spec = {"model": args.model, "backend": args.backend, "options": options}
    log(f"starting a one-worker cluster with {args.model} on {args.backend}")
    started = time.perf_counter()
    with LocalLLMCluster(models=[spec], embedders=(), rerankers=(), n_workers=1, threads_per_worker=args.threads,
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        log(f"engine up in {time.perf_counter() - started:.0f} s; dashboard {client.dashboard_link}")
        nodes = workload(args)
        daskllm.compute(nodes[0], result_cache=False)  # warm-up: CUDA graphs, allocator
        settings = {"naive": {"passes": [], "granularity": "query", "result_cache": False},
                    "optimized": {"result_cache": False}}
        runs: dict[str, list[dict]] = {name: [] for name in settings}
        for repeat in range(args.repeats):
            for name in (list(settings) if repeat % 2 == 0 else list(reversed(settings))):
                r = run(client, nodes, settings[name])
                runs[name].append(r)
                log(f"{name:9s} {r['seconds']:7.2f} s  {r['decode_tokens_per_s']:8.0f} decode tok/s  "
                    f"hit rate {r['hit_rate']:.2f}  mean batch {r['mean_batch']:.1f}")
        from daskllm.worker import gpu_metrics

        info = client.run(gpu_metrics)
    reference = runs["naive"][0]["outputs"]
    exact = all(r["outputs"] == reference for rs in runs.values() for r in rs)
    speedups = [n["seconds"] / o["seconds"] for n, o in zip(runs["naive"], runs["optimized"])]
    summary = {
        "model": args.model, "backend": args.backend, "queries": args.queries, "systems": args.systems,
        "max_tokens": args.max_tokens, "exact": exact, "speedup": statistics.median(speedups),
        **{f"{name}_{key}": statistics.median(r[key] for r in rs) for name, rs in runs.items()
           for key in ("seconds", "decode_tokens_per_s", "tokens_per_s", "hit_rate", "mean_batch")},
        "gpu": next(iter(info.values()), None), "machine": machine_info(),
    }
    print(f"| model | backend | queries | naive s | optimized s | speedup | decode tok/s (opt) | hit rate naive/opt "
          f"| exact |\n|---|---|---|---|---|---|---|---|---|\n| {args.model} | {args.backend} | {args.queries} | "
          f"{summary['naive_seconds']:.2f} | {summary['optimized_seconds']:.2f} | {summary['speedup']:.2f}x | "
          f"{summary['optimized_decode_tokens_per_s']:.0f} | {summary['naive_hit_rate']:.2f}/"
          f"{summary['optimized_hit_rate']:.2f} | {exact} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": {k: [{x: y for x, y in r.items() if x != "outputs"} for r in v]
                                                     for k, v in runs.items()}}, f, indent=2, default=str)
    if not exact:
        log("optimized outputs differ from the naive ones")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
