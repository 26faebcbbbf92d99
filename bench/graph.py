"""Benchmark of the LLM task graph: planning time at scale, and what the rewrite passes buy end to end.

    python bench/graph.py --json /tmp/graph-bench.json
    python bench/graph.py --quick          # smoke run (< 60 s): tiny model, small sizes, one repetition
    python bench/graph.py --scale --json docs/bench/planning-scale.json --plot docs/planning-scale.png \
        --baseline docs/bench/planning-scale-before.json   # planning only, 2k-20k queries, cost per call

What it measures:

1. **Planning time at scale.** A 10-operator workflow: a chain of ``--steps`` batched
   ``generate`` calls on model ``tiny``, each prompt template (a ~40-token instruction) filled
   by the previous step's output, the first from a list of distinct questions. For each of
   ``--sizes`` queries it times, separately: building the nodes (``daskllm.generate`` /
   ``daskllm.prompt``), planning (``daskllm.plan.planner.optimize``: the IR graph and every rewrite
   pass, each timed on its own) and lowering (``daskllm.plan.lower.lower(graph)``), which together
   are exactly what ``daskllm.runtime.submit.plan([node])`` does. Nothing is executed: only the
   tokenizer is loaded. Before each repetition the plan cache (``submit._plans``), the result
   cache and the client-side tokenizer memos (``PromptTokenizer.encode``, ``stable_prefix``,
   the block-hash memo) are cleared, so every repetition plans from cold, as a first
   ``compute`` would. Once per size the same
   plan is lowered again with ``granularity="query"``, to count the tasks that knob gives.
   Target: under 5 s for 20,000 queries x 10 operators, and a cost per call that stays flat
   from 2,000 to 20,000 queries. ``--scale`` runs only this part at 2k, 5k, 10k and 20k queries;
   ``--plot`` draws the microseconds per call of each phase against the queries (``--baseline``:
   with the total of an earlier run's JSON beside it).
2. **Passes on vs off, end to end.** A ``LocalLLMCluster(models=[--model], n_workers=--workers)``
   runs a shared-prefix workload: ``--systems`` system prompts (~150-250 tokens each) x
   ``--questions`` calls each, ``--duplicates`` of the calls repeating another call of the same
   batch, ``max_tokens=--max-tokens``, greedy. Each mode computes the same nodes with
   ``daskllm.compute``: ``all passes`` (the defaults) and ``naive`` (``passes=[]``,
   ``granularity="query"``, ``result_cache=False``), plus ablations with one pass left out
   of the defaults. Before every run the workers' prefix caches, the client's result cache and
   the lowering memo are cleared, so each run starts cold and includes its own planning. Runs
   are interleaved (every repetition runs every mode, in a rotating order); the median wall time
   is reported, the speedup is the median of per-repetition ratios, and ``daskllm.usage()``
   gives calls requested/executed and prefill tokens computed/cached. The prefill ratio is
   ``prefill_tokens_computed / prefill_lower_bound`` (distinct tokens in the prefix tree of all
   prompts, from ``lowered(nodes).report``): 1.0 means no prompt token was computed twice.
   Every run's outputs must equal the first naive run's; the script exits with status 1 if not.

The JSON keeps every raw number and the machine information.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import dask
import networkx as nx
from machine import log
from machine import machine_info as shared_machine_info

import daskllm
from daskllm.plan import lower as lowering
from daskllm.plan import planner
from daskllm.plan.context import LOCAL, state
from daskllm.plan.passes import REGISTRY, register_pass
from daskllm.prompts import PromptTokenizer, tokenizer_for
from daskllm.runtime import submit as lower
from daskllm.worker.results import RESULTS

DEFAULT_PASSES = list(dask.config.get("daskllm.rewrite.passes"))

STEP_TEMPLATE = ("Step {step} of the review. You are a careful technical editor. Rewrite the answer below so that it "
                 "keeps every fact, fixes any mistake, and reads clearly to someone new to Python.\n"
                 "Answer: {{x}}\nRewritten answer:")

SYSTEM_PROMPTS = [
    ("You are a senior Python engineer who answers questions about the standard library. Answer in one or two "
     "sentences. Name the module and the function or class to use, give the exact call with its most important "
     "arguments, and mention one pitfall that a newcomer is likely to hit, such as an encoding that must be given "
     "explicitly, a file that must be opened in binary mode, or a result that is an iterator rather than a list. "
     "Prefer the standard library over third-party packages, prefer pathlib over os.path, and prefer context "
     "managers for anything that must be closed. If the question is ambiguous, answer the most common reading of "
     "it and say which reading you chose. Never invent functions that do not exist; if there is no standard "
     "library function for the task, say so plainly and suggest the smallest amount of code that does it.\n\n"),
    ("You are a strict code reviewer on a team that maintains a large Python service. For each question, say "
     "whether the approach it implies is idiomatic, in at most two sentences, and why. Cite the relevant PEP when "
     "there is one (PEP 8 for style, PEP 343 for context managers, PEP 484 for type hints, PEP 3101 for string "
     "formatting). Point out any performance trap, such as quadratic string concatenation in a loop, reading a "
     "whole file into memory when streaming would do, or a regular expression compiled on every call. Do not "
     "rewrite the code; name the change that matters most and stop.\n\n"),
    ("You are a patient teacher for students who have just learned Python's syntax and are now meeting its "
     "standard library for the first time. Explain the answer to each question in plain words, as you would to a "
     "student who knows loops, functions and dictionaries but has never read the library reference. Start with "
     "the name of the module, say in one short sentence what problem the module solves, then show the single "
     "line of code that answers the question. Avoid jargon; when a technical word is unavoidable, such as "
     "iterator, context manager or encoding, define it in a few words the first time you use it. Keep the "
     "whole answer under sixty words, and end with one small exercise the student could try next to check "
     "their understanding.\n\n"),
]
QUESTION_TEMPLATE = "Question: {q}\nAnswer:"

_OPENINGS = ["How do I", "What is the best way to", "Which module lets me", "Is there a built-in way to",
             "What is the fastest way to", "How can I safely", "What is the idiomatic way to", "Can I",
             "Why does my code fail when I try to", "Show me how to", "What should I use to",
             "How would you", "What is the simplest way to", "Is it safe to", "How do experienced developers",
             "What goes wrong when beginners try to", "What is a portable way to", "How should I",
             "What is the modern way to", "Explain how to"]
_TASKS = ["parse a date string", "read a CSV file", "hash a large file", "zip a folder", "walk a directory tree",
          "time a function", "sort a list of dicts by a key", "merge sorted iterables", "read a JSON document",
          "compile a regular expression", "copy a file with its metadata", "run a subprocess and capture output",
          "retry a flaky network call", "parse command-line arguments", "write a log file that rotates",
          "compare two text files", "generate a random password", "count words in a text",
          "cache the results of a function", "schedule a task every minute", "download a web page",
          "serialize an object to bytes", "read environment variables", "encode data as base64",
          "work with temporary files", "measure memory use", "format a number with thousands separators",
          "split a path into its parts", "decompress a gzip file", "iterate over pairs of items",
          "group items by a key", "find duplicates in a list", "deep-copy a nested structure",
          "validate an email address", "convert between time zones", "read a config file",
          "send an email", "parse an XML document", "check whether a port is open", "lock a file"]
_CONTEXTS = ["in a script", "in a long-running service", "on Windows", "on Linux", "in a unit test",
             "inside a thread pool", "with asyncio", "without loading everything into memory", "in Python 3.11",
             "for a file of several gigabytes", "in a command-line tool", "when the input may be malformed",
             "in a Jupyter notebook", "for millions of items", "inside a Docker container", "in a web handler",
             "with type hints", "when performance matters", "with only the standard library", "in a library",
             "in a data pipeline", "when the file is being written by another process", "in a cron job",
             "on a read-only file system", "with Unicode input", "for a beginner"]


def distinct_questions(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct, varied questions (opening x task x context), in a seeded random order."""
    combos = list(itertools.product(range(len(_OPENINGS)), range(len(_TASKS)), range(len(_CONTEXTS))))
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} distinct questions, asked for {n}")
    rng = random.Random(seed)
    return [f"{_OPENINGS[a]} {_TASKS[b]} {_CONTEXTS[c]}?" for a, b, c in rng.sample(combos, n)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("part 1: planning time")
    g.add_argument("--sizes", nargs="+", type=int, default=[2000, 20000], help="queries per workflow")
    g.add_argument("--steps", type=int, default=10, help="generate operators in the chain")
    g.add_argument("--plan-model", default="tiny", help="model whose tokenizer plans the workflow")
    g.add_argument("--plan-repeats", type=int, default=3, help="repetitions per size; the median is reported")
    g.add_argument("--plan-budget", type=float, default=90.0,
                   help="after the first repetition of a size, repeat only while less than this many seconds "
                        "were spent on that size")
    g = p.add_argument_group("part 2: passes on vs off")
    g.add_argument("--model", default="small", help="LLM recipe or model directory on the workers")
    g.add_argument("--workers", type=int, default=1, help="cluster workers")
    g.add_argument("--threads-per-worker", type=int, default=4, help="Dask task threads per worker")
    g.add_argument("--systems", type=int, default=3, help=f"system prompts (at most {len(SYSTEM_PROMPTS)})")
    g.add_argument("--questions", type=int, default=32, help="calls per system prompt")
    g.add_argument("--duplicates", type=float, default=0.25, help="fraction of calls repeating another call")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--repeats", type=int, default=3, help="repetitions of every mode; the median is reported")
    g.add_argument("--ablations", nargs="*", default=["cse", "prefix", "stage"],
                   help="passes to leave out one at a time (none: no ablation rows)")
    g.add_argument("--ablation-repeats", type=int, default=1,
                   help="how many of the repetitions (the first ones) also run the ablations")
    g.add_argument("--e2e-budget", type=float, default=300.0,
                   help="after the first repetition, start another only while less than this many seconds were "
                        "spent on part 2")
    g.add_argument("--scale", action="store_true",
                   help="part 1 only, at 2,000, 5,000, 10,000 and 20,000 queries (the cost-per-call curve)")
    g.add_argument("--plot", metavar="PNG", help="draw part 1's microseconds per call against the queries here")
    g.add_argument("--baseline", metavar="JSON", help="with --plot: an earlier run's --json, drawn beside")
    p.add_argument("--skip-plan", action="store_true", help="skip part 1")
    p.add_argument("--skip-e2e", action="store_true", help="skip part 2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes 200 and 2000, model tiny, 8 calls per system prompt, one repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.plan_repeats = [200, 2000], 1
        args.model, args.questions, args.repeats = "tiny", 8, 1
    if args.scale:
        args.sizes, args.skip_e2e = [2000, 5000, 10000, 20000], True
    if not 1 <= args.systems <= len(SYSTEM_PROMPTS):
        p.error(f"--systems must be between 1 and {len(SYSTEM_PROMPTS)}")
    for name in ("steps", "plan_repeats", "workers", "threads_per_worker", "questions", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(s < 1 for s in args.sizes):
        p.error("--sizes must be >= 1")
    if not 0 <= args.duplicates < 1:
        p.error("--duplicates must be in [0, 1)")
    unknown = [a for a in args.ablations if a not in DEFAULT_PASSES]
    if unknown:
        p.error(f"--ablations: {unknown} are not default passes {DEFAULT_PASSES}")
    return args


def machine_info() -> dict:
    return shared_machine_info(networkx=nx.__version__, **git_state())


def git_state() -> dict:
    """The commit measured, and which library files differed from it (a run on a dirty tree says so)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    modified = [line[3:] for line in git("status", "--porcelain", "--", "daskllm").splitlines()]
    return {"git_commit": git("rev-parse", "--short", "HEAD").strip(), "git_modified": modified}


def _median(values):
    values = list(values)
    return statistics.median(values) if values else float("nan")


# --- part 1: planning time ------------------------------------------------------------------------


class _PassTimes:
    """Wraps the registered passes so each one's ``run`` is timed (through the public register_pass)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.saved = dict(REGISTRY)

    def __enter__(self):
        for name, cls in self.saved.items():
            register_pass(name, self._timed(name, cls))
        return self

    def __exit__(self, *exc):
        REGISTRY.clear()
        REGISTRY.update(self.saved)

    def _timed(self, name, cls):
        seconds = self.seconds

        class Timed:
            def __init__(self):
                self.inner = cls()
                self.name = self.inner.name

            def run(self, graph):
                start = time.perf_counter()
                try:
                    return self.inner.run(graph)
                finally:
                    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return Timed


def build_chain(questions: list[str], steps: int, model: str):
    node = questions
    for step in range(steps):
        node = daskllm.generate(daskllm.prompt(STEP_TEMPLATE.format(step=step), x=node), model=model, max_tokens=16)
    return node


def cold_planning_state() -> None:
    lower._plans.clear()
    RESULTS.clear()
    PromptTokenizer.encode.cache_clear()
    PromptTokenizer.stable_prefix.cache_clear()
    lowering._hex_block_hashes.cache_clear()
    gc.collect()


def plan_once(questions: list[str], args) -> tuple[dict, object, nx.DiGraph]:
    cold_planning_state()
    t0 = time.perf_counter()
    node = build_chain(questions, args.steps, args.plan_model)
    t1 = time.perf_counter()
    with _PassTimes() as passes:
        graph = planner.optimize([node], lower.current_options(), LOCAL)
    t2 = time.perf_counter()
    result = lowering.lower(graph)
    t3 = time.perf_counter()
    report = result.report
    row = {"build_s": t1 - t0, "plan_s": t2 - t1, "lower_s": t3 - t2, "total_s": t3 - t0,
           "pass_s": dict(passes.seconds), "tasks": dict(report["tasks"]), "requested": dict(report["requested"]),
           "prefix": report.get("prefix"), "stage": report.get("stage"), "cse": report.get("cse")}
    return row, node, graph


def bench_planning(args, log) -> dict:
    tokenizer_for(args.plan_model)  # loading the tokenizer is a one-time cost, not planning
    out = {"steps": args.steps, "model": args.plan_model, "sizes": {}}
    for size in args.sizes:
        questions = distinct_questions(size, args.seed)
        runs, spent = [], 0.0
        for rep in range(args.plan_repeats):
            if rep and spent >= args.plan_budget:
                log(f"  plan {size}: budget spent after {rep} repetition(s)")
                break
            row, node, graph = plan_once(questions, args)
            spent += row["total_s"]
            runs.append({"rep": rep, **row})
            log(f"  plan {size} x {args.steps}: build {row['build_s']:.2f}s, plan {row['plan_s']:.2f}s "
                f"({', '.join(f'{k} {v:.2f}' for k, v in row['pass_s'].items())}), lower {row['lower_s']:.2f}s")
        # The same plan lowered one task per call: what granularity="query" would hand the scheduler.
        start = time.perf_counter()
        plan = state(graph)
        graph.graph["state"] = dataclasses.replace(plan, options=dataclasses.replace(plan.options,
                                                                                  granularity="query"))
        per_query = lowering.lower(graph).report["tasks"]
        query_lower_s = time.perf_counter() - start
        del node, graph
        gc.collect()
        summary = {k: _median(r[k] for r in runs) for k in ("build_s", "plan_s", "lower_s", "total_s")}
        summary["pass_s"] = {p: _median(r["pass_s"].get(p, 0.0) for r in runs) for p in runs[0]["pass_s"]}
        summary.update(repetitions=len(runs), tasks=runs[0]["tasks"], query_tasks=dict(per_query),
                       query_lower_s=query_lower_s, prefix=runs[0]["prefix"], stage=runs[0]["stage"],
                       calls=runs[0]["requested"].get("generate", 0))
        out["sizes"][size] = {"runs": runs, "summary": summary}
    return out


def plot_scale(plan: dict, path: str, baseline: dict | None = None) -> None:
    """Microseconds per call of each planning phase (stacked) against the queries: flat is linear."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(planning):
        sizes = sorted(planning["sizes"].items(), key=lambda kv: int(kv[0]))
        return [int(k) for k, _ in sizes], [v["summary"] for _, v in sizes]

    queries, summaries = curve(plan)
    phases = {"build": [s["build_s"] for s in summaries]}
    for name in summaries[0]["pass_s"]:
        phases[name] = [s["pass_s"][name] for s in summaries]
    # the IR graph's construction and the acyclicity checks are in plan_s but in no pass
    phases["IR graph"] = [s["plan_s"] - sum(s["pass_s"].values()) for s in summaries]
    phases["lowering"] = [s["lower_s"] for s in summaries]
    per_call = {k: [1e6 * t / s["calls"] for t, s in zip(v, summaries)] for k, v in phases.items()
                if max(v) > 0.01 * max(s["total_s"] for s in summaries)}
    # cse is the first pass asking for every call's prompt and hash: it pays for tokenizing them
    labels = [{"cse": "cse (tokenizes, hashes)"}.get(name, name) for name in per_call]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.stackplot(queries, *per_call.values(), labels=labels, alpha=0.8)
    ax.plot(queries, [1e6 * s["total_s"] / s["calls"] for s in summaries], "k.-", label="total")
    if baseline:
        base_q, base_s = curve(baseline)
        ax.plot(base_q, [1e6 * s["total_s"] / s["calls"] for s in base_s], "k--", marker="o", label="total, before")
    budget = 1e6 * 5 / (20000 * plan["steps"])
    ax.axhline(budget, color="red", lw=0.8, ls=":", label="5 s at 20,000 x 10")
    ax.set_xlabel("queries (calls = queries x %d operators)" % plan["steps"])
    ax.set_ylabel("planning µs per call")
    ax.set_xlim(min(queries), max(queries))
    ax.set_xticks(queries)
    ax.set_ylim(0, None)
    ax.set_title("Planning cost per call (build + passes + lowering), model %s" % plan["model"])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- part 2: passes on vs off ---------------------------------------------------------------------


def shared_prefix_workload(args) -> tuple[list, dict]:
    n_dup = round(args.questions * args.duplicates)
    distinct = distinct_questions(args.questions - n_dup, args.seed + 1)
    rng = random.Random(args.seed)
    calls = distinct + [distinct[i % len(distinct)] for i in range(n_dup)]
    rng.shuffle(calls)
    nodes = [daskllm.generate(daskllm.prompt(system + QUESTION_TEMPLATE, q=calls), model=args.model,
                              max_tokens=args.max_tokens) for system in SYSTEM_PROMPTS[:args.systems]]
    tok = tokenizer_for(args.model)
    info = {"system_prompt_tokens": [len(tok.encode(s)) for s in SYSTEM_PROMPTS[:args.systems]],
            "question_tokens_mean": statistics.mean(len(tok.encode(QUESTION_TEMPLATE.format(q=q))) for q in distinct),
            "calls": len(nodes) * len(calls), "distinct_calls": len(nodes) * len(distinct)}
    return nodes, info


def modes(args) -> dict[str, dict]:
    out = {"all passes": {}, "naive": {"passes": [], "granularity": "query", "result_cache": False}}
    for name in args.ablations:
        out[f"without {name}"] = {"passes": [p for p in DEFAULT_PASSES if p != name]}
    return out


def _engine_counters(client) -> dict[str, int]:
    from daskllm.worker import engine_stats

    total: dict[str, int] = defaultdict(int)
    for per_worker in client.run(engine_stats).values():
        for stats in per_worker.values():
            for k in ("prefill_tokens_computed", "prefill_tokens_cached", "decode_tokens", "steps",
                      "batched_sequences"):
                total[k] += stats[k]
    return total


def run_mode(client, nodes, settings: dict) -> tuple[dict, tuple]:
    from daskllm.worker import reset_prefix_caches

    client.run(reset_prefix_caches)
    RESULTS.clear()
    lower._plans.clear()
    before = _engine_counters(client)
    with daskllm.usage() as u:
        start = time.perf_counter()
        results = daskllm.compute(*nodes, **settings)
        wall = time.perf_counter() - start
    after = _engine_counters(client)
    engine = {k: after[k] - before[k] for k in after}
    engine["mean_batch"] = engine["batched_sequences"] / engine["steps"] if engine["steps"] else 0.0
    return {"seconds": wall, "usage": u.as_dict(), "engine": engine}, results


def bench_end_to_end(args, log) -> dict:
    from distributed import Client

    from daskllm.cluster import LocalLLMCluster

    nodes, workload = shared_prefix_workload(args)
    bound = lower.plan(nodes).report["prefill_lower_bound"]
    all_modes = modes(args)
    log(f"starting a {args.workers}-worker cluster with {args.model} ...")
    start = time.perf_counter()
    with LocalLLMCluster(models=[args.model], embedders=(), rerankers=(), n_workers=args.workers,
                         threads_per_worker=args.threads_per_worker, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        startup_s = time.perf_counter() - start
        # Warm-up on other prompts: first-call costs (torch kernels, imports on the workers) are not timed.
        warm = daskllm.generate(daskllm.prompt("Warm-up {q}", q=["one", "two", "three"]), model=args.model,
                                max_tokens=2)
        daskllm.compute(warm, result_cache=False)
        runs: list[dict] = []
        reference = None
        identical = True
        e2e_start = time.perf_counter()
        for rep in range(args.repeats):
            if rep and time.perf_counter() - e2e_start >= args.e2e_budget:
                log(f"  part 2: budget spent after {rep} repetition(s)")
                break
            names = list(all_modes) if rep < args.ablation_repeats else ["all passes", "naive"]
            shift = rep % len(names)
            order = names[shift:] + names[:shift]
            t0 = time.perf_counter()
            for name in order:
                row, results = run_mode(client, nodes, all_modes[name])
                if reference is None:
                    reference = results
                same = results == reference
                identical &= same
                runs.append({"rep": rep, "mode": name, "identical": same, **row})
                log(f"  {name}: {row['seconds']:.2f}s, executed {row['usage']['executed']}, prefill computed "
                    f"{row['usage']['prefill_tokens_computed']}{'' if same else '  OUTPUTS DIFFER'}")
            log(f"  repetition {rep + 1}/{args.repeats} took {time.perf_counter() - t0:.1f}s")
        sample = [r[:2] for r in reference]
    summary = {}
    for name in all_modes:
        mine = [r for r in runs if r["mode"] == name]
        if not mine:
            continue
        u = mine[0]["usage"]
        summary[name] = {
            "runs": len(mine), "seconds": _median(r["seconds"] for r in mine),
            "seconds_range": [min(r["seconds"] for r in mine), max(r["seconds"] for r in mine)],
            "prefill_ratio_range": [min(r["usage"]["prefill_tokens_computed"] for r in mine) / bound,
                                    max(r["usage"]["prefill_tokens_computed"] for r in mine) / bound],
            "requested": u["requested"].get("generate", 0), "executed": u["executed"].get("generate", 0),
            "prefills": u["executed"].get("prefill", 0), "tasks": u["tasks"],
            "prefill_tokens_computed": _median(r["usage"]["prefill_tokens_computed"] for r in mine),
            "prefill_tokens_cached": _median(r["usage"]["prefill_tokens_cached"] for r in mine),
            "engine_prefill_computed": _median(r["engine"]["prefill_tokens_computed"] for r in mine),
            "mean_batch": _median(r["engine"]["mean_batch"] for r in mine),
            "identical": all(r["identical"] for r in mine)}
        summary[name]["prefill_ratio"] = summary[name]["prefill_tokens_computed"] / bound
    for name, s in summary.items():  # speedup over naive: median of per-repetition ratios
        ratios = [next(n["seconds"] for n in runs if n["rep"] == r["rep"] and n["mode"] == "naive") / r["seconds"]
                  for r in runs if r["mode"] == name]
        s["speedup"] = _median(ratios)
    return {"model": args.model, "workers": args.workers, "threads_per_worker": args.threads_per_worker,
            "max_tokens": args.max_tokens, "workload": workload, "modes": all_modes, "prefill_lower_bound": bound,
            "startup_s": startup_s, "runs": runs, "summary": summary, "identical": identical,
            "sample_outputs": sample}


# --- report -----------------------------------------------------------------------------------------


def _tasks(tasks: dict) -> str:
    return ", ".join(f"{op} {n:,}" for op, n in sorted(tasks.items()))


def markdown(plan: dict | None, e2e: dict | None, args) -> str:
    lines = []
    if plan:
        reps = {s["summary"]["repetitions"] for s in plan["sizes"].values()}
        lines.append(f"Planning time: {plan['steps']} chained batched generate operators, model {plan['model']} "
                     f"(tokenizer only), seconds, median of {'/'.join(map(str, sorted(reps)))} cold repetition(s)\n")
        pass_names = list(next(iter(plan["sizes"].values()))["summary"]["pass_s"])
        lines += ["| queries | calls | build | plan (passes) | " + " | ".join(pass_names)
                  + " | lowering | total | µs per call |",
                  "|---:|---:|---:|---:|" + "---:|" * len(pass_names) + "---:|---:|---:|"]
        for size, s in plan["sizes"].items():
            s = s["summary"]
            lines.append(f"| {int(size):,} | {s['calls']:,} | {s['build_s']:.2f} | {s['plan_s']:.2f} | "
                         + " | ".join(f"{s['pass_s'][p]:.2f}" for p in pass_names)
                         + f" | {s['lower_s']:.2f} | **{s['total_s']:.2f}** | {1e6 * s['total_s'] / s['calls']:.1f} |")
        lines.append("")
        lines += ["| queries | tasks (granularity=shard) | tasks (granularity=query) | lowering with query |",
                  "|---:|---|---|---:|"]
        for size, s in plan["sizes"].items():
            s = s["summary"]
            lines.append(f"| {int(size):,} | {_tasks(s['tasks'])} | {_tasks(s['query_tasks'])} | "
                         f"{s['query_lower_s']:.2f} s |")
        big = plan["sizes"].get(20000) or plan["sizes"].get("20000")
        if big and plan["steps"] == 10:
            met = big["summary"]["total_s"] < 5
            lines.append(f"\nTarget (20,000 x 10 planned in under 5 s): {'met' if met else 'NOT met'} "
                         f"({big['summary']['total_s']:.1f} s).")
        lines.append("")
    if e2e:
        w = e2e["workload"]
        lines.append(f"Passes on vs off: model {e2e['model']}, {e2e['workers']} worker(s) x "
                     f"{e2e['threads_per_worker']} threads; {len(w['system_prompt_tokens'])} system prompts "
                     f"({'/'.join(map(str, w['system_prompt_tokens']))} tokens) x {args.questions} calls "
                     f"({w['calls']} calls, {w['distinct_calls']} distinct; question part ~"
                     f"{w['question_tokens_mean']:.0f} tokens), max_tokens={e2e['max_tokens']}; prefill lower bound "
                     f"{e2e['prefill_lower_bound']:,} tokens. Median wall time; speedup = median of per-repetition "
                     f"naive/mode ratios\n")
        lines += [("| mode | runs | wall (min-max) | speedup vs naive | calls requested / executed | prefill tasks | "
                   "prefill tokens computed / cached | prefill ratio (min-max) | mean engine batch | "
                   "outputs identical |"),
                  "|---|---:|---:|---:|---|---:|---|---:|---:|---|"]
        for name, s in e2e["summary"].items():
            lo, hi = s["seconds_range"]
            rlo, rhi = s["prefill_ratio_range"]
            lines.append(f"| {name} | {s['runs']} | {s['seconds']:.1f} s ({lo:.1f}-{hi:.1f}) | {s['speedup']:.2f}x | "
                         f"{s['requested']} / {s['executed']} | {s['prefills']} | "
                         f"{s['prefill_tokens_computed']:,.0f} / {s['prefill_tokens_cached']:,.0f} | "
                         f"{s['prefill_ratio']:.2f} ({rlo:.2f}-{rhi:.2f}) | {s['mean_batch']:.1f} | "
                         f"{'yes' if s['identical'] else 'NO'} |")
        lines.append("")
        lines.append("Tasks per run: " + "; ".join(f"{name}: {_tasks(s['tasks'])}"
                                                   for name, s in e2e["summary"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)

    info = machine_info()
    log(f"{info['cpu_count']} CPUs ({info['cpu_model']}), dask {info['dask']}, torch {info['torch']}")
    started = time.perf_counter()
    load_before = os.getloadavg()
    plan = None if args.skip_plan else bench_planning(args, log)
    plan_s = time.perf_counter() - started
    e2e = None if args.skip_e2e else bench_end_to_end(args, log)
    total_s = time.perf_counter() - started
    load_after = os.getloadavg()
    table = markdown(plan, e2e, args)
    print(table)
    print(f"\ntotal {total_s:.0f}s (planning {plan_s:.0f}s); {info['cpu_count']} CPUs; load average (1 min) "
          f"before/after: {load_before[0]:.2f} / {load_after[0]:.2f}; placement policy "
          f"{dask.config.get('daskllm.placement.policy', 'none')}; commit {info['git_commit']}"
          f"{' + uncommitted changes to ' + ', '.join(info['git_modified']) if info['git_modified'] else ''}")
    if args.plot and plan:
        baseline = None
        if args.baseline:
            with open(args.baseline) as f:
                baseline = json.load(f)["planning"]
        plot_scale(plan, args.plot, baseline)
        log(f"wrote {args.plot}")
    if args.json:
        payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args), "machine": info,
                   "load_average_before": load_before, "load_average_after": load_after, "total_seconds": total_s,
                   "planning": plan, "end_to_end": e2e, "markdown": table}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        log(f"wrote {args.json}")
    if e2e and not e2e["identical"]:
        log("ERROR: a run's outputs differ from the naive run's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
