"""Small plans as parts: no scheduler round trip between one LLM call and the next.

At a handful of questions no engine step is full, and a plan's cost is its hops: every
stage's calls wait for the scheduler to start their task after the previous stage's ends.
A plan of engine calls only (no index shard, no stream, no pmap) with at most
``parts-calls-per-worker`` calls per worker holding its models runs as parts instead: the
lowered tasks that share no task with each other (the stage pass's per-worker shards of
elementwise stages) each run whole inside one worker task, on that worker's engines
(:mod:`daskllm.worker.parts`), and the placement plugin spreads the parts over the workers.
Such a plan gets no prefill tasks either: one engine runs all of a part's calls, and its
prefix cache computes a prefix they share once.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

from daskllm.ops import engine_of
from daskllm.plan.context import state
from daskllm.plan.ir import Node

# What a task can compute in its own thread: no index shard, stream or other task's value to wait for.
LOCAL_OPS = frozenset({"const", "gather", "generate", "prefill", "embed", "rerank"})


def local_engines(nodes: Iterable[Node]) -> set[tuple[str, str]] | None:
    """The ``(kind, model)`` engines computing ``nodes`` takes; None where it takes more than
    engines (an op outside :data:`LOCAL_OPS`: an index shard, a stream)."""
    if any(node.op not in LOCAL_OPS for node in nodes):
        return None
    return {engine for node in nodes if (engine := engine_of(node)) is not None}


class SmallPlanParts:
    name = "parts"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        engines = local_engines(graph)
        if not (plan.view.on_cluster and engines):
            return graph
        calls = sum(node.n for node in graph if engine_of(node) is not None)
        workers = min(plan.view.holding(model, kind) for kind, model in engines)
        if calls <= plan.options.parts_calls_per_worker * workers:
            plan.as_parts = True
            plan.report["parts"] = {"calls": calls, "workers": workers}
        return graph
