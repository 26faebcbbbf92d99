"""The main job (``make demo``, ``daskllm demo``): a real model answering real questions on a
local Dask cluster, and what daskllm did to get there.

1. **Questions with retrieval.** Documentation passages of the running Python's standard
   library are embedded (MiniLM) into a faiss index sharded over the workers; each question
   is searched there, and SmolLM2-135M-Instruct answers it from the passages found, in one
   planned graph (search, then generate). Each answer is checked: does it name the module
   that does the job? The same questions without the passages show what retrieval adds.
2. **The plan's numbers.** What the rewrite passes made of that graph, and the same work
   under the naive plan (a task per call, no rewrites): time, tasks, prefix-cache hits, and
   the same answers.
3. **A table job.** ``ddf.llm.map`` over rows of the standard-library table: identical
   prompts anywhere in the table run once; the same map as a plain Dask ``map_partitions``
   (one model call per row) for comparison.

The dashboard (with its LLM page) is up while it runs.
"""

from __future__ import annotations

import io
import time

import dask.dataframe as dd
from distributed import Client

from daskllm import api, config, models
from daskllm.cluster import DASHBOARD_ADDRESS, LocalLLMCluster
from daskllm.datasets import HOWTO, load, names_module
from daskllm.engines import SamplingParams
from daskllm.retrieval import ShardedIndex
from daskllm.runtime.control import cold_start
from daskllm.runtime import metering
from daskllm.worker.host import get_engine

QUESTIONS = HOWTO
# The modules whose documentation goes into the index: those above and their neighbours.
MODULES = sorted({module for _, module in QUESTIONS} | {
    "os", "os.path", "pathlib", "io", "re", "time", "itertools", "logging", "zipfile", "tarfile", "zlib",
    "base64", "random", "statistics", "sqlite3", "pickle", "copy", "uuid", "threading", "math", "string",
    "urllib.parse", "urllib.request", "concurrent.futures", "bisect", "difflib", "configparser", "contextlib",
    "dataclasses", "operator", "traceback", "timeit", "fnmatch", "codecs",
})
SYSTEM = ("You are a Python expert. Answer the question in one or two sentences using the documentation "
          "given. Name the standard-library module and the function to use.")
WITH_DOCS = "Documentation:\n{docs}\n\nQuestion: {q}"
PASSAGE_CHARS = 240
# Readable answers: the first line (an instruction-tuned model goes on with code examples).
STOP = ("\n",)

TABLE_MODULES = ["json", "csv", "os", "shutil", "tempfile", "glob", "hashlib", "gzip", "datetime", "heapq",
                 "textwrap", "secrets"]
PURPOSE = "In one line, what is the Python {module} module for?"


def passages(modules=MODULES, first=(), limit: int | None = None):
    """The documentation passages of ``modules``: (module, qualname, "qualname(signature): first
    sentence"); those of the modules in ``first`` come first, then the others, ``limit`` in all."""
    docs = load("stdlib-docs")
    docs = docs[docs["module"].isin(list(modules))]
    docs = docs.assign(later=~docs["module"].isin(list(first))).sort_values("later", kind="stable")
    return [(row.module, row.qualname, f"{row.qualname}{row.signature or ''}: {row.first_sentence}"[:PASSAGE_CHARS])
            for row in docs.itertuples()][:limit]


def answer_graph(index, questions: list[str], model: str, *, system: str, k: int, max_tokens: int):
    """The graph of retrieval-augmented answers: (hits, answers from the hits, answers without them).

    Each question is searched in ``index``; the model answers it in a chat whose system message
    is ``system``, once from the ``k`` passages found and once from the question alone.
    """
    hits = api.search(index, questions, k=k)
    with_docs = api.generate(
        api.chat([{"role": "system", "content": system}, {"role": "user", "content": WITH_DOCS}],
                     docs=hits, q=questions), model=model, max_tokens=max_tokens, stop=STOP)
    without = api.generate(
        api.chat([{"role": "system", "content": system}, {"role": "user", "content": "{q}"}], q=questions),
        model=model, max_tokens=max_tokens, stop=STOP)
    return hits, with_docs, without


def answer_questions(client, model: str, n_questions: int, max_tokens: int, n_passages: int | None = None,
                     echo=print) -> dict:
    """Section 1 and 2: retrieval-augmented answers, checked, then the plan's numbers. The index
    holds ``n_passages`` (default: all), the asked questions' own modules first."""
    asked = QUESTIONS[:n_questions]
    found = passages(first={module for _, module in asked}, limit=n_passages)
    echo(f"\n1. Questions about the Python standard library, answered from its documentation\n")
    start = time.perf_counter()
    index = ShardedIndex.from_texts(client, "demo-stdlib", [text for *_, text in found])
    index_seconds = time.perf_counter() - start
    echo(f"Indexed {len(found):,} documentation passages of {len({m for m, *_ in found})} standard-library modules "
         f"(MiniLM embeddings, a faiss index sharded over the workers) in {index_seconds:.1f} s.")
    questions = [q for q, _ in asked]
    hits, with_docs, without = answer_graph(index, questions, model, system=SYSTEM, k=3, max_tokens=max_tokens)

    sources, answers = api.compute(hits, with_docs, result_cache=False)
    right = [names_module(a, m) for a, (_, m) in zip(answers, asked)]
    for (question, module), found_hits, answer, ok in list(zip(asked, sources, answers, right))[:6]:
        echo(f"\n  Q: {question}\n  sources: {', '.join(h.text.split('(')[0].split(':')[0] for h in found_hits)}\n"
             f"  A: {answer.strip()}\n  {'✓' if ok else '✗'} names {module}")
    plain_answers = api.compute(without, result_cache=False)[0]
    plain_right = [names_module(a, m) for a, (_, m) in zip(plain_answers, asked)]
    echo(f"\n{len(asked)} questions: the answer names the right module for {sum(right)} of {len(asked)} with the "
         f"documentation, {sum(plain_right)} of {len(asked)} without it.")

    echo("\n2. What the plan did with those questions (each plan timed from cold caches)\n")
    settings = {"optimized": {}, "naive": {"passes": [], "granularity": "query", "release_threads": False}}
    report = {name: api.explain(hits, with_docs, file=io.StringIO(), result_cache=False, **kw)
              for name, kw in settings.items()}
    for line in _plan_lines(report["optimized"]):
        echo(f"  {line}")
    seconds, outputs = {}, {}
    for name, kw in settings.items():
        cold_start(client)
        start = time.perf_counter()
        with metering.usage() as usage:
            outputs[name] = api.compute(hits, with_docs, result_cache=False, **kw)[1]
        seconds[name] = time.perf_counter() - start
        if name == "optimized":
            optimized_usage = usage
    usage, optimized_seconds, naive_seconds = optimized_usage, seconds["optimized"], seconds["naive"]
    tasks, naive_tasks = (sum(report[name]["tasks"].values()) for name in settings)
    same = outputs["naive"] == outputs["optimized"] == answers
    hit_rate = usage.prefill_tokens_cached / max(1, usage.prefill_tokens)
    echo(f"\n  optimized plan: {optimized_seconds:.1f} s, {tasks} Dask tasks, {usage.decode_tokens} tokens generated "
         f"({usage.decode_tokens / optimized_seconds:.0f}/s), {usage.prefill_tokens_cached:,} of "
         f"{usage.prefill_tokens:,} prompt tokens from the prefix cache ({100 * hit_rate:.0f}%)")
    echo(f"  naive plan (a task per call, no rewrites): {naive_seconds:.1f} s, {naive_tasks} Dask tasks; "
         f"same answers: {same}; the optimized plan is {naive_seconds / optimized_seconds:.2f}x as fast")
    index.drop()
    return {"questions": len(asked), "passages": len(found), "index_seconds": index_seconds,
            "named_module_with_docs": sum(right), "named_module_without_docs": sum(plain_right),
            "answers": answers, "optimized_seconds": optimized_seconds, "naive_seconds": naive_seconds,
            "tasks": tasks, "naive_tasks": naive_tasks, "same_answers_as_naive": same,
            "prefix_cache_hit_rate": hit_rate, "usage": usage.as_dict()}


def _plan_lines(report: dict) -> list[str]:
    lines = [f"passes applied: {', '.join(report.get('applied', [])) or 'none'}",
             "Dask tasks by type: " + ", ".join(f"{op} {n}" for op, n in sorted(report.get("tasks", {}).items()))]
    if "prefix" in report:
        r = report["prefix"]
        lines.append(f"shared-prefix prefill: {r['prefills']} prefill tasks ({r['shared']} shared, {r['partial']} "
                     f"started before their retrieval finished)")
    return lines


def table_job(model: str, max_tokens: int, rows: int | None = None, echo=print) -> dict:
    """Section 3: ``ddf.llm`` over rows of the standard-library table (``rows`` of them, spread
    over the table, or all), and the same map as plain Dask."""
    docs = load("stdlib-docs")
    selected = docs[docs["module"].isin(TABLE_MODULES)][["qualname", "module"]].reset_index(drop=True)
    if rows is not None and rows < len(selected):
        selected = selected.iloc[[round(i * len(selected) / rows) for i in range(rows)]].reset_index(drop=True)
    table = dd.from_pandas(selected, npartitions=4)
    echo(f"\n3. A table job: ddf.llm over {len(selected)} rows (documented functions and classes of "
         f"{selected['module'].nunique()} modules)\n")
    start = time.perf_counter()
    with metering.usage() as usage:
        ours = table.llm.map(PURPOSE, model=model, max_tokens=max_tokens, stop=STOP, out="purpose").compute()
    ours_seconds = time.perf_counter() - start
    per_module = ours.drop_duplicates("module").set_index("module")["purpose"]
    echo(f"  table.llm.map({PURPOSE!r}, out=\"purpose\"):")
    for module in [m for m in TABLE_MODULES if m in per_module][:6]:
        echo(f"  {module:<9} {per_module[module].strip()}")
    stats = usage.operators["map"]
    echo(f"\n  {stats['rows']} rows, {stats['distinct']} distinct prompts, {stats['executed']} model calls, "
         f"{ours_seconds:.1f} s")
    start = time.perf_counter()
    theirs = table.map_partitions(_plain_dask_map, model, max_tokens, meta=table._meta.assign(purpose="")).compute()
    theirs_seconds = time.perf_counter() - start
    same = theirs["purpose"].tolist() == ours["purpose"].tolist()
    echo(f"  the same map as a plain Dask map_partitions calling the model for every row: {theirs_seconds:.1f} s; "
         f"ddf.llm is {theirs_seconds / ours_seconds:.1f}x faster, same answers: {same}")
    return {"rows": len(selected), "operators": usage.operators, "map_seconds": ours_seconds,
            "plain_dask_map_seconds": theirs_seconds, "speedup_over_plain_dask": theirs_seconds / ours_seconds,
            "same_answers": same, "purposes": per_module.to_dict()}


def _plain_dask_map(part, model, max_tokens):
    """What a Dask user writes without daskllm: each row's chat prompt sent to the worker's engine."""
    engine = get_engine(model)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": PURPOSE.format(module=m)}],
                                                    tokenize=True, add_generation_prompt=True, return_dict=False)
               for m in part["module"]]
    params = SamplingParams(max_tokens=max_tokens, stop=STOP)
    completions = engine.generate([list(p) for p in prompts], params) if prompts else []
    return part.assign(purpose=[c.text for c in completions])


def run(model: str | None = None, n_workers: int = 2, n_questions: int = 12, max_tokens: int = 48,
        rows: int | None = None, dashboard_address: str = DASHBOARD_ADDRESS, keep_alive: float = 0.0,
        n_passages: int | None = None, echo=print) -> dict:
    model = model or config.get("model")
    recipe = models.RECIPES.get(model)
    if isinstance(recipe, models.ConvertedRecipe) and not any(r.name == model and r.path for r in models.list_recipes()):
        echo(f"Converting {model} from the {recipe.package} wheel's {recipe.gguf_file} (once; about 20 s) ...")
    start = time.perf_counter()
    models.resolve(model)
    echo(f"Starting a local Dask cluster: {n_workers} worker(s), each keeping {model} resident ...")
    with LocalLLMCluster(models=[model], n_workers=n_workers, dashboard_address=dashboard_address) as cluster, \
            Client(cluster) as client:
        startup = time.perf_counter() - start
        llm_page = cluster.dashboard_link.rsplit("/", 1)[0] + "/llm"
        echo(f"Cluster up in {startup:.1f} s. Dashboard: {cluster.dashboard_link} (LLM page: {llm_page})")
        summary = {"model": model, "workers": n_workers, "startup_seconds": startup,
                   "dashboard": cluster.dashboard_link}
        summary["qa"] = answer_questions(client, model, n_questions, max_tokens, n_passages, echo=echo)
        summary["table"] = table_job(model, max_tokens=min(max_tokens, 24), rows=rows, echo=echo)
        echo(f"\nDashboard: {cluster.dashboard_link}; the LLM page: {llm_page}")
        if keep_alive:
            echo(f"Keeping the cluster up for {keep_alive:.0f} s (Ctrl-C to stop) ...")
            try:
                time.sleep(keep_alive)
            except KeyboardInterrupt:
                pass
        return summary
