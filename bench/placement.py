"""Benchmark of the placement policies of the scheduler plugin on a multi-worker cluster.

    python bench/placement.py --json out.json
    python bench/placement.py --quick          # smoke run: 2 workers, fewer questions, < 60 s

Cluster: ``LocalLLMCluster(models=["tiny"], n_workers=4, threads_per_worker=4,
engine_options={"kv_cache_tokens": 16384}, embedders=(), rerankers=())``: the ``tiny`` model
so that four engines fit on a small CPU box (no embedder or reranker is loaded: this
benchmark does not use them). Workers share the machine's cores, so on a 2-core box the
engines compete for CPU and per-task overheads (Dask, tokenization, Python) dominate.

Workloads, each a list of ``daskllm.generate(daskllm.prompt(SYSTEM_i + "{q}\\nAnswer:",
q=questions_i), max_tokens=8)`` nodes over 4 system prompts of about 150 tokens:

* ``balanced``: every system prompt gets ``--questions`` questions;
* ``skewed``: system prompt 0 gets 80% of ``4 x --questions`` calls, the other three share the rest.

Each is computed with ``daskllm.compute(*nodes)``, every pass on, as a user computes them: at
``--questions`` 8 (``--quick``) the plan runs as parts (a worker task per shard of calls, each
annotated with the prefix its calls share), larger ones with prefill and decode tasks. With
``--plugin-alone`` it is ``daskllm.compute(*nodes, passes=["cse"], granularity="query")``: one
task per call and no prefill tasks, so the placement plugin alone decides where prefixes are
computed. For every policy (``cache_aware``, ``round_robin``, ``least_loaded``,
``prefix_affinity``, ``off``) and workload: cold start (result cache cleared, every worker's
prefix cache reset, and a wait until the scheduler's shadow of the worker caches is empty),
switch the policy on the running scheduler plugin, run, and record

* makespan: wall time of the ``daskllm.compute`` call (lowering included, the same for all);
* hit rate: engine counter deltas summed over workers,
  ``prefill_tokens_cached / (prefill_tokens_cached + prefill_tokens_computed)``;
* tokens per worker: ``prefill_tokens_computed + decode_tokens`` deltas per worker, and the
  imbalance ``max / mean`` of that over all workers;
* exactness: the outputs of every policy equal those of the first one run.

Ideal hit rate (computed from the ``cache_aware`` run): with ``P_s`` the full-block shared
prefix of system prompt ``s`` (the common prefix of the block-hash chains in the tasks'
placement annotations, times the block size), ``n_s`` its number of calls and ``W_s`` the
number of workers that ran at least one of its calls under ``cache_aware``, every call but
the first on each worker is served ``P_s`` tokens from cache and everything else is computed:
``ideal = sum_s (n_s - W_s) * P_s / total prompt tokens``. (Calls whose questions share
further full blocks can make the measured rate exceed this slightly; and since ``W_s`` comes from
``cache_aware``'s own placement, a policy that spreads a prefix over fewer workers can exceed
it. The table also gives the one-copy bound, ``W_s = 1``: each prefix computed once in all.)

Policies are interleaved within each repetition (every repetition runs every policy once, in
a rotated order) and medians over ``--repeats`` are reported. Exits with status 1 if outputs
ever differ between policies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

from machine import log
from machine import machine_info as shared_machine_info

from daskllm.placement import set_policy

POLICIES = ["cache_aware", "round_robin", "least_loaded", "prefix_affinity", "off"]
TOPICS = ["parse a date string", "read a CSV file", "merge two dictionaries", "sort a list of tuples",
          "retry a failed HTTP request", "profile a slow function", "write a context manager",
          "format a float", "walk a directory tree", "compare two files"]


def system_prompt(n: int) -> str:
    # About 150 tokens; the number first, so prompts differ from their first block on.
    return (f"System prompt {n}. You are assistant number {n} of a documentation team. "
            + f"Answer the user's question about the Python standard library in one short sentence, "
              f"name the module you rely on, and never invent functions that do not exist (rule {n}). " * 3)


def questions(n_system: int, count: int) -> list[str]:
    return [f"Question {i} for team {n_system}: how do I {TOPICS[i % len(TOPICS)]} (case {i // len(TOPICS)})?"
            for i in range(count)]


def workloads(n_questions: int, n_systems: int = 4) -> dict[str, list[tuple[str, list[str]]]]:
    balanced = [(system_prompt(s), questions(s, n_questions)) for s in range(n_systems)]
    total = n_questions * n_systems
    hot = round(0.8 * total)
    rest = total - hot
    cold = [rest // (n_systems - 1) + (1 if i < rest % (n_systems - 1) else 0) for i in range(n_systems - 1)]
    skewed = [(system_prompt(0), questions(0, hot))] + [(system_prompt(s + 1), questions(s + 1, c))
                                                        for s, c in enumerate(cold)]
    return {"balanced": balanced, "skewed": skewed}


def build(spec, max_tokens: int, model: str):
    import daskllm

    return [daskllm.generate(daskllm.prompt(system + "{q}\nAnswer:", q=qs), model=model, max_tokens=max_tokens)
            for system, qs in spec]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--threads-per-worker", type=int, default=4)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--questions", type=int, default=32, help="questions per system prompt (balanced workload)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="interleaved repetitions; medians are reported")
    p.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    p.add_argument("--workloads", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    p.add_argument("--plugin-alone", action="store_true",
                   help='plan with passes=["cse"], granularity="query": one task per call, no prefill tasks')
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 workers, 8 questions, 1 repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.workers = 2
        args.questions = 8
        args.repeats = 1
    return args


def machine_info() -> dict:
    return shared_machine_info()


# --- cluster helpers (as tests/test_placement.py does) ---------------------------------------

def _reported(dask_scheduler):
    return sum(len(h) for ws in dask_scheduler.workers.values()
               for h in ((ws.metrics or {}).get("daskllm") or {}).get("cache", {}).values())


def cold_start(client, timeout: float = 30.0) -> float:
    """Empty result and prefix caches; wait until the scheduler's view says so too. Returns the wait."""
    from daskllm.worker.results import RESULTS
    from daskllm.worker import reset_prefix_caches

    RESULTS.clear()
    client.run(reset_prefix_caches)
    start = time.perf_counter()
    while client.run_on_scheduler(_reported) != 0:
        if time.perf_counter() - start > timeout:
            raise TimeoutError("worker cache reports did not empty")
        time.sleep(0.05)
    return time.perf_counter() - start


def decisions(client) -> dict:
    return client.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.plugins["daskllm-placement"].decisions))


def annotations(nodes, settings: dict) -> dict:
    """decode task (or part) key -> its placement annotation, for the plan the benchmark computes."""
    from daskllm.runtime.submit import overrides
    from daskllm.runtime.submit import plan as lowered

    with overrides(settings):
        low = lowered(nodes)
    return {key: ann for key, ann in low.annotations.items() if ann.get("op") == "decode"}


def run_once(client, model: str, nodes, policy: str, settings: dict) -> dict:
    from distributed import get_task_stream

    import daskllm
    from daskllm.worker import engine_stats

    wait = cold_start(client)
    set_policy(client, policy)
    before, dec_before = client.run(engine_stats), decisions(client)
    with get_task_stream(client) as stream:
        t0 = time.perf_counter()
        values = daskllm.compute(*nodes, **settings)
        makespan = time.perf_counter() - t0
    after, dec_after = client.run(engine_stats), decisions(client)
    per_worker, cached, computed = {}, 0, 0
    for w in sorted(after):
        a, b = after[w][model], before[w][model]
        c = a["prefill_tokens_cached"] - b["prefill_tokens_cached"]
        p = a["prefill_tokens_computed"] - b["prefill_tokens_computed"]
        d = a["decode_tokens"] - b["decode_tokens"]
        cached, computed = cached + c, computed + p
        per_worker[w] = {"cached": c, "prefill_computed": p, "decode": d, "work": p + d}
    work = [v["work"] for v in per_worker.values()]
    mean = sum(work) / len(work)
    return {"policy": policy, "makespan_s": makespan, "cold_wait_s": wait,
            "prefill_cached": cached, "prefill_computed": computed,
            "hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "per_worker": per_worker, "imbalance": max(work) / mean if mean else 0.0,
            "decisions": {k: dec_after.get(k, 0) - dec_before.get(k, 0) for k in dec_after
                          if dec_after.get(k, 0) - dec_before.get(k, 0)},
            "ran_on": {t["key"]: t["worker"] for t in stream.data},
            "values": [list(v) if isinstance(v, (list, tuple)) else v for v in values]}


def ideal_hit_rate(anns: dict, ran_on: dict, total_prompt_tokens: int, block: int) -> dict:
    groups: dict[str, list] = defaultdict(list)
    for key, ann in anns.items():
        groups[(ann["prefix"] or ["-"])[0]].append(key)
    saved, bound, detail = 0, 0, []
    for keys in groups.values():
        chains = [anns[k]["prefix"] for k in keys]
        common = chains[0]
        for c in chains[1:]:
            n = next((i for i, (a, b) in enumerate(zip(common, c)) if a != b), min(len(common), len(c)))
            common = common[:n]
        shared = len(common) * block
        workers = {ran_on[k] for k in keys if k in ran_on}
        calls = sum(int(anns[k].get("shard", 1)) for k in keys)  # a part or shard task holds several
        saved += (calls - len(workers)) * shared
        bound += (calls - 1) * shared
        detail.append({"calls": calls, "shared_prefix_tokens": shared, "workers": len(workers)})
    detail.sort(key=lambda d: -d["calls"])
    rate = (lambda x: x / total_prompt_tokens if total_prompt_tokens else 0.0)
    return {"ideal_hit_rate": rate(saved), "one_copy_hit_rate": rate(bound), "groups": detail}


def markdown(summary: dict, args) -> str:
    lines = []
    for wl, rows in summary.items():
        ideal = rows["_ideal"]
        lines.append(f"\n**{wl}** ({ideal['calls']} calls; ideal hit rate {ideal['ideal_hit_rate']:.1%}; "
                     f"one copy per prefix {ideal['one_copy_hit_rate']:.1%}; "
                     f"groups (calls / shared prefix tokens / workers under cache_aware): "
                     + ", ".join(f"{g['calls']}/{g['shared_prefix_tokens']}/{g['workers']}" for g in ideal["groups"])
                     + ")\n")
        lines.append("| policy | makespan s (median) | makespan s (runs) | hit rate | % of ideal | "
                     "tokens per worker (prefill computed + decode) | max/mean | outputs equal |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for policy in args.policies:
            r = rows[policy]
            lines.append(f"| {policy} | {r['makespan_s']:.2f} | {', '.join(f'{m:.2f}' for m in r['makespans'])} | "
                         f"{r['hit_rate']:.1%} | {r['hit_rate'] / ideal['ideal_hit_rate']:.0%} | "
                         f"{' / '.join(str(int(t)) for t in r['work'])} | {r['imbalance']:.2f} | "
                         f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)

    from distributed import Client

    from daskllm import config
    from daskllm.cluster import LocalLLMCluster
    from daskllm.worker import resident_models

    info = machine_info()
    started = time.perf_counter()
    load_before = os.getloadavg()
    block = int(config.get("engine.block-size"))
    specs = {wl: workloads(args.questions)[wl] for wl in args.workloads}
    raw: dict = {wl: defaultdict(list) for wl in specs}
    reference: dict = {}
    exact = True
    log(f"{args.workers} workers x {args.threads_per_worker} threads, model {args.model}, "
        f"{info['cpu_count']} CPUs ({info['cpu_model']}), load {load_before[0]:.2f}")
    with LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=args.threads_per_worker,
                         engine_options={"kv_cache_tokens": args.kv_cache_tokens}, embedders=(), rerankers=(),
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        client.wait_for_workers(args.workers, timeout=180)
        resident_models(client)  # engines loaded: their counters exist
        model = cluster.models[0]
        startup = time.perf_counter() - started
        log(f"cluster up in {startup:.1f}s")
        settings = {"passes": ["cse"], "granularity": "query"} if args.plugin_alone else {}
        nodes = {wl: build(spec, args.max_tokens, model) for wl, spec in specs.items()}
        anns = {wl: annotations(nodes[wl], settings) for wl in specs}
        for rep in range(args.repeats):
            order = args.policies[rep % len(args.policies):] + args.policies[:rep % len(args.policies)]
            for wl in specs:
                for policy in order:
                    r = run_once(client, model, nodes[wl], policy, settings)
                    ref = reference.setdefault(wl, r["values"])
                    r["exact"] = r["values"] == ref
                    exact &= r["exact"]
                    del r["values"]
                    raw[wl][policy].append(r)
                    log(f"rep {rep} {wl:8s} {policy:15s} {r['makespan_s']:6.2f}s hit {r['hit_rate']:.1%} "
                        f"max/mean {r['imbalance']:.2f} exact {r['exact']} {r['decisions']}")
    summary: dict = {}
    for wl in specs:
        ca = raw[wl]["cache_aware"][0] if "cache_aware" in raw[wl] else next(iter(raw[wl].values()))[0]
        ideal = ideal_hit_rate(anns[wl], ca["ran_on"], ca["prefill_cached"] + ca["prefill_computed"], block)
        ideal["calls"] = sum(int(a.get("shard", 1)) for a in anns[wl].values())
        rows: dict = {"_ideal": ideal}
        for policy, runs in raw[wl].items():
            med = statistics.median
            rows[policy] = {
                "makespan_s": med(r["makespan_s"] for r in runs), "makespans": [r["makespan_s"] for r in runs],
                "hit_rate": med(r["hit_rate"] for r in runs), "imbalance": med(r["imbalance"] for r in runs),
                "work": [med(r["per_worker"][w]["work"] for r in runs) for w in sorted(runs[0]["per_worker"])],
                "exact": all(r["exact"] for r in runs)}
        summary[wl] = rows
    for per_policy in raw.values():  # ran_on is large and only needed for the ideal
        for runs in per_policy.values():
            for r in runs:
                r.pop("ran_on", None)
    total_s = time.perf_counter() - started
    table = markdown(summary, args)
    print(table)
    goals = []
    for wl, rows in summary.items():
        if "cache_aware" not in rows:
            continue
        ca, ideal = rows["cache_aware"], rows["_ideal"]["ideal_hit_rate"]
        others = [p for p in args.policies if p != "cache_aware"]
        fastest_other = min((rows[p]["makespan_s"] for p in others), default=float("inf"))
        goals.append(f"{wl}: hit rate >= 90% of ideal: {'met' if ca['hit_rate'] >= 0.9 * ideal else 'NOT met'} "
                     f"({ca['hit_rate'] / ideal:.0%}); max/mean < 1.3: "
                     f"{'met' if ca['imbalance'] < 1.3 else 'NOT met'} ({ca['imbalance']:.2f}); fastest: "
                     f"{'met' if ca['makespan_s'] < fastest_other else 'NOT met'} "
                     f"({ca['makespan_s']:.2f}s vs best other {fastest_other:.2f}s)")
    print("\n" + "\n".join(goals))
    print(f"\ntotal {total_s:.0f}s (cluster start {startup:.0f}s); {args.workers} workers x "
          f"{args.threads_per_worker} threads, {info['cpu_count']} CPUs ({info['cpu_model']}); "
          f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
    if args.json:
        payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args), "machine": info,
                   "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "total_seconds": total_s, "summary": summary, "raw": raw, "markdown": table, "goals": goals}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        log(f"wrote {args.json}")
    if not exact:
        log("ERROR: outputs differ between placement policies")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
