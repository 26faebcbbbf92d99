"""A lowered plan as parts (the ``parts`` pass decided it): its tasks grouped so that no two
groups share a task, each group one worker task running it whole (:mod:`daskllm.worker.parts`).

The tasks holding the requested nodes' values stay ordinary tasks: they only assemble a
node's calls, and leaving them out is what lets the per-worker shards of each stage fall
into separate parts. Every task that reads a part's value gets a key of its own, so a plan
run as parts never shares a key (with another spec) with the same nodes planned otherwise.
"""

from __future__ import annotations

import dataclasses

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from daskllm.ops import engine_of
from daskllm.plan.ir import stable_hash
from daskllm.plan.lower import Lowered
from daskllm.worker.parts import Part, pick, run_part

SUFFIX = "-part"


def as_parts(lowered: Lowered) -> Lowered:
    """``lowered`` with its inner tasks run as parts; outputs and what to remember unchanged in meaning."""
    graph = dict(lowered.graph)
    outputs = dict.fromkeys(lowered.outputs.values())
    inner = {k: t for k, t in graph.items() if k not in outputs}
    needed = list(dict.fromkeys(d for o in outputs for d in graph[o].dependencies if d in inner))
    run, picks, annotations = {}, {}, {}
    for part in parts_of(lowered, inner, needed):
        part_key = f"daskllm-part-{stable_hash(sorted(map(str, part.graph)))[:16]}"
        run[part_key] = Task(part_key, run_part, part)
        annotations[part_key] = part.annotation()
        for i, key in enumerate(part.keys):
            picks[_renamed(key)] = Task(_renamed(key), pick, TaskRef(part_key), i)
    subs = {k: _renamed(k) for k in needed}
    assembled = {_renamed(o): graph[o].substitute(subs, key=_renamed(o)) for o in outputs}
    names = {name: f"daskllm-{name}-{stable_hash(sorted(map(str, layer)))[:8]}"
             for name, layer in (("part", run), ("pick", picks), ("output", assembled))}
    layers = {names["part"]: MaterializedLayer(run, {"daskllm": annotations.get}),
              names["pick"]: MaterializedLayer(picks), names["output"]: MaterializedLayer(assembled)}
    dependencies = {names["part"]: set(), names["pick"]: {names["part"]}, names["output"]: {names["pick"]}}
    return dataclasses.replace(
        lowered, graph=HighLevelGraph(layers, dependencies),
        outputs={node: _renamed(key) for node, key in lowered.outputs.items()},
        report={**lowered.report, "parts": {**lowered.report.get("parts", {}), "tasks": len(run)}},
        annotations=annotations, in_parts=tuple(inner))


def parts_of(lowered: Lowered, graph: dict, outputs: list) -> list[Part]:
    """The tasks of ``graph`` (some of ``lowered``'s) that ``outputs`` need, as parts sharing no
    task, each with the plan's engines, its calls' token work and the prefix its largest group
    of calls shares (from their annotations)."""
    engines = frozenset(e for n in lowered.plan if (e := engine_of(n)) is not None)
    annotations = lowered.annotations
    work = {k: int(a.get("prompt_tokens", 0)) + int(a.get("max_tokens", 0)) for k, a in annotations.items()}
    parts = []
    for keys, tasks in independent(graph, outputs):
        prefix, calls = shared_prefix([annotations[k] for k in tasks if k in annotations])
        parts.append(Part({k: graph[k] for k in tasks}, keys, engines, sum(work.get(k, 0) for k in tasks),
                          prefix, calls))
    return parts


def shared_prefix(annotations: list[dict]) -> tuple[tuple[str, ...], int]:
    """The prefix chain that saves the most tokens among the tasks' own (calls x blocks), and its calls."""
    best = max((a for a in annotations if a.get("prefix")),
               key=lambda a: (int(a.get("shard", 1)) * len(a["prefix"]), a["prefix"]), default=None)
    return (tuple(best["prefix"]), int(best.get("shard", 1))) if best else ((), 1)


def independent(graph: dict, outputs: list) -> list[tuple[list, set]]:
    """``outputs`` grouped so that no two groups share a task: ``(keys, their tasks)`` each."""
    groups: list[tuple[list, set]] = []
    for key in outputs:
        tasks, todo = set(), [key]
        while todo:
            k = todo.pop()
            if k in tasks or k not in graph:
                continue
            tasks.add(k)
            todo.extend(getattr(graph[k], "dependencies", ()))
        joined = [g for g in groups if g[1] & tasks]
        for g in joined:
            groups.remove(g)
        groups.append(([k for g in joined for k in g[0]] + [key], set().union(tasks, *(g[1] for g in joined))))
    return groups


def _renamed(key) -> str:
    return f"{key}{SUFFIX}"
