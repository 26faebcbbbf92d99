"""Streaming on vs off: decode pipelining on an advanced-RAG and a FacTool-shaped pipeline.

    python bench/streaming.py --json out.json
    python bench/streaming.py --quick          # smoke run: tiny model, fewer queries

Cluster: ``LocalLLMCluster(models=[MODEL], n_workers=2, threads_per_worker=4)`` with the
MiniLM embedder and bi-encoder reranker; an index over the first ``--docs`` rows of the
standard-library table (flat, 2 shards).

Pipelines, one per question; ``--loads`` says how many questions are submitted at once (1:
one query's latency on idle engines; 6: engines busy with several queries):

* **advanced RAG** (Teola): expand the question into queries (one generation split into
  items) -> embed -> search (k=4) -> rerank each query's hits against the question -> one
  synthesis generation over all reranked passages (``collect``).
* **FacTool** (Alto): answer the question -> split the answer into claims (a generation split
  into items) -> per claim: generate queries (split) -> search each -> verify the claim
  against the evidence -> aggregate the verdicts in one generation.

The models have random weights, so an item is a fixed number of words (``words(n)``), which
gives each split generation a realistic item count. Greedy decoding with ``ignore_eos``.

After one unrecorded warm-up run of each mode, each repetition runs both modes back to back
(order alternating), from a cold start (result cache off, prefix caches reset): ``on`` =
default passes, ``off`` = the same passes without ``pipeline`` (decodes finish, then each pmap
runs over the complete list; the work items start on workers follows the same settings). Recorded per run:
per-query latency (submit -> result), and for ``on`` the lead time of each stream: its
decode's end minus the start of its first item's work (positive: work started early). The
outputs of both modes must be identical.
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

PASSES = {"on": ["cse", "cache", "prune", "prefix", "pipeline", "stage"],
          "off": ["cse", "cache", "prune", "prefix", "stage"]}


def advanced_rag(question: str, index, model: str, items: int):
    import daskllm

    queries = daskllm.generate(daskllm.prompt("Rewrite the question as several search queries.\nQuestion: {q}\n"
                                              "Queries:\n", q=question), model=model, max_tokens=6 * items,
                               ignore_eos=True, split=daskllm.words(6))
    hits = daskllm.search(index, queries, k=4)
    passages = daskllm.pmap(hits, _rerank_hits, question)
    return daskllm.generate(daskllm.prompt("Answer from the passages.\nPassages:\n{p}\nQuestion: {q}\nAnswer:",
                                           p=daskllm.collect(passages), q=question), model=model, max_tokens=16)


def _rerank_hits(hits, question):
    import daskllm

    return daskllm.rerank(question, [h.text[:400] for h in hits], k=2)


def factool(question: str, index, model: str, items: int):
    import daskllm

    answer = daskllm.generate(daskllm.prompt("Question: {q}\nAnswer:", q=question), model=model, max_tokens=24,
                              ignore_eos=True)
    claims = daskllm.generate(daskllm.prompt("List the claims in this answer, one per line.\nAnswer: {a}\nClaims:\n",
                                             a=answer), model=model, max_tokens=8 * items, ignore_eos=True,
                              split=daskllm.words(8))
    verdicts = daskllm.pmap(claims, _verify_claim, index, model)
    return daskllm.generate(daskllm.prompt("Verdicts:\n{v}\nIs the answer factual overall?", v=daskllm.collect(verdicts)),
                            model=model, max_tokens=8)


def _verify_claim(claim, index, model):
    import daskllm

    queries = daskllm.generate(daskllm.prompt("Search queries to check: {c}\nQueries:\n", c=claim), model=model,
                               max_tokens=12, ignore_eos=True, split=daskllm.words(6))
    evidence = daskllm.collect(daskllm.search(index, queries, k=2))
    return daskllm.generate(daskllm.prompt("Claim: {c}\nEvidence:\n{e}\nVerdict:", c=claim, e=evidence), model=model,
                            max_tokens=6)


PIPELINES = {"advanced_rag": advanced_rag, "factool": factool}


def run_once(client, build, questions, index, model, items, passes) -> dict:
    from daskllm.worker import reset_prefix_caches

    from daskllm.worker.results import RESULTS

    RESULTS.clear()
    client.run(reset_prefix_caches)
    nodes = [build(q, index, model, items) for q in questions]
    start = time.perf_counter()
    latencies, outputs = [], [None] * len(nodes)
    from dask.config import set as config_set

    with config_set({"daskllm.rewrite.passes": passes, "daskllm.rewrite.result-cache": False}):
        from daskllm.runtime.submit import plan_and_submit

        futures = {plan_and_submit([n], client).futures[0]: i for i, n in enumerate(nodes)}
    from distributed import as_completed

    for future in as_completed(futures):
        latencies.append(time.perf_counter() - start)
        outputs[futures[future]] = future.result()[0]
    wall = time.perf_counter() - start
    leads = []
    if "pipeline" in passes:
        for node in nodes:
            leads += [x for x in [_lead(client, node)] if x is not None]
    return {"wall": wall, "median_latency": statistics.median(latencies), "latencies": latencies,
            "outputs": outputs, "lead_times": leads}


def _lead(client, node):
    """The first stream's lead time in this query's pipeline, or None."""
    from daskllm.runtime.submit import plan as lowered
    from daskllm.runtime.metering import _records, _with_children

    keys = {k for layer in lowered([node]).graph.layers.values() for k in layer}
    records = _with_children(_records(keys))
    top = [r for k, r in records.items() if k in keys]
    end = next((r.time for r in top if r.op == "decode" and r.streamed), None)
    first = next((r.first_item_started for r in top if r.op == "pmap" and r.first_item_started), None)
    return None if end is None or first is None else end - first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 6],
                        help="queries submitted at once (1: latency alone; more: engines busy)")
    parser.add_argument("--items", type=int, default=6, help="items per split generation")
    parser.add_argument("--docs", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.loads, args.reps, args.docs = "tiny", [1, 3], 1, 300

    from distributed import Client

    import daskllm
    from daskllm import datasets

    texts = [f"{r.qualname}{r.signature}: {r.doc[:300]}" for r in datasets.load("stdlib-docs", args.docs).itertuples()]
    questions = datasets.load("stdlib-objects", max(args.loads))["question"].astype(str).tolist()
    results = {"machine": machine_info(model=args.model, loads=args.loads, items=args.items, docs=args.docs,
                                       reps=args.reps, cluster="LocalLLMCluster(n_workers=2, threads_per_worker=4)"),
               "runs": {}}
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=2, threads_per_worker=4) as cluster, \
            Client(cluster) as client:
        log("indexing ...")
        index = daskllm.ShardedIndex.from_texts(client, "bench-streaming", texts)
        for name in args.pipelines:
            build = PIPELINES[name]
            for load in args.loads:
                batch = questions[:load]
                runs = {"on": [], "off": []}
                for mode in ("on", "off"):  # warm-up, not recorded: first use of engines, index, imports
                    run_once(client, build, batch, index, args.model, args.items, PASSES[mode])
                for rep in range(args.reps):
                    for mode in (["on", "off"] if rep % 2 == 0 else ["off", "on"]):
                        r = run_once(client, build, batch, index, args.model, args.items, PASSES[mode])
                        runs[mode].append(r)
                        log(f"{name} x{load} rep {rep} {mode}: wall {r['wall']:.2f} s, "
                            f"median latency {r['median_latency']:.2f} s")
                exact = all(r["outputs"] == runs["off"][0]["outputs"] for r in runs["on"] + runs["off"])
                results["runs"][f"{name} x{load}"] = {
                    **{mode: {"median_latency": [r["median_latency"] for r in rs], "wall": [r["wall"] for r in rs],
                              "lead_times": [x for r in rs for x in r["lead_times"]]} for mode, rs in runs.items()},
                    "exact": exact}
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def report(results) -> str:
    m = results["machine"]
    lines = [f"model `{m['model']}`, {m['reps']} repetitions per mode, {m['items']} items per split generation", "",
             "| pipeline x queries at once | median latency off | on | speedup | wall off | on | "
             "lead time, median | streams with lead > 0 | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        off, on = statistics.median(r["off"]["median_latency"]), statistics.median(r["on"]["median_latency"])
        woff, won = statistics.median(r["off"]["wall"]), statistics.median(r["on"]["wall"])
        leads = r["on"]["lead_times"]
        lead = f"{statistics.median(leads):.2f} s" if leads else "n/a"
        ahead = f"{sum(x > 0 for x in leads)} of {len(leads)}" if leads else "n/a"
        lines.append(f"| {name} | {off:.2f} s | {on:.2f} s | {off / on:.2f}x | {woff:.2f} s | {won:.2f} s | {lead} | "
                     f"{ahead} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
