"""Online serving: queries arriving as a Poisson stream, each submitted the moment it arrives.

    python bench/online.py --pipeline w2 --rates 0.5,1,2,4 --json online.json

Each query of ``--pipeline`` is built alone and submitted (``client.compute``) at its arrival
time, drawn from a Poisson process of the given rate (seeded, the same arrivals for every
system). Latency is completion minus arrival, so time spent planning a query, or waiting
behind others, counts. Systems: ``daskllm`` (everything on; the result cache off so repeated
runs never reuse answers) and ``dask`` (no rewrites, a task per call, placement off), on the
same cluster, from cold caches, alternating by rate. Reported per rate: median and p90
latency; then, per system, the highest rate whose median latency stays under ``--target``
seconds (default: twice the median latency of ``dask`` at the lowest rate), and their ratio
(Halo reports 4.7x over vLLM, Harmonia 2.04x). Outputs must equal across systems.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import log, machine_info  # noqa: E402

SETTINGS = {"daskllm": {"result_cache": False}, "dask": None}  # dask: pipelines.ops.NAIVE


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_stream(client, fn, inputs, config: dict, system: str, times: list[float]) -> dict:
    from daskllm.runtime.submit import overrides
    from daskllm.runtime.submit import plan_and_submit
    from daskllm.placement import set_policy
    from daskllm.runtime.control import cold_start
    from pipelines.ops import NAIVE, plain

    cold_start(client)
    set_policy(client, "cache_aware" if system == "daskllm" else "off")
    settings = SETTINGS[system] or NAIVE
    done: dict[int, float] = {}
    outputs: dict[int, object] = {}
    finished = threading.Event()
    futures = []
    start = time.perf_counter()

    def record(i):
        def callback(future):
            done[i] = time.perf_counter() - start
            if len(done) == len(times):
                finished.set()
        return callback

    for i, at in enumerate(times):
        time.sleep(max(0.0, at - (time.perf_counter() - start)))
        with overrides(dict(settings)):
            [future] = plan_and_submit([fn(inputs.subset(i, i + 1), **config)], client).futures
        future.add_done_callback(record(i))
        futures.append(future)
    finished.wait(timeout=1800)
    for i, f in enumerate(futures):
        outputs[i] = plain(f.result())
    latencies = [done[i] - times[i] for i in range(len(times))]
    return {"median": statistics.median(latencies), "p90": sorted(latencies)[int(0.9 * (len(latencies) - 1))],
            "latencies": latencies, "outputs": [outputs[i] for i in range(len(times))]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="w2")
    parser.add_argument("--rates", default="0.5,1,2,4", help="queries per second, ascending")
    parser.add_argument("--queries", type=int, default=12, help="queries per run")
    parser.add_argument("--model", default="small")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--target", type=float, default=None, help="median-latency target, seconds")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from distributed import Client

    import daskllm
    from pipelines import registry
    from pipelines.data import make_inputs

    fn = registry()[args.pipeline]
    config = {"model": args.model, "max_tokens": args.max_tokens}
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, dict[float, dict]] = {"daskllm": {}, "dask": {}}
    with daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers, threads_per_worker=16,
                                 dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        inputs = make_inputs(client, args.queries)
        daskllm.compute(fn(inputs.subset(0, 2), **config))  # warm-up
        for k, rate in enumerate(rates):
            times = arrivals(args.queries, rate, seed=k)
            for system in (("daskllm", "dask") if k % 2 == 0 else ("dask", "daskllm")):
                r = run_stream(client, fn, inputs, config, system, times)
                results[system][rate] = r
                log(f"rate {rate:5.2f}/s {system:8s} median {r['median']:6.2f} s  p90 {r['p90']:6.2f} s")
    exact = all(results["daskllm"][r]["outputs"] == results["dask"][r]["outputs"] for r in rates)
    target = args.target or 2 * results["dask"][rates[0]]["median"]
    best = {s: max([r for r in rates if results[s][r]["median"] <= target], default=None) for s in results}
    print(f"{args.pipeline}, model {args.model}, {args.workers} workers, {args.queries} queries per rate; "
          f"target median latency {target:.2f} s\n")
    print("| rate (queries/s) | daskllm median / p90 s | dask median / p90 s | dask / daskllm median |\n|---|---|---|---|")
    for r in rates:
        a, b = results["daskllm"][r], results["dask"][r]
        print(f"| {r:g} | {a['median']:.2f} / {a['p90']:.2f} | {b['median']:.2f} / {b['p90']:.2f} | "
              f"{b['median'] / a['median']:.2f}x |")
    ratio = (best["daskllm"] / best["dask"]) if best["daskllm"] and best["dask"] else None
    print(f"\nhighest rate under target: daskllm {best['daskllm']}, dask {best['dask']}"
          + (f" ({ratio:.2f}x)" if ratio else "") + f"; exact: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": {s: {str(r): {k: v for k, v in x.items() if k != "outputs"} for r, x in d.items()}
                                   for s, d in results.items()},
                       "target": target, "best_rate": best, "ratio": ratio, "exact": exact, "args": vars(args),
                       "machine": machine_info(), "command": " ".join(sys.argv)}, f, indent=2, default=str)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
