"""Reference pipelines: the workloads of the five papers daskllm implements, as daskllm programs.

Each module holds pipelines ``fn(inputs, ops=None, *, model=..., **config)`` that build a
batch of queries (:class:`pipelines.data.Inputs`) into daskllm nodes, and a ``__main__``
that runs them on a local cluster. Written against :mod:`pipelines.ops`, the same code also
runs eagerly, which is how the benchmark's baselines run it (see ``bench/harness.py``).

    python -m pipelines.halo --pipeline w2 --queries 8            # smollm2, the default model
"""

from __future__ import annotations

import importlib

MODULES = ("teola", "halo", "helium", "alto", "harmonia")
# Pipelines that use a second model (Halo's MULTI variants).
TWO_MODELS = {"w3", "w5"}


def registry() -> dict:
    """Every pipeline by name: ``{"naive_rag": teola.naive_rag, ...}``."""
    found = {}
    for name in MODULES:
        module = importlib.import_module(f"pipelines.{name}")
        for pipeline, fn in module.PIPELINES.items():
            found[pipeline] = fn
    return found


def main(pipelines: dict, argv=None) -> None:
    """Run one of ``pipelines`` on a local cluster and print its answers."""
    import argparse
    import time

    from distributed import Client

    import daskllm
    from pipelines.data import make_inputs

    parser = argparse.ArgumentParser(description="Run a reference pipeline on a local cluster.")
    parser.add_argument("--pipeline", choices=sorted(pipelines), default=next(iter(pipelines)))
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--model", default=daskllm.config.get("model"),
                        help="recipe name or local HF model directory (default: daskllm.model, smollm2)")
    parser.add_argument("--model2", default=None,
                        help="the second model of two-model pipelines (w3, w5); default: --model")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--source", default="auto", help="questions: auto, stdlib, hotpotqa, parallelqa, movies")
    parser.add_argument("--index-docs", type=int, default=2000, help="documentation passages in the search index")
    args = parser.parse_args(argv)

    two = args.pipeline in TWO_MODELS and args.model2 is not None
    models = list(dict.fromkeys([args.model] + ([args.model2] if two else [])))
    config = {"model": args.model, "max_tokens": args.max_tokens, **({"model2": args.model2} if two else {})}
    with daskllm.LocalLLMCluster(models=models, n_workers=args.workers, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        print(f"dashboard: {cluster.dashboard_link}")
        inputs = make_inputs(client, args.queries, source=args.source, index_docs=args.index_docs)
        nodes = pipelines[args.pipeline](inputs, **config)
        start = time.perf_counter()
        with daskllm.usage() as usage:
            (answers,) = daskllm.compute(nodes)
        seconds = time.perf_counter() - start
    for question, answer in zip(inputs.questions, answers):
        print(f"Q: {question[:100]}\nA: {str(answer)[:160]!r}\n")
    print(f"{args.pipeline}: {len(inputs)} queries in {seconds:.2f} s\n{usage}")
