"""Scheduling quality offline (Helium, Section 5 and Tables 5-7): how good is the order
daskllm runs LLM calls in, against the optimum and against other orders?

    python bench/scheduling.py --json scheduling.json
    python bench/scheduling.py --quick        # two small instances, short solver limit

The instances are Helium's small workflows (Table 6): MapRed, Debate, Reflect, Iterative
and Parallel at batch 2, their LLM calls taken from a real naive run on the ``tiny`` model
(each call's prompt as a chain of KV-cache block hashes, its output length, and which calls
it waits for). On one worker with a KV cache of ``--capacity`` tokens, each order is costed
with Helium's token-step model:

- a call's prefill usage is the prompt tokens it does not share with the call before it;
  its decode usage is ``L (L + 1) / 2`` for ``L`` output tokens; it takes
  ``u = (L x prefill + decode) / M`` token steps (``M`` the capacity);
- a call that needs another's output starts at least ``L`` token steps after it ends (the
  precedence delay that models batching);
- the cost ``T`` of an order is the token step at which the last call ends.

Orders compared (all list schedules: the worker takes the best-ranked call that is ready):

- ``querywise``: one query after another (a query starts when the last one ended);
  ``opwise``: operator by operator over the batch (a barrier after each operator level);
- ``random``: any ready call (the mean of ``--random-seeds`` seeds);
- ``lspf``: longest shared prefix with the previous call first (online prefix-aware);
- ``daskllm``: the placement plugin's priorities: deeper calls first, calls sharing a first
  block back to back, then Dask's own order;
- ``optimal``: a MILP (positions, consecutive pairs, start/end times, big-M precedence),
  solved by HiGHS through ``scipy.optimize.milp`` within ``--time-limit`` seconds; its
  reported gap says how close to proven optimal it got.

Also (Helium's Table 5 without its latency column): the prefix-cache hit rate of each order
on the Trading workflow at batch ``--hit-batch``, its calls run in that order on an LRU block
cache of each of ``--cache-tokens`` sizes (too many calls for the MILP; no optimum there).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import log, machine_info  # noqa: E402

BLOCK = 16


@dataclass
class Call:
    key: str
    blocks: list[int]  # chained hashes of the prompt's full blocks
    tail: tuple[int, int]  # (hash, length) of the partial last block
    out: int  # output tokens
    preds: set[int]  # indexes of the calls it waits for
    query: int = 0
    level: int = 0
    order: int = 0  # Dask's order

    @property
    def prompt(self) -> int:
        return len(self.blocks) * BLOCK + self.tail[1]


def shared(a: Call | None, b: Call) -> int:
    """Prompt tokens ``b`` shares with ``a`` (a common prefix of whole blocks, or all of it)."""
    if a is None:
        return 0
    n = 0
    for x, y in zip(a.blocks, b.blocks):
        if x != y:
            break
        n += 1
    if n == len(a.blocks) == len(b.blocks) and a.tail == b.tail:
        return b.prompt
    return n * BLOCK


def usage(call: Call, prev: Call | None, capacity: int) -> float:
    """Token steps ``call`` takes right after ``prev``: (L x unshared prompt + L(L+1)/2) / M."""
    return (call.out * (call.prompt - shared(prev, call)) + call.out * (call.out + 1) / 2) / capacity


def token_steps(calls: list[Call], order: list[int], capacity: int) -> float:
    """Helium's cost T of running ``calls`` in ``order`` on one worker."""
    end: dict[int, float] = {}
    t, prev = 0.0, None
    for i in order:
        c = calls[i]
        start = max([t] + [end[p] + calls[p].out for p in c.preds])
        end[i] = start + usage(c, prev, capacity)
        t, prev = end[i], c
    return t


def hit_rate(calls: list[Call], order: list[int], cache_tokens: int) -> float:
    """Prompt tokens served from an LRU block cache when the calls run in ``order``."""
    cache: OrderedDict = OrderedDict()
    capacity = cache_tokens // BLOCK
    hits = total = 0
    for i in order:
        c = calls[i]
        total += c.prompt
        for h in c.blocks:
            if h not in cache:
                break
            hits += BLOCK
            cache.move_to_end(h)
        for h in c.blocks:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / total if total else 0.0


def list_schedule(calls: list[Call], rank, capacity: int, barrier=None) -> list[int]:
    """The worker takes the best-ranked ready call; if none is ready, it waits for the first.
    With ``barrier(i)`` (a group number), a call waits until every call of earlier groups ended."""
    n, done, order = len(calls), {}, []
    t, prev = 0.0, None
    group = [barrier(i) if barrier else 0 for i in range(n)]
    while len(order) < n:
        current = min(group[i] for i in range(n) if i not in done)
        waiting = [i for i in range(n) if i not in done and group[i] == current
                   and all(p in done for p in calls[i].preds)]
        ready_at = {i: max([t] + [done[p] + calls[p].out for p in calls[i].preds]) for i in waiting}
        soonest = min(ready_at.values())
        ready = [i for i in waiting if ready_at[i] <= max(t, soonest)]
        i = min(ready, key=lambda j: rank(j, prev))
        done[i] = ready_at[i] + usage(calls[i], calls[prev] if prev is not None else None, capacity)
        t, prev = done[i], i
        order.append(i)
    return order


def orders(calls: list[Call], capacity: int, seeds: int) -> dict[str, list[list[int]]]:
    def lspf(j, prev):
        return (-shared(calls[prev] if prev is not None else None, calls[j]), calls[j].order)

    def daskllm(j, prev):
        first = calls[j].blocks[0] if calls[j].blocks else 0
        return (-calls[j].level, first, calls[j].order)

    out = {"querywise": [list_schedule(calls, lambda j, p: (calls[j].level, calls[j].order), capacity,
                                       barrier=lambda j: calls[j].query)],
           "opwise": [list_schedule(calls, lambda j, p: (calls[j].query, calls[j].order), capacity,
                                    barrier=lambda j: calls[j].level)],
           "random": [], "lspf": [list_schedule(calls, lspf, capacity)],
           "daskllm": [list_schedule(calls, daskllm, capacity)]}
    for seed in range(seeds):
        rng = random.Random(seed)
        keys = [rng.random() for _ in calls]
        out["random"].append(list_schedule(calls, lambda j, p: keys[j], capacity))
    return out


def optimal(calls: list[Call], capacity: int, time_limit: float) -> dict:
    """The best order by MILP (HiGHS). Positions k get one call each (z), consecutive calls
    are pairs (y >= z[l,k-1] + z[m,k] - 1), each position has a start b_k and end c_k, each
    call a start s and end e tied to its position by big-M, and precedence is s_q >= e_p + L_p."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(calls)
    decode = [c.out * (c.out + 1) / 2 / capacity for c in calls]
    full = [c.out * c.prompt / capacity for c in calls]
    after = [[calls[m].out * (calls[m].prompt - shared(calls[l], calls[m])) / capacity for m in range(n)]
             for l in range(n)]
    big = sum(full) + sum(decode) + sum(c.out for c in calls) + 1
    idx: dict = {}

    def var(name):
        idx.setdefault(name, len(idx))
        return idx[name]

    for l in range(n):
        for k in range(n):
            var(("z", l, k))
    for k in range(1, n):
        for l in range(n):
            for m in range(n):
                if l != m:
                    var(("y", l, m, k))
    for k in range(n):
        var(("b", k)), var(("c", k))
    for m in range(n):
        var(("s", m)), var(("e", m))
    rows, lo, hi = [], [], []

    def add(coefs: dict, lower, upper):
        row = np.zeros(len(idx))
        for name, v in coefs.items():
            row[idx[name]] += v
        rows.append(row), lo.append(lower), hi.append(upper)

    for l in range(n):
        add({("z", l, k): 1 for k in range(n)}, 1, 1)
    for k in range(n):
        add({("z", l, k): 1 for l in range(n)}, 1, 1)
    for k in range(1, n):
        for l in range(n):
            for m in range(n):
                if l != m:
                    add({("y", l, m, k): 1, ("z", l, k - 1): -1, ("z", m, k): -1}, -1, np.inf)
    for k in range(n):  # c_k = b_k + duration of the call at k
        coefs = {("c", k): 1, ("b", k): -1}
        for m in range(n):
            coefs[("z", m, k)] = coefs.get(("z", m, k), 0) - decode[m] - (full[m] if k == 0 else 0)
        if k:
            for l in range(n):
                for m in range(n):
                    if l != m:
                        coefs[("y", l, m, k)] = -after[l][m]
        add(coefs, 0, 0)
        if k:
            add({("b", k): 1, ("c", k - 1): -1}, 0, np.inf)
    for m in range(n):
        for k in range(n):
            add({("s", m): 1, ("b", k): -1, ("z", m, k): big}, -np.inf, big)  # s_m <= b_k where m sits
            add({("e", m): 1, ("c", k): -1, ("z", m, k): -big}, -big, np.inf)  # e_m >= c_k where m sits
        for p in calls[m].preds:
            add({("s", m): 1, ("e", p): -1}, calls[p].out, np.inf)
    objective = np.zeros(len(idx))
    objective[idx[("c", n - 1)]] = 1
    integrality = np.array([1 if name[0] == "z" else 0 for name in idx])
    upper = np.array([1 if name[0] in "zy" else np.inf for name in idx])
    t0 = time.perf_counter()
    res = milp(objective, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(len(idx)), upper), options={"time_limit": time_limit, "disp": False})
    seconds = time.perf_counter() - t0
    if res.x is None:
        return {"cost": None, "seconds": seconds, "status": res.message}
    order = sorted(range(n), key=lambda m: next(k for k in range(n) if res.x[idx[("z", m, k)]] > 0.5))
    return {"cost": token_steps(calls, order, capacity), "order": order, "seconds": seconds,
            "mip_gap": float(getattr(res, "mip_gap", 0.0) or 0.0), "proven": res.status == 0, "status": res.message}


# --- instances from a real run ----------------------------------------------------------------


def collect_calls(client, fn, inputs, config: dict) -> list[Call]:
    """Every LLM call of the pipeline's naive plan: prompt blocks and output length from a real
    run, dependencies from the graph, query and operator level from its structure."""
    import networkx as nx

    import daskllm
    from daskllm.runtime.submit import overrides
    from daskllm.runtime.submit import plan as lowered
    from daskllm.runtime.metering import _records
    from pipelines.ops import NAIVE_HELD

    nodes = fn(inputs, **config)
    with overrides(dict(NAIVE_HELD)):
        graph = dict(lowered([nodes]).graph)
    daskllm.compute(nodes, **NAIVE_HELD)
    decodes = [k for k in graph if str(k).startswith("decode-")]
    records = _records(set(decodes))
    index = {k: i for i, k in enumerate(decodes)}

    def decode_preds(key) -> set:
        out, stack, seen = set(), list(graph[key].dependencies), set()
        while stack:
            d = stack.pop()
            if d in seen or d not in graph:
                continue
            seen.add(d)
            if d in index:
                out.add(index[d])
            else:
                stack.extend(graph[d].dependencies)
        return out

    import dask.order

    priority = dask.order.order(graph)
    calls = []
    for k in decodes:
        (full, tail_hash, tail_len), = records[k].prompt_blocks
        calls.append(Call(k, list(full), (tail_hash, tail_len), records[k].decode_tokens, decode_preds(k),
                          order=priority[k]))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(calls)))
    dag.add_edges_from((p, i) for i, c in enumerate(calls) for p in c.preds)
    for q, component in enumerate(sorted(nx.weakly_connected_components(dag), key=min)):
        for i in component:
            calls[i].query = q
    for i in nx.topological_sort(dag):
        calls[i].level = 1 + max((calls[p].level for p in calls[i].preds), default=-1)
    return calls


INSTANCES = {  # Helium's Table 6, at batch 2
    "mapred": {"experts": 3},
    "debate": {"agents": 3, "rounds": 2},
    "reflect": {"critics": 2},
    "iterative": {},
    "parallel": {"experts": 2},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default=",".join(INSTANCES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=8192, help="KV cache tokens M in the cost model")
    parser.add_argument("--cache-tokens", default="256,512,1024", help="LRU cache sizes for the hit-rate table")
    parser.add_argument("--hit-batch", type=int, default=16, help="Trading batch size for the hit-rate table")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--random-seeds", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.quick:
        args.instances, args.time_limit, args.hit_batch = "iterative,reflect", 20.0, 4

    import dask
    from distributed import Client

    import daskllm
    from pipelines import helium
    from pipelines.data import Inputs, contexts, questions

    dask.config.set({"daskllm.metering.prompt-blocks": True})
    results = []
    with daskllm.LocalLLMCluster(models=["tiny"], embedders=(), rerankers=(), n_workers=1,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        inputs = Inputs(questions(args.batch, "stdlib"), None, contexts(args.batch, per_query=2))
        for name in args.instances.split(","):
            calls = collect_calls(client, helium.PIPELINES[name], inputs,
                                  {"model": "tiny", "max_tokens": args.max_tokens, **INSTANCES[name]})
            best = optimal(calls, args.capacity, args.time_limit)
            row = {"instance": name, "calls": len(calls), "optimal": best, "orders": {}}
            for system, candidates in orders(calls, args.capacity, args.random_seeds).items():
                costs = [token_steps(calls, o, args.capacity) for o in candidates]
                hits = [hit_rate(calls, o, int(args.cache_tokens.split(",")[0])) for o in candidates]
                cost = statistics.mean(costs)
                row["orders"][system] = {"cost": cost, "hit_rate": statistics.mean(hits),
                                         "gap": (cost - best["cost"]) / best["cost"] if best["cost"] else None}
            results.append(row)
            log(f"{name}: {len(calls)} calls, optimum {best['cost']:.3f} ({best['status']}, {best['seconds']:.0f} s); "
                + ", ".join(f"{s} {o['cost']:.3f}" for s, o in row["orders"].items()))
        big = Inputs(questions(args.hit_batch, "stdlib"), None, contexts(args.hit_batch, per_query=2))
        calls = collect_calls(client, helium.trading, big, {"model": "tiny", "max_tokens": args.max_tokens})
        sizes = [int(x) for x in args.cache_tokens.split(",")]
        trading_orders = orders(calls, args.capacity, args.random_seeds)
        hit_rates = {size: {s: statistics.mean(hit_rate(calls, o, size) for o in candidates)
                            for s, candidates in trading_orders.items()} for size in sizes}
        log(f"trading x {args.hit_batch}: {len(calls)} calls; hit rates {hit_rates}")
    systems = list(results[0]["orders"])
    print("| instance | calls | MILP optimum (token steps) | " + " | ".join(f"{s} gap" for s in systems) + " |")
    print("|---|---|---|" + "---|" * len(systems))
    for r in results:
        b = r["optimal"]
        proof = "proven" if b.get("proven") else f"gap {b.get('mip_gap', 0):.1%}"
        print(f"| {r['instance']} | {r['calls']} | {b['cost']:.3f} ({proof}) | "
              + " | ".join(f"{r['orders'][s]['gap']:.1%}" for s in systems) + " |")
    print(f"\nPrefix-cache hit rate, Trading x {args.hit_batch} ({len(calls)} calls) on an LRU block cache:\n\n"
          "| cache tokens | " + " | ".join(systems) + " |\n|---|" + "---|" * len(systems))
    for size, rates in hit_rates.items():
        print(f"| {size} | " + " | ".join(f"{rates[s]:.1%}" for s in systems) + " |")
    means = {s: statistics.mean(r["orders"][s]["gap"] for r in results) for s in systems}
    print("\nmean optimality gap: " + ", ".join(f"{s} {g:.1%}" for s, g in means.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "mean_gap": means, "trading_hit_rates": hit_rates, "args": vars(args), "machine": machine_info(),
                       "command": " ".join(sys.argv)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
