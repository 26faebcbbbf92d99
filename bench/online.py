"""Online serving: workflow requests arriving as a Poisson stream, at rising rates.

    python bench/online.py --pipeline w2 --model tiny --rates 2,4,8,16,32 --queries 64 \\
        --json docs/bench/online.json --plot docs/bench/online.png

Each query of ``--pipeline`` is built the moment it arrives (a seeded Poisson process: the
same arrivals for every system) and handed to the server's request path
(:class:`daskllm.serve.consolidate.Consolidator`, what ``daskllm serve`` runs for every
request; HTTP is left out, as it costs every system the same). Latency is completion minus
arrival, so building, planning, queueing and computing all count. Systems, on one cluster,
from cold caches, alternating their order by rate:

- ``daskllm``: requests consolidated into joint plans (CSE, shared prefixes, batching and
  cache-aware placement across requests), most urgent deadline first;
- ``solo``: the same, but each request planned and submitted alone (consolidation off);
- ``dask``: plain Dask per-request tasks: no rewrites, a task per call, placement off
  (``pipelines.ops.NAIVE_HELD``), each request submitted alone.

``--long-prompt``: another measurement, through a real HTTP server (:func:`daskllm.serve.serving`,
what ``daskllm serve`` runs) and the ``openai`` client: one ``--long-tokens`` prompt (4,096) is
sent, and ``--delay`` seconds later (1 s: its prefill has begun) ``--short`` streamed requests of
32 prompt tokens and 8 new tokens; per short request, the time to its first token and to its
last. Two engine settings, each on a fresh cluster: ``fair`` (the defaults: prefill chunks,
long prefills yield to other work; docs/engine.md) and ``unfair`` (no chunk limit, no
yielding: the long prompt's prefill takes every step's budget). The short requests' outputs
must be equal in both.

    python bench/online.py --long-prompt --model smollm2 --workers 1 --json long.json

Per rate: p50 and p99 latency, SLO attainment (share of requests within their deadline) and
goodput (requests within their deadline per second). Per system: the highest rate whose p99
stays under ``--target`` (default: twice the p99 of ``dask`` at the lowest rate), and the ratio
to ``dask``'s. A system whose p99 passes 4x the target is not run at higher rates.

``--popular K``: each query asks one of K questions, drawn with Zipf-like popularity (the
i-th most popular weighs 1/i), as the users of an FAQ or support bot do; a question asked
again while it is being answered (or, for daskllm, already answered) shares that work.

``--slo-mix``: every other request is interactive (deadline = target) and the rest are batch
(deadline = 4 x target); adds ``fcfs``, daskllm with the deadlines withheld (first come, first
served), to show what deadline ordering buys. Outputs must be equal across systems.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import log, machine_info  # noqa: E402

SYSTEMS = ("daskllm", "solo", "dask")


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def consolidator(client, system: str, window: float = 0.0):
    from daskllm.placement import set_policy
    from daskllm.serve.consolidate import Consolidator
    from pipelines.ops import NAIVE_HELD

    set_policy(client, "off" if system == "dask" else "cache_aware")
    plan = dict(NAIVE_HELD) if system == "dask" else {"result_cache": False}
    return Consolidator(client, enabled=system in ("daskllm", "fcfs"), window=window, here=system != "dask",
                        plan_options=plan)


def picks(n: int, popular: int | None, seed: int = 0) -> list[int]:
    """Which question each of ``n`` queries asks: all distinct, or drawn from ``popular`` by Zipf weights."""
    if not popular:
        return list(range(n))
    rng = random.Random(seed)
    return rng.choices(range(popular), weights=[1 / (i + 1) for i in range(popular)], k=n)


def run_stream(client, fn, inputs, config: dict, system: str, times: list[float], deadlines: list[float],
               window: float = 0.0, asks: list[int] | None = None) -> dict:
    """Send the queries at their arrival times; each one's latency and whether it met its deadline."""
    from daskllm.runtime.control import cold_start
    from pipelines.ops import plain

    cold_start(client)
    server = consolidator(client, system, window)
    withhold = system == "fcfs"
    asks = asks or list(range(len(times)))

    async def one(i: int, start: float):
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        arrived = time.perf_counter()
        node = fn(inputs.subset(asks[i], asks[i] + 1), **config)
        value = await server.run(node, deadline_ms=None if withhold else deadlines[i] * 1000)
        return time.perf_counter() - arrived, plain(value)

    async def main():
        start = time.perf_counter()
        done = await asyncio.wait_for(asyncio.gather(*(one(i, start) for i in range(len(times)))), 3600)
        return done, time.perf_counter() - start

    try:
        done, wall = asyncio.run(main())
    finally:
        server.close()
    latencies = [d[0] for d in done]
    met = [lat <= deadlines[i] for i, lat in enumerate(latencies)]
    return {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
            "attainment": sum(met) / len(met), "goodput": sum(met) / wall, "wall": wall,
            "batches": server.stats.as_dict(), "latencies": latencies, "outputs": [d[1] for d in done]}


def _prompt_of(tokenizer, n: int, seed: int) -> str:
    """Text of exactly ``n`` tokens (random words, so that no prefix is shared)."""
    rng = random.Random(seed)
    words = []
    while len(tokenizer.encode(" ".join(words))) < n:
        words.append(rng.choice(("river", "stone", "paper", "light", "window", "garden", "number", "music", "cloud",
                                 "table", "forest", "signal", "engine", "market", "letter", "bridge")) + str(rng.randrange(100)))
    ids = tokenizer.encode(" ".join(words))[:n]
    return tokenizer.decode(ids)


LONG_SETTINGS = {"fair": {}, "unfair": {"daskllm.engine.prefill-chunk-tokens": 0,
                                         "daskllm.engine.long-prefill-tokens": 0}}


def long_prompt_run(args, setting: str, long_text: str, short_texts: list[str]) -> dict:
    """One cluster with ``setting``'s engine limits: the long request, then the short ones."""
    import dask
    import openai
    from concurrent.futures import ThreadPoolExecutor
    from distributed import Client

    import daskllm
    from daskllm.serve import serving

    with dask.config.set(LONG_SETTINGS[setting]), \
            daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=4,
                                    dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client, serving(client) as url:
        api = openai.OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
        api.completions.create(model=args.model, prompt="warm up", max_tokens=2, temperature=0)

        def short(text: str) -> dict:
            sent = time.perf_counter()
            first, pieces = None, []
            for chunk in api.completions.create(model=args.model, prompt=text, max_tokens=8, temperature=0,
                                                stream=True):
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.perf_counter() - sent
                    pieces.append(chunk.choices[0].text)
            return {"ttft_s": first, "done_s": time.perf_counter() - sent, "text": "".join(pieces)}

        def long() -> float:
            sent = time.perf_counter()
            api.completions.create(model=args.model, prompt=long_text, max_tokens=8, temperature=0)
            return time.perf_counter() - sent

        with ThreadPoolExecutor(len(short_texts) + 1) as pool:
            long_done = pool.submit(long)
            time.sleep(args.delay)  # a benchmark's arrival time, not a synchronisation
            shorts = [f.result() for f in [pool.submit(short, t) for t in short_texts]]
            long_s = long_done.result()
    return {"long_s": long_s, "shorts": shorts}


def long_prompt_main(args) -> int:
    from transformers import AutoTokenizer

    from daskllm import models

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(args.model))
    long_text = _prompt_of(tokenizer, args.long_tokens, seed=1)
    short_texts = [_prompt_of(tokenizer, 32, seed=10 + i) for i in range(args.short)]
    results = {}
    for setting in ("fair", "unfair"):
        log(f"{setting}: {args.long_tokens}-token prompt, then {args.short} short requests {args.delay:g} s later ...")
        results[setting] = r = long_prompt_run(args, setting, long_text, short_texts)
        log(f"  long {r['long_s']:.1f} s; short first token " + ", ".join(f"{x['ttft_s']:.2f}" for x in r["shorts"])
            + " s; done " + ", ".join(f"{x['done_s']:.2f}" for x in r["shorts"]) + " s")
    exact = [x["text"] for x in results["fair"]["shorts"]] == [x["text"] for x in results["unfair"]["shorts"]]
    print(f"model {args.model}, {args.workers} worker(s); a {args.long_tokens}-token prompt, then {args.short} "
          f"requests of 32 prompt tokens and 8 new tokens {args.delay:g} s later (streamed)\n")
    print("| engine setting | long request s | short: first token s (max) | short: done s (max) |\n|---|---:|---:|---:|")
    for setting, r in results.items():
        print(f"| {setting} | {r['long_s']:.1f} | {max(x['ttft_s'] for x in r['shorts']):.2f} | "
              f"{max(x['done_s'] for x in r['shorts']):.2f} |")
    print(f"\nshort outputs equal in both settings: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "exact": exact, "args": vars(args), "machine": machine_info(),
                       "command": " ".join(sys.argv)}, f, indent=2, default=str)
    return 0 if exact else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="w2")
    parser.add_argument("--rates", default="2,4,8,16,32", help="queries per second, ascending")
    parser.add_argument("--queries", type=int, default=64, help="queries per run")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--target", type=float, default=None, help="p99 latency target, seconds")
    parser.add_argument("--popular", type=int, default=None, help="queries ask one of this many questions (Zipf)")
    parser.add_argument("--slo-mix", action="store_true", help="half interactive, half batch deadlines; adds fcfs")
    parser.add_argument("--systems", default=None, help=f"comma-separated subset of {SYSTEMS} (+ fcfs)")
    parser.add_argument("--window", type=float, default=100.0,
                        help="consolidation window, ms (daskllm serve --window): how long a micro-batch may wait")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="write a latency-vs-rate plot (PNG) here")
    parser.add_argument("--long-prompt", action="store_true", help="the long-prompt measurement (see above)")
    parser.add_argument("--long-tokens", type=int, default=4096, help="--long-prompt: the long prompt's tokens")
    parser.add_argument("--short", type=int, default=3, help="--long-prompt: short requests")
    parser.add_argument("--delay", type=float, default=1.0, help="--long-prompt: seconds before the short ones")
    args = parser.parse_args(argv)
    if args.long_prompt:
        return long_prompt_main(args)

    from distributed import Client

    import daskllm
    from pipelines import registry
    from pipelines.data import make_inputs

    fn = registry()[args.pipeline]
    config = {"model": args.model, "max_tokens": args.max_tokens}
    rates = [float(r) for r in args.rates.split(",")]
    systems = args.systems.split(",") if args.systems else list(SYSTEMS) + (["fcfs"] if args.slo_mix else [])
    results: dict[str, dict[float, dict]] = {s: {} for s in systems}
    target = args.target
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=16,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        inputs = make_inputs(client, args.queries)
        daskllm.compute(fn(inputs.subset(0, 2), **config))  # warm-up: engines, tokenizers, code paths
        stopped: set[str] = set()
        for k, rate in enumerate(rates):
            times = arrivals(args.queries, rate, seed=k)
            order = systems if k % 2 == 0 else systems[::-1]
            if target is None:  # from dask's p99 at the lowest rate, measured first
                order = ["dask"] + [s for s in order if s != "dask"]
            for system in order:
                if system in stopped:
                    continue
                scale = [1.0 if not args.slo_mix or i % 2 == 0 else 4.0 for i in range(args.queries)]
                deadlines = [(target or 3600.0) * s for s in scale]
                r = run_stream(client, fn, inputs, config, system, times, deadlines, args.window / 1000,
                               picks(args.queries, args.popular, seed=k))
                if target is None and system == "dask":
                    target = 2 * r["p99"]
                    deadlines = [target * s for s in scale]
                    r["attainment"] = sum(lat <= d for lat, d in zip(r["latencies"], deadlines)) / len(deadlines)
                    r["goodput"] = r["attainment"] * len(deadlines) / r["wall"]
                results[system][rate] = r
                log(f"rate {rate:5.1f}/s {system:8s} p50 {r['p50']:6.2f} s  p99 {r['p99']:6.2f} s  "
                    f"attainment {r['attainment']:5.0%}  goodput {r['goodput']:5.2f}/s  "
                    f"mean batch {r['batches']['mean_batch']:.1f}")
                if r["p99"] > 4 * target:
                    stopped.add(system)
    ran = [r for r in rates if all(r in results[s] for s in systems)]
    exact = all(results[s][r]["outputs"] == results[systems[0]][r]["outputs"] for s in systems for r in ran)
    best = {s: max([r for r, x in results[s].items() if x["p99"] <= target], default=None) for s in systems}
    print(f"{args.pipeline}, model {args.model}, {args.workers} workers, {args.queries} queries per rate"
          f"{f', questions drawn from {args.popular} by popularity' if args.popular else ''}"
          f"{', half interactive / half batch deadlines' if args.slo_mix else ''}; p99 target {target:.2f} s\n")
    print("| rate (queries/s) | " + " | ".join(f"{s} p50 / p99 s, SLO, goodput/s" for s in systems)
          + " |\n|---|" + "---|" * len(systems))
    for r in rates:
        cells = [(f"{x['p50']:.2f} / {x['p99']:.2f}, {x['attainment']:.0%}, {x['goodput']:.1f}"
                  if (x := results[s].get(r)) else "overloaded (not run)") for s in systems]
        print(f"| {r:g} | " + " | ".join(cells) + " |")
    ratio = {s: best[s] / best["dask"] for s in systems if best.get(s) and best.get("dask")}
    print("\nhighest rate with p99 under target: " + ", ".join(f"{s} {best[s]}" for s in systems)
          + "; vs dask: " + ", ".join(f"{s} {v:.2f}x" for s, v in ratio.items()) + f"; exact: {exact}")
    if args.plot:
        plot(results, target, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": {s: {str(r): {k: v for k, v in x.items() if k != "outputs"} for r, x in d.items()}
                                   for s, d in results.items()},
                       "target": target, "best_rate": best, "ratio_vs_dask": ratio, "exact": exact,
                       "args": vars(args), "machine": machine_info(), "command": " ".join(sys.argv)},
                      f, indent=2, default=str)
    return 0 if exact else 1


def plot(results: dict, target: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, by_rate in results.items():
        rates = sorted(by_rate)
        ax.plot(rates, [by_rate[r]["p99"] for r in rates], marker="o", label=f"{system} p99")
        ax.plot(rates, [by_rate[r]["p50"] for r in rates], linestyle=":", color=ax.lines[-1].get_color())
    ax.axhline(target, color="grey", linestyle="--", label=f"p99 target {target:.2f} s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (queries/s)")
    ax.set_ylabel("latency, s (solid p99, dotted p50)")
    ax.set_title(f"{args.pipeline} on {args.model}, {args.workers} workers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
