"""The benchmark harness: the papers' pipelines under daskllm and its baselines, side by side.

    python bench/harness.py --pipelines w2,trading --queries 32 --model small --json harness.json
    python bench/harness.py --quick                 # every pipeline, tiny model, 4 queries, one repetition, small index
    daskllm bench --pipelines factool --queries 16  # the same, from a source checkout
    .venv-vllm/bin/python bench/harness.py --backend vllm --model tiny --systems daskllm,vllm-opwise,vllm-batch

Systems, all on the same cluster and the same resident engines (``--backend``: torch, or vLLM
on every worker), so only orchestration differs:

- ``sequential``: one query at a time, each call waiting for the last (a loop over an LLM client);
- ``opwise``: one operator at a time over the whole batch, a barrier after each (black-box UDFs),
  every call of the operator sent to the engines together (Helium's OpWise);
- ``dask``: the pipeline's graph with plain Dask: a task per call, no rewrites, placement off,
  and a task waiting on its engine holds no thread, so every ready call is dispatched
  (LangGraph's batch);
- ``opwise-held`` and ``dask-held``: the same two with each waiting call holding its Dask
  thread, as a plain Dask task calling a model does: at most ``--threads`` calls per worker
  reach an engine at once (the baselines of earlier measurements);
- ``daskllm``: everything on;
- ablations of ``daskllm`` with one feature off: ``-cse``, ``-parts`` (small plans as
  parts), ``-prefix`` (shared-prefix prefill), ``-stage`` (stage split), ``-pipeline`` (decode pipelining), ``-cache`` (result
  cache), ``-placement`` (plain Dask placement instead of cache-aware) and ``-release`` (a task
  waiting on its engine holds its worker thread, as a plain Dask task does).

And vLLM alone, no Dask (:mod:`pipelines.vllm_alone`): what a competent user writes instead,
on one vLLM engine per model in this process, started once per benchmark and kept (only when
asked for in ``--systems``; they need vLLM, in ``.venv-vllm`` on a CPU machine):

- ``vllm-opwise``: the opwise program, an operator's calls sent together in one
  ``LLM.generate`` (Helium's OpWise);
- ``vllm-batch``: every query's pipeline as coroutines on one event loop, every call sent to
  ``AsyncLLM`` the moment its inputs are ready (LangGraph's batch).

Their engines have automatic prefix caching on, the KV cache of all of the cluster's
workers together, vLLM's own scheduling defaults and every core of the machine
(``VLLM_CPU_OMP_THREADS_BIND``); search and rerank run in this process on the same
embedder, reranker and passages. An idle vLLM engine computes nothing, so the cluster's and
these engines stay resident side by side; each run empties its own engines' prefix caches.

After one unmeasured warm-up run of each system, every repetition runs every system once, in a rotating
order, each from a cold start (empty
prefix caches and result caches on the client and every worker). Reported per pipeline and
system: the median wall time; speedup = the median over repetitions of the system's time
divided by ``daskllm``'s in the same repetition; prefill tokens computed and their ratio to
the distinct-prefix lower bound (every prompt decoded, in blocks, de-duplicated: no plan can
prefill less); the prefix-cache hit rate and mean decode batch from the engines' counters;
the number of Dask tasks (none for vLLM alone); and **efficiency** = ideal time / actual
time, where the ideal time is the distinct prefill tokens and the decode tokens at the
cluster's engines' best measured per-token costs (calibrated at start, per model), divided
among the workers. Every system's outputs
must equal the first run's (greedy decoding): the script exits with status 1 if not. Last,
per system: the geometric mean over pipelines of its time / ``daskllm``'s, and the least.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from attribution import attributed  # noqa: E402
from machine import log, machine_info  # noqa: E402

from daskllm.worker.costs import calibrate  # noqa: E402

BASELINES = ("sequential", "opwise", "dask", "opwise-held", "dask-held")
VLLM_ALONE = ("vllm-opwise", "vllm-batch")  # pipelines.vllm_alone.SYSTEMS, without importing vLLM
ABLATIONS = {"-cse": "cse", "-prefix": "prefix", "-parts": "parts", "-stage": "stage", "-pipeline": "pipeline", "-cache": "cache",
             "-placement": None, "-release": None}
DEFAULT_SYSTEMS = (*BASELINES, "daskllm", *ABLATIONS)
SYSTEMS = (*BASELINES, *VLLM_ALONE, "daskllm", *ABLATIONS)


def parse_args(argv=None) -> argparse.Namespace:
    from pipelines import registry

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", default="all", help=f"comma-separated, or all: {', '.join(registry())}")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated from {', '.join(SYSTEMS)} (default: all but {', '.join(VLLM_ALONE)})")
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: daskllm.model (smollm2)")
    parser.add_argument("--model2", default="tiny", help="the second model of two-model pipelines (w3, w5)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", choices=("torch", "vllm", "auto"), default=None,
                        help="the cluster's LLM engines (default: daskllm.engine.backend)")
    parser.add_argument("--workers-per-gpu", type=int, default=None,
                        help="workers sharing each GPU (LocalLLMCluster's workers_per_gpu; default: as --workers needs)")
    parser.add_argument("--threads", type=int, default=8, help="Dask threads per worker")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-queries", type=int, default=None,
                        help="queries of the unmeasured daskllm warm-up run per pipeline (default: all; 0: none)")
    parser.add_argument("--source", default="auto", help="questions: auto, stdlib, hotpotqa, parallelqa, movies")
    parser.add_argument("--index-docs", type=int, default=2000, help="documentation passages in the search index")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 4 queries, 4 tokens, one repetition, an index of 200 passages")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--plot", help="write a speedup chart (PNG) here")
    parser.add_argument("--attribution", help="also attribute each run's time (Dask spans, engine counters); "
                        "write a stacked-bar chart (PNG) of it here")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.queries, args.max_tokens, args.repeats, args.index_docs = "tiny", 4, 4, 1, 200
    if args.model is None:
        import daskllm

        args.model = daskllm.config.get("model")
    names = list(registry()) if args.pipelines == "all" else args.pipelines.split(",")
    unknown = [n for n in names if n not in registry()]
    systems = args.systems.split(",")
    unknown += [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown pipelines or systems: {unknown}")
    if "daskllm" not in systems:
        systems.append("daskllm")  # the reference for every ratio
    if any(s in VLLM_ALONE for s in systems):
        from pipelines.vllm_alone import unavailable_reason

        if (reason := unavailable_reason()) is not None:
            parser.error(f"{', '.join(VLLM_ALONE)} cannot run here: {reason}")
    args.pipeline_names, args.system_names = names, systems
    return args


# --- running one system -------------------------------------------------------------------


def run_system(system: str, fn, inputs, config: dict):
    """The pipeline's answers, computed the way ``system`` orchestrates."""
    import daskllm
    from daskllm import config as daskllm_config
    from pipelines.ops import NAIVE, NAIVE_HELD, Eager, Lazy, plain

    # Every call generates its max_tokens: the same work whatever a random model's end-of-text does.
    if system == "sequential":
        one_by_one = Eager(config["model"], parallel=False, ignore_eos=True)
        return [plain(fn(inputs.subset(i, i + 1), one_by_one, **config))[0] for i in range(len(inputs))]
    naive = NAIVE_HELD if system.endswith("-held") else NAIVE
    if system in ("opwise", "opwise-held"):
        return plain(fn(inputs, Eager(config["model"], settings=dict(naive), ignore_eos=True), **config))
    nodes = fn(inputs, Lazy(config["model"], ignore_eos=True), **config)
    if system in ("dask", "dask-held"):
        return plain(daskllm.compute(nodes, **naive)[0])
    off = ABLATIONS.get(system)
    settings = {"passes": [p for p in daskllm_config.get("rewrite.passes") if p != off]} if off else {}
    if system == "-cache":
        settings["result_cache"] = False
    if system == "-release":
        settings["release_threads"] = False
    return plain(daskllm.compute(nodes, **settings)[0])


def placement_for(system: str) -> str:
    return "cache_aware" if system == "daskllm" or (system in ABLATIONS and system != "-placement") else "off"


def engine_totals(client) -> dict:
    from daskllm.worker import engine_stats

    totals = {"prefill_tokens_computed": 0, "prefill_tokens_cached": 0, "decode_tokens": 0, "steps": 0,
              "batched_sequences": 0}
    for per_worker in client.run(engine_stats).values():
        for stats in per_worker.values():
            for key in totals:
                totals[key] += stats[key]
    return totals


def engine_busy(client) -> tuple[float, int]:
    """The LLM engines' summed busy seconds, and how many there are."""
    from daskllm.worker import engine_stats

    stats = [s for per_worker in client.run(engine_stats).values() for s in per_worker.values()]
    return sum(s["busy_seconds"] for s in stats), len(stats)


def measure(client, system: str, fn, inputs, config: dict, attribute: bool = False) -> dict:
    import daskllm
    from daskllm.placement import set_policy
    from daskllm.runtime.control import cold_start
    from distributed import get_task_stream

    cold_start(client)
    set_policy(client, placement_for(system))
    before = engine_totals(client)
    timing = attributed(client, system, lambda: engine_busy(client)) if attribute else contextlib.nullcontext({})
    with get_task_stream(client) as stream, daskllm.usage() as usage, timing as found:
        start = time.perf_counter()
        outputs = run_system(system, fn, inputs, config)
        seconds = time.perf_counter() - start
    after = engine_totals(client)
    delta = {k: after[k] - before[k] for k in after}
    prompt = delta["prefill_tokens_computed"] + delta["prefill_tokens_cached"]
    return {"seconds": seconds, "outputs": outputs, "tasks": len(stream.data),
            "prefill_tokens_computed": delta["prefill_tokens_computed"],
            "hit_rate": delta["prefill_tokens_cached"] / prompt if prompt else 0.0,
            "mean_batch": delta["batched_sequences"] / delta["steps"] if delta["steps"] else 0.0,
            "models": usage.models, "distinct_prompt_tokens": usage.distinct_prompt_tokens,
            **({"attribution": found["attribution"]} if attribute else {})}


def measure_alone(alone, system: str, fn, inputs, config: dict, attribute: bool = False) -> dict:
    """``measure`` for a vLLM-alone system (``alone``: a :class:`pipelines.vllm_alone.VLLMAlone`):
    its engines' prefix caches emptied first, their counters and the calls' prompts metered
    the same way; no Dask, so no tasks, and all of the wall time inside the run."""
    alone.reset_prefix_caches(system)
    before = alone.totals(system)
    start = time.perf_counter()
    outputs, usage = alone.run(system, fn, inputs, config)
    seconds = time.perf_counter() - start
    after = alone.totals(system)
    delta = {k: after[k] - before[k] for k in after}
    prompt = delta["prefill_tokens_computed"] + delta["prefill_tokens_cached"]
    result = {"seconds": seconds, "outputs": outputs, "tasks": 0,
              "prefill_tokens_computed": delta["prefill_tokens_computed"],
              "hit_rate": delta["prefill_tokens_cached"] / prompt if prompt else 0.0,
              "mean_batch": delta["batched_sequences"] / delta["steps"] if delta["steps"] else 0.0,
              "models": usage.models(), "distinct_prompt_tokens": usage.distinct_prompt_tokens}
    if attribute:  # no threads to attribute: the engines' busy time only
        engines = len(alone.engines[system])
        result["attribution"] = {
            "wall": seconds, "tasks_window": seconds, "outside_tasks": 0.0, "engine_busy": delta["busy_seconds"],
            "engine_idle": max(0.0, engines * seconds - delta["busy_seconds"]),
            **{k: 0.0 for k, _ in ATTRIBUTION[1:]}, "thread_count": 0}
    return result


# --- the engines' best per-token costs ------------------------------------------------------


def costs(client, models: list[str]) -> dict[str, dict]:
    out = {}
    for model in models:
        runs = [client.run(calibrate, model) for _ in range(2)]
        per = [c for run in runs for c in run.values()]
        out[model] = {k: min(c[k] for c in per) for k in per[0]}
    return out


def ideal_seconds(run: dict, cost: dict[str, dict], workers: int) -> float | None:
    total = 0.0
    for model, m in run["models"].items():
        if m.get("distinct_prompt_tokens") is None or model not in cost:
            return None
        total += (m["distinct_prompt_tokens"] * cost[model]["prefill_s_per_token"]
                  + m["decode_tokens"] * cost[model]["decode_s_per_token"])
    return total / workers


# --- the benchmark ---------------------------------------------------------------------------


def bench_pipeline(client, name: str, fn, inputs, config: dict, systems: list[str], repeats: int,
                   cost: dict, workers: int, attribute: bool = False, warmup_queries: int | None = None,
                   progress=None, alone=None) -> dict:
    """Every system's runs of one pipeline, summarized; ``progress(summary)`` after each run, so
    a benchmark cut short still leaves what it measured. ``alone`` runs the vLLM-alone systems."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    warmup = len(inputs) if warmup_queries is None else min(warmup_queries, len(inputs))
    if warmup:  # not measured: first-use costs of every code path
        subset = inputs if warmup == len(inputs) else inputs.subset(0, warmup)
        run_system("daskllm", fn, subset, config)
        for system in (s for s in systems if s in VLLM_ALONE):  # theirs too (tokenizers, retrieval, ...)
            alone.run(system, fn, subset, config)
    reference = None
    for r in range(repeats):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            if system in VLLM_ALONE:
                result = measure_alone(alone, system, fn, inputs, config, attribute)
            else:
                result = measure(client, system, fn, inputs, config, attribute)
            if reference is None:
                reference = result["outputs"]
            result["exact"] = result["outputs"] == reference
            runs[system].append(result)
            log(f"  {name:15s} {system:11s} {result['seconds']:7.2f} s  tasks {result['tasks']:5d}  "
                f"hit rate {result['hit_rate']:.2f}  batch {result['mean_batch']:.1f}"
                f"{'' if result['exact'] else '  OUTPUTS DIFFER'}")
            if progress is not None:
                progress(summarize(name, runs, cost, workers, attribute))
    return summarize(name, runs, cost, workers, attribute)


def summarize(name: str, runs: dict[str, list[dict]], cost: dict, workers: int, attribute: bool) -> dict:
    """Medians per system over the runs so far (a system not run yet is left out; ratios pair
    repetitions daskllm has run too)."""
    bound = next((r["distinct_prompt_tokens"] for rs in runs.values() for r in rs if r["distinct_prompt_tokens"]), None)
    summary = {}
    for system, rs in runs.items():
        ratios = [r["seconds"] / d["seconds"] for r, d in zip(rs, runs["daskllm"])]
        if not rs or not ratios:
            continue
        ideal = [ideal_seconds(r, cost, workers) for r in rs]
        summary[system] = {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "vs_daskllm": statistics.median(ratios),
            "prefill_tokens_computed": statistics.median(r["prefill_tokens_computed"] for r in rs),
            "prefill_vs_bound": (statistics.median(r["prefill_tokens_computed"] for r in rs) / bound
                                 if bound else None),
            "hit_rate": statistics.median(r["hit_rate"] for r in rs),
            "mean_batch": statistics.median(r["mean_batch"] for r in rs),
            "tasks": statistics.median(r["tasks"] for r in rs),
            "efficiency": (statistics.median(i / r["seconds"] for i, r in zip(ideal, rs))
                           if all(i is not None for i in ideal) else None),
            "exact": all(r["exact"] for r in rs),
            **({"attribution": {k: statistics.median(r["attribution"][k] for r in rs)
                                for k in rs[0]["attribution"] if k != "complete"}} if attribute else {}),
        }
    return {"pipeline": name, "distinct_prompt_tokens": bound, "systems": summary,
            "raw": {s: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for s, rs in runs.items()}}


def markdown(results: list[dict], args) -> str:
    from daskllm import config

    backend = args.backend or config.get("engine.backend")
    lines = [f"model `{args.model}`, {args.workers} workers x {args.threads} threads, {backend} engines, "
             f"{args.queries} queries, {args.max_tokens} tokens per call, {args.repeats} repetitions (median)\n",
             "| pipeline | system | wall s | mean batch | x daskllm's time | prefill computed / bound | hit rate | "
             "tasks | efficiency | exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for system, s in res["systems"].items():
            bound = f"{s['prefill_vs_bound']:.2f}" if s["prefill_vs_bound"] is not None else "-"
            eff = f"{s['efficiency']:.2f}" if s["efficiency"] is not None else "-"
            lines.append(f"| {res['pipeline']} | {system} | {s['seconds']:.2f} | {s['mean_batch']:.1f} | "
                         f"{s['vs_daskllm']:.2f} | {bound} | {s['hit_rate']:.2f} | {s['tasks']:.0f} | {eff} | "
                         f"{'yes' if s['exact'] else 'NO'} |")
    return "\n".join(lines)


def overall(results: list[dict]) -> dict[str, dict]:
    """Per system but ``daskllm``, over the pipelines that ran it: the geometric mean of its
    time / daskllm's (how much faster daskllm is), the least and the most, and the geometric
    mean of its efficiency."""
    out = {}
    for system in dict.fromkeys(s for r in results for s in r["systems"]):
        if system == "daskllm":
            continue
        rows = [r["systems"][system] for r in results if system in r["systems"]]
        ratios = [s["vs_daskllm"] for s in rows]
        effs = [s["efficiency"] for s in rows if s["efficiency"]]
        out[system] = {"pipelines": len(rows), "geomean_vs_daskllm": math.exp(statistics.mean(map(math.log, ratios))),
                       "min_vs_daskllm": min(ratios), "max_vs_daskllm": max(ratios),
                       "geomean_efficiency": math.exp(statistics.mean(map(math.log, effs))) if effs else None}
    effs = [r["systems"]["daskllm"]["efficiency"] for r in results if r["systems"].get("daskllm", {}).get("efficiency")]
    if effs:
        out["daskllm"] = {"pipelines": len(effs), "geomean_efficiency": math.exp(statistics.mean(map(math.log, effs)))}
    return out


def overall_table(results: list[dict]) -> str:
    lines = ["| system | pipelines | x daskllm's time, geometric mean | least | most | efficiency, geometric mean |",
             "|---|---|---|---|---|---|"]
    for system, o in overall(results).items():
        eff = f"{o['geomean_efficiency']:.2f}" if o.get("geomean_efficiency") is not None else "-"
        if system == "daskllm":
            lines.append(f"| daskllm | {o['pipelines']} | 1.00 | - | - | {eff} |")
        else:
            lines.append(f"| {system} | {o['pipelines']} | {o['geomean_vs_daskllm']:.2f} | {o['min_vs_daskllm']:.2f} | "
                         f"{o['max_vs_daskllm']:.2f} | {eff} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baselines = [b for b in (*BASELINES, *VLLM_ALONE) if all(b in r["systems"] for r in results)]
    names = [r["pipeline"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.7), 3.5))
    width = 0.8 / max(1, len(baselines))
    for j, b in enumerate(baselines):
        ax.bar([i + j * width for i in range(len(names))], [r["systems"][b]["vs_daskllm"] for r in results],
               width, label=f"daskllm over {b}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks([i + width * (len(baselines) - 1) / 2 for i in range(len(names))], names, rotation=45, ha="right")
    ax.set_ylabel("speedup (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


ATTRIBUTION = [("outside_tasks", "before the first task, after the last"), ("threads_engine_wait", "threads waiting on engines"),
               ("threads_stream_wait", "threads waiting on streams / nested work"),
               ("threads_other_wait", "threads waiting, other"), ("threads_cpu", "task CPU"),
               ("threads_dask_overhead", "Dask task overhead"), ("threads_idle", "threads idle")]


def attribution_table(results: list[dict]) -> str:
    """Per pipeline and system: wall time, where it went, and how busy the engines were."""
    lines = ["| pipeline | system | wall s | outside tasks s | engine busy | " +
             " | ".join(label for key, label in ATTRIBUTION[1:]) + " |", "|---|---|" + "---:|" * (2 + len(ATTRIBUTION))]
    for res in results:
        for system, s in res["systems"].items():
            a = s["attribution"]
            threads = sum(a[k] for k, _ in ATTRIBUTION[1:]) or 1.0
            busy = a["engine_busy"] / max(1e-9, a["engine_busy"] + a["engine_idle"])
            lines.append(f"| {res['pipeline']} | {system} | {a['wall']:.2f} | {a['outside_tasks']:.2f} | {busy:.0%} | "
                         + " | ".join(f"{a[k] / threads:.0%}" for k, _ in ATTRIBUTION[1:]) + " |")
    return "\n".join(lines)


def plot_attribution(results: list[dict], path: str) -> None:
    """A stacked bar per pipeline and system: the wall time, split into the time no task ran and,
    during the tasks' window, in proportion to what the worker threads did."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{r['pipeline']}\n{system}", s["attribution"]) for r in results for system, s in r["systems"].items()]
    fig, ax = plt.subplots(figsize=(max(6, len(bars) * 0.55), 4))
    bottoms = [0.0] * len(bars)
    for key, label in ATTRIBUTION:
        heights = []
        for _, a in bars:
            if key == "outside_tasks":
                heights.append(a["outside_tasks"])
            else:
                threads = sum(a[k] for k, _ in ATTRIBUTION[1:]) or 1.0
                heights.append((a["wall"] - a["outside_tasks"]) * a[key] / threads)
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=90, fontsize=7)
    ax.set_ylabel("wall seconds")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@contextlib.contextmanager
def vllm_alone(systems: list[str], models: list[str], args):
    """The vLLM-alone systems' engines (one per system and model, started here once) and
    retrieval over the passages the cluster's index holds; closed on exit."""
    from daskllm.engines import sizing
    from pipelines.data import passages
    from pipelines.vllm_alone import LocalRetrieval, VLLMAlone

    retrieval = LocalRetrieval(passages(args.index_docs))
    # The KV cache of all of the cluster's workers together.
    kv_cache_tokens = int(sizing.limit(None, "kv-cache-tokens", True)) * args.workers
    try:
        alone = VLLMAlone(systems, models, retrieval, kv_cache_tokens=kv_cache_tokens, log=log)
        try:
            yield alone
        finally:
            alone.close()
    finally:
        retrieval.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import dask
    from distributed import Client

    import daskllm
    from pipelines import TWO_MODELS, registry
    from pipelines.data import make_inputs

    registry_ = registry()
    two = any(n in TWO_MODELS for n in args.pipeline_names)
    models = [args.model] + ([args.model2] if two and args.model2 != args.model else [])
    # Workers inherit this config: their usage records carry each prompt's block hashes.
    dask.config.set({"daskllm.metering.prompt-blocks": True})
    alone_systems = [s for s in args.system_names if s in VLLM_ALONE]
    if alone_systems:  # (a cluster of vLLM engines sets the same itself)
        from daskllm.cluster import settings_for_vllm

        # KV blocks of 32 tokens on CPU, in the planner's hashes and every vLLM engine's alike.
        settings_for_vllm(on_cpu=True)
    log(f"cluster: {args.workers} workers x {args.threads} threads, models {models}, "
        f"backend {args.backend or daskllm.config.get('engine.backend')}")
    results = []
    cost: dict = {}

    def write(partial: dict | None = None) -> None:
        """The JSON report as it stands (after every run: a call cut short still leaves its rows)."""
        if args.json:
            with open(args.json, "w") as f:
                so_far = results + ([partial] if partial else [])
                json.dump({"args": {k: v for k, v in vars(args).items()}, "costs": cost, "results": so_far,
                           "overall": overall(so_far) if so_far else {}, "machine": machine_info(),
                           "command": " ".join(sys.argv)}, f, indent=2, default=str)

    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(daskllm.LocalLLMCluster(
            models=models, n_workers=args.workers, threads_per_worker=args.threads, backend=args.backend,
            workers_per_gpu=args.workers_per_gpu, dashboard_address="127.0.0.1:0"))
        client = stack.enter_context(Client(cluster))
        inputs = make_inputs(client, args.queries, source=args.source, index_docs=args.index_docs)
        cost.update(costs(client, models))
        log(f"engine costs (best of workers): {json.dumps(cost)}")
        alone = stack.enter_context(vllm_alone(alone_systems, models, args)) if alone_systems else None
        for name in args.pipeline_names:
            config = {"model": args.model, "max_tokens": args.max_tokens,
                      **({"model2": args.model2} if name in TWO_MODELS else {})}
            results.append(bench_pipeline(client, name, registry_[name], inputs, config, args.system_names,
                                          args.repeats, cost, args.workers, attribute=bool(args.attribution),
                                          warmup_queries=args.warmup_queries, progress=write, alone=alone))
            write()
    report = markdown(results, args)
    print(report)
    print(overall_table(results))
    if args.plot:
        plot(results, args.plot)
    if args.attribution:
        print(attribution_table(results))
        plot_attribution(results, args.attribution)
    if not all(s["exact"] for r in results for s in r["systems"].values()):
        log("some system's outputs differ from the first run's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
