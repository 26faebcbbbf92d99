"""Answer quality: does the model name the right standard-library module, with and without
retrieval, and does every plan daskllm can run give the same answers?

    python bench/quality.py                                  # smollm2, 48 generated + 16 how-to questions
    python bench/quality.py --questions 200 --json quality.json
    python bench/quality.py --model tiny --questions 4 --index-rows 200 --plans optimized,naive   # a smoke run

Questions: ``daskllm.datasets.load("stdlib-modules", n)`` (generated from the corpus: "Which
Python standard-library module has a function that does the following: <docstring sentence>")
and the 16 hand-written ``stdlib-howto`` questions. An answer is right when it names the module
(``daskllm.datasets.names_module``). With retrieval, each question is searched in a MiniLM/faiss
index of the corpus's passages sharded over the workers, and the model answers from the top
``k``; without, from the question alone. Retrieval recall (for the generated set: the question's
source row among the ``k`` passages) says how much of the accuracy retrieval could give.

Plans: ``optimized`` (every rewrite pass, cache-aware placement), ``naive`` (a task per call,
no passes, plain Dask placement), and ``optimized`` with each pass removed (``-cse``,
``-prefix``, ...) and with placement off (``-placement``). Each runs from cold caches. With
greedy decoding every plan must give the naive plan's answers token for token, hence the same
accuracy: the script exits with status 1 if one does not.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SYSTEM = ("You are a Python expert. Answer with the name of the Python standard-library module that the "
          "question is about, and nothing else.")
PASSAGE_CHARS = 240


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: daskllm.model (smollm2)")
    parser.add_argument("--questions", type=int, default=48, help="generated module questions (stdlib-modules)")
    parser.add_argument("--howto", type=int, default=16, help="hand-written questions (stdlib-howto, at most 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--index-rows", type=int, default=None,
                        help="index only this many corpus rows (the questions' source rows always)")
    parser.add_argument("--plans", default="all", help=f"comma-separated, or all: {', '.join(plan_names())}")
    parser.add_argument("--json", help="write every number and answer here")
    args = parser.parse_args(argv)
    names = plan_names() if args.plans == "all" else args.plans.split(",")
    unknown = [n for n in names if n not in plan_names()]
    if unknown:
        parser.error(f"unknown plans {unknown}; known: {plan_names()}")
    args.plan_list = ["naive", *[n for n in names if n != "naive"]]  # every plan is compared with naive
    if args.model is None:
        import daskllm

        args.model = daskllm.config.get("model")
    return args


def plan_names() -> list[str]:
    import daskllm

    return ["optimized", "naive", *[f"-{p}" for p in daskllm.config.get("rewrite.passes")], "-placement"]


def plan_settings(plan: str) -> tuple[dict, str]:
    """compute()'s settings and the placement policy of ``plan``."""
    import daskllm
    from pipelines.ops import NAIVE_HELD

    if plan == "naive":
        return dict(NAIVE_HELD), "off"
    if plan == "-placement":
        return {"result_cache": False}, "off"
    removed = plan.removeprefix("-")
    passes = [p for p in daskllm.config.get("rewrite.passes") if p != removed] if plan != "optimized" else None
    return {"passes": passes, "result_cache": False}, "cache_aware"


def accuracy(answers: list[str], modules: list[str]) -> float:
    """The share of answers that name their module."""
    from daskllm.datasets import names_module

    if len(answers) != len(modules):
        raise ValueError(f"{len(answers)} answers for {len(modules)} questions")
    return sum(map(names_module, answers, modules)) / len(modules) if modules else 0.0


def recall(hits: list[list], sources: list[int | None]) -> float | None:
    """The share of questions with a known source row whose row is among their hits."""
    known = [(row, source) for row, source in zip(hits, sources) if source is not None]
    return sum(source in [h.id for h in row] for row, source in known) / len(known) if known else None


def passages(index_rows: int | None, keep_ids, seed: int) -> tuple[list[str], list[int]]:
    """The corpus's passages ("qualname(signature): first sentence"), all or ``index_rows`` of them
    drawn at random but always with the rows in ``keep_ids``."""
    import random

    import pandas as pd

    from daskllm import datasets

    docs = datasets.load("stdlib-docs")
    if index_rows is not None and index_rows < len(docs):
        keep = docs["id"].isin(list(keep_ids))
        others = docs[~keep]
        extra = random.Random(seed).sample(range(len(others)), max(0, index_rows - int(keep.sum())))
        docs = pd.concat([docs[keep], others.iloc[extra]]).sort_values("id")
    texts = [f"{r.qualname}{r.signature or ''}: {r.first_sentence}"[:PASSAGE_CHARS] for r in docs.itertuples()]
    return texts, [int(i) for i in docs["id"]]


def questions(args) -> tuple[list[str], list[str], list[int | None], list[str]]:
    """Questions, their modules, their source rows (None for hand-written ones) and their set."""
    from daskllm import datasets

    generated = datasets.load("stdlib-modules", args.questions, seed=args.seed)
    howto = datasets.load("stdlib-howto", min(args.howto, len(datasets.HOWTO)))
    return ([*generated["question"], *howto["question"]], [*generated["answer"], *howto["answer"]],
            [*map(int, generated["id"]), *[None] * len(howto)],
            ["stdlib-modules"] * len(generated) + ["stdlib-howto"] * len(howto))


def by_set(answers, modules, sets) -> dict[str, float]:
    out = {}
    for name in dict.fromkeys(sets):
        picked = [i for i, s in enumerate(sets) if s == name]
        out[name] = accuracy([answers[i] for i in picked], [modules[i] for i in picked])
    out["all"] = accuracy(answers, modules)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import daskllm
    from daskllm.cluster import LocalLLMCluster
    from daskllm.demo import answer_graph
    from daskllm.placement import set_policy
    from daskllm.runtime.control import cold_start
    from distributed import Client

    asked, modules, sources, sets = questions(args)
    texts, ids = passages(args.index_rows, {s for s in sources if s is not None}, args.seed)
    report = {"model": args.model, "questions": {s: sets.count(s) for s in dict.fromkeys(sets)}, "k": args.k,
              "max_tokens": args.max_tokens, "passages": len(texts), "workers": args.workers,
              "command": "python bench/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(f"{len(asked)} questions ({report['questions']}), {len(texts):,} passages, model {args.model}, "
          f"k={args.k}, max_tokens={args.max_tokens}", flush=True)
    with LocalLLMCluster(models=[args.model], rerankers=(), n_workers=args.workers, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        start = time.perf_counter()
        index = daskllm.ShardedIndex.from_texts(client, "quality-stdlib", texts, ids=ids)
        report["index_seconds"] = time.perf_counter() - start
        hits, with_docs, without = answer_graph(index, asked, args.model, system=SYSTEM, k=args.k,
                                                max_tokens=args.max_tokens)

        cold_start(client)
        plain = daskllm.compute(without, result_cache=False)[0]
        report["accuracy_without_retrieval"] = by_set(plain, modules, sets)

        answers, seconds = {}, {}
        for plan in args.plan_list:
            settings, policy = plan_settings(plan)
            set_policy(client, policy)
            cold_start(client)
            start = time.perf_counter()
            found, answers[plan] = daskllm.compute(hits, with_docs, **settings)
            seconds[plan] = time.perf_counter() - start
            if plan == "naive":
                report["retrieval_recall"] = recall(found, sources)
            print(f"  {plan:<12} {seconds[plan]:6.1f} s  accuracy {by_set(answers[plan], modules, sets)['all']:.3f}",
                  flush=True)
        set_policy(client, "cache_aware")
        index.drop()

    naive = answers["naive"]
    report["accuracy_with_retrieval"] = by_set(naive, modules, sets)
    report["plans"] = {plan: {"seconds": seconds[plan], "accuracy": by_set(answers[plan], modules, sets)["all"],
                              "same_answers_as_naive": answers[plan] == naive} for plan in args.plan_list}
    report["examples"] = [{"question": q, "module": m, "with_retrieval": a, "without_retrieval": p}
                          for q, m, a, p in zip(asked, modules, naive, plain)]
    print(f"\naccuracy (answer names the module)   with retrieval   without")
    for name in report["accuracy_with_retrieval"]:
        print(f"  {name:<36} {report['accuracy_with_retrieval'][name]:>14.3f}   {report['accuracy_without_retrieval'][name]:.3f}")
    if report.get("retrieval_recall") is not None:
        print(f"retrieval recall@{args.k} (generated questions' source row among the passages): "
              f"{report['retrieval_recall']:.3f}")
    differing = [plan for plan, r in report["plans"].items() if not r["same_answers_as_naive"]]
    print(f"every plan gives the naive plan's answers: {not differing}" + (f" (differ: {differing})" if differing else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
