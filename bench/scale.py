"""Scale: planning time and throughput for big batches and big graphs (Halo, Section 4.5).

    python bench/scale.py --json scale.json
    python bench/scale.py --quick            # small sizes, for a smoke run

1. **Planning.** Halo's W5 (three judges on one model, an aggregator on another) at
   ``--plan-sizes`` queries, and W5 extended to ``--operators`` operators (rounds of three
   judges and an aggregator, each round reading the last decision) at the first size: the
   time to build the nodes and to plan and lower them (``daskllm.runtime.submit.plan``:
   every rewrite pass and the Dask graph), and the tasks that makes. Nothing runs; only the
   tokenizer is loaded. Cold: the lowering memo and result cache are cleared first.
2. **Throughput.** ``--run-queries`` queries through Halo's W2 on a ``--workers``-worker
   cluster, daskllm (everything on) against plain Dask (a task per call, no rewrites,
   placement off), one after the other from cold caches; outputs must be equal.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import log, machine_info  # noqa: E402


def judges_rounds(inputs, ops=None, *, model: str = "tiny", model2: str = "tiny", rounds: int = 25,
                  max_tokens: int = 8):
    """W5 stretched: ``rounds`` rounds of three judges and an aggregator (4 operators each)."""
    from pipelines.halo import AGGREGATE, JUDGE, PERSPECTIVES
    from pipelines.ops import Lazy

    ops = ops or Lazy(model)
    q = inputs.questions
    decision = None
    for _ in range(rounds):
        case = q if decision is None else decision
        judgments = {f"j{i}": ops.generate(JUDGE, view=view, q=case, model=model2, max_tokens=max_tokens)
                     for i, view in enumerate(PERSPECTIVES)}
        decision = ops.generate(AGGREGATE, q=case, max_tokens=max_tokens, **judgments)
    return decision


def distinct_questions(n: int) -> list[str]:
    """``n`` different questions (the stdlib set has about 2,000; repeats would be merged by CSE)."""
    from pipelines.data import questions

    return [f"{q} (case {i})" for i, q in enumerate(questions(n, "stdlib"))]


def plan_once(build) -> dict:
    from daskllm.runtime import submit as lower
    from daskllm.prompts import PromptTokenizer
    from daskllm.worker.results import RESULTS

    lower._plans.clear()
    RESULTS.clear()
    PromptTokenizer.encode.cache_clear()
    gc.collect()
    t0 = time.perf_counter()
    nodes = build()
    t1 = time.perf_counter()
    planned = lower.plan([nodes])
    t2 = time.perf_counter()
    return {"build_s": t1 - t0, "plan_and_lower_s": t2 - t1, "tasks": dict(planned.report["tasks"]),
            "calls": sum(planned.report["requested"].get(op, 0) for op in ("generate",))}


def bench_planning(sizes: list[int], operators: int) -> list[dict]:
    from pipelines.data import Inputs
    from pipelines.halo import w5

    out = []
    for n in sizes:
        inputs = Inputs(distinct_questions(n))
        r = plan_once(lambda: w5(inputs, model="tiny", model2="tiny", max_tokens=8))
        out.append({"workflow": "w5", "operators": 4, "queries": n, **r})
        log(f"plan w5 x {n}: build {r['build_s']:.2f} s, plan+lower {r['plan_and_lower_s']:.2f} s, tasks {r['tasks']}")
    n = sizes[0]
    inputs = Inputs(distinct_questions(n))
    rounds = max(1, operators // 4)
    r = plan_once(lambda: judges_rounds(inputs, rounds=rounds))
    out.append({"workflow": f"w5 x {rounds} rounds", "operators": 4 * rounds, "queries": n, **r})
    log(f"plan {4 * rounds} operators x {n}: build {r['build_s']:.2f} s, plan+lower {r['plan_and_lower_s']:.2f} s")
    return out


def bench_throughput(n: int, workers: int, max_tokens: int) -> dict:
    from distributed import Client

    import daskllm
    from daskllm.placement import set_policy
    from daskllm.runtime.control import cold_start
    from pipelines.data import Inputs
    from pipelines.halo import w2
    from pipelines.ops import NAIVE_HELD

    inputs = Inputs(distinct_questions(n))
    result = {"queries": n, "workers": workers, "max_tokens": max_tokens, "workflow": "w2"}
    with daskllm.LocalLLMCluster(models=["tiny"], n_workers=workers, threads_per_worker=8,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        daskllm.compute(w2(inputs.subset(0, 8), max_tokens=max_tokens))  # warm-up
        outputs = {}
        for system in ("daskllm", "dask"):
            cold_start(client)
            set_policy(client, "cache_aware" if system == "daskllm" else "off")
            settings = {} if system == "daskllm" else NAIVE_HELD
            t0 = time.perf_counter()
            (outputs[system],) = daskllm.compute(w2(inputs, max_tokens=max_tokens), **settings)
            result[f"{system}_s"] = time.perf_counter() - t0
            result[f"{system}_queries_per_s"] = n / result[f"{system}_s"]
            log(f"throughput {system}: {n} queries in {result[f'{system}_s']:.1f} s")
    result["speedup"] = result["dask_s"] / result["daskllm_s"]
    result["exact"] = outputs["daskllm"] == outputs["dask"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan-sizes", default="2000,20000")
    parser.add_argument("--operators", type=int, default=100)
    parser.add_argument("--run-queries", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.quick:
        args.plan_sizes, args.operators, args.run_queries = "200,400", 20, 64
    planning = bench_planning([int(s) for s in args.plan_sizes.split(",")], args.operators)
    throughput = bench_throughput(args.run_queries, args.workers, args.max_tokens) if args.run_queries else None
    print("| workflow | operators | queries | build s | plan + lower s | tasks |\n|---|---|---|---|---|---|")
    for r in planning:
        print(f"| {r['workflow']} | {r['operators']} | {r['queries']} | {r['build_s']:.2f} | "
              f"{r['plan_and_lower_s']:.2f} | {sum(r['tasks'].values())} |")
    if throughput:
        t = throughput
        print(f"\nW2, {t['queries']} queries, {t['workers']} workers, tiny, {t['max_tokens']} tokens per call: "
              f"daskllm {t['daskllm_s']:.1f} s ({t['daskllm_queries_per_s']:.1f} q/s), plain Dask {t['dask_s']:.1f} s "
              f"({t['dask_queries_per_s']:.1f} q/s): {t['speedup']:.2f}x, exact: {t['exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planning": planning, "throughput": throughput, "machine": machine_info(),
                       "command": " ".join(sys.argv)}, f, indent=2, default=str)
    return 0 if throughput is None or throughput["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
