"""Stage decomposition (Teola): a big batched call is split into stages that pipeline.

A batched embed, search, rerank or generate larger than its engine's efficient batch is
cut into shards of that size, and a batch smaller than that into one shard per worker
holding its model (Halo's (operator, query shard) tasks: every engine gets work); each
shard of a consumer depends only on the shards of its producers that hold its inputs, so the first stage of the downstream op starts while
later stages of the upstream one still run. A consumer that needs everything depends on
all shards (the aggregate). Without this pass a batched node is one task.

Consolidation (Halo's (operator, query shard) tasks across queries): small nodes at the
same depth of the graph with the same op and what their calls must share to share a task
(a generate's model, sampling parameters, split and shared prefixes; an embed's or rerank's
model; a search's index), such as the per-query calls of a pmap's items planned together,
are lowered as one batch: their calls share shard tasks (a depth, the longest path from the
graph's sources, never holds two nodes of which one needs the other). Many small nodes
become a few tasks instead of one to four each. Small pmaps built by the same code for
different items (a per-query ``each`` inside per-query work, or the per-item consumers of
those decodes' streams) share consumer tasks the same way: one per shard of finished lists,
one per decode task for streamed calls.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import engine_of, task_type
from daskllm.plan.context import decide, depths, state


class StageSplit:
    name = "stage"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        sizes = plan.options.stage_sizes()
        split = {}
        for node in graph:
            size = sizes.get(node.op)
            if not (size and node.batched):
                continue
            engine = engine_of(node)
            if engine is not None:
                kind, model = engine
                size = min(size, -(-node.width // plan.view.holding(model, kind)))
            if node.width > size:
                decide(graph, node, shard_size=size)
                split[node.label] = -(-node.width // size)
        # Parts (the parts pass): one engine batches a part's calls anyway, and tasks shared
        # across nodes would only join the parts of different workers into one.
        fused = 0 if plan.as_parts else _consolidate(graph, sizes)
        plan.report["stage"] = {"nodes_split": len(split), "stages": sum(split.values()), "nodes_fused": fused}
        return graph


def _consolidate(graph: nx.DiGraph, sizes: dict[str, int]) -> int:
    """Group small nodes (fewer calls than their op's stage size) by depth, op and their task
    type's ``group_key`` (what calls must have in common to share a task: a generate's model,
    sampling, split and shared prefixes; a pmap's base spec, the same stages built by the same
    code for different items; an embed's or rerank's model; a search's index); record groups
    of two or more and their shard size."""
    plan = state(graph)
    depth = depths(graph)
    groups: dict[tuple, list] = {}
    for node in depth:
        kind, size = task_type(node), sizes.get(node.op)
        if kind.group_key is None or not size or node.n >= size:
            continue
        key = (depth[node], node.op, kind.group_key(graph, node))
        try:
            groups.setdefault(key, []).append(node)
        except TypeError:  # a key holding an unhashable value (from user data): that node keeps its own tasks
            continue
    fused = 0
    for number, nodes in enumerate(groups.values()):
        if len(nodes) < 2:
            continue
        size = sizes[nodes[0].op]
        if (engine := engine_of(nodes[0])) is not None:  # a shard per worker holding the model, at most
            size = min(size, -(-sum(n.n for n in nodes) // plan.view.holding(engine[1], engine[0])))
        for node in nodes:
            decide(graph, node, fused=(number, size))
        fused += len(nodes)
    return fused
