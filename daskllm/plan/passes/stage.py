"""Stage decomposition (Teola): a big batched call is split into stages that pipeline.

A batched embed, search, rerank or generate larger than its engine's efficient batch is
cut into shards of that size, and a batch smaller than that into one shard per worker
holding its model (Halo's (operator, query shard) tasks: every engine gets work); each
shard of a consumer depends only on the shards of its producers that hold its inputs, so the first stage of the downstream op starts while
later stages of the upstream one still run. A consumer that needs everything depends on
all shards (the aggregate). Without this pass a batched node is one task.

Consolidation (Halo's (operator, query shard) tasks across queries): small generate nodes
at the same depth of the graph with the same model, sampling parameters, split and shared
prefixes, such as the per-query calls of a pmap's items planned together, are lowered as one
batch: their calls share shard tasks (a depth, the longest path from the graph's sources,
never holds two nodes of which one needs the other). Many small nodes become a few tasks
instead of one or two each. Small pmaps built by the same code for different items (a
per-query ``each`` inside per-query work, or the per-item consumers of those decodes'
streams) share consumer tasks the same way: one per shard of finished lists, one per decode
task for streamed calls.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import engine_of
from daskllm.ops import generate as generate_op
from daskllm.ops import pmap as pmap_op
from daskllm.ops import prefill as prefill_op
from daskllm.plan.context import decide, decision, depths, state


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
        fused = _consolidate(graph, sizes.get("generate"), sizes.get("pmap"))
        plan.report["stage"] = {"nodes_split": len(split), "stages": sum(split.values()), "nodes_fused": fused}
        return graph


def _consolidate(graph: nx.DiGraph, generate_size: int | None, pmap_size: int | None) -> int:
    """Group small nodes by depth and by what lets them share tasks; record groups of two or more.

    ``generate`` (fewer calls than a shard): by model, sampling, split and the shared
    prefixes their calls wait for (so a shared task's calls find one prefix on one worker).
    ``pmap``: by base spec (the same stages, errors and stickiness: built by the same code for
    different items), so one consumer runs many per-item pmaps' calls.
    """
    plan = state(graph)
    depth = depths(graph)
    groups: dict[tuple, list] = {}
    for node in depth:
        if generate_size and node.op == generate_op.GENERATE.name and node.n < generate_size:
            shared = frozenset(p for p in decision(graph, node).prefills or () if p is not None
                               and not prefill_op.is_partial(p))
            model = node.params["model"]
            split = node.params.get("split")
            key = (depth[node], model, node.params["sampling"], split and split.fingerprint, shared)
            size = lambda calls, model=model: min(generate_size, -(-calls // plan.view.holding(model)))
        elif pmap_size and pmap_op.is_pmap(node) and node.n < pmap_size:
            key = (depth[node], pmap_op.base_spec(graph, node))
            size = lambda calls: pmap_size
        else:
            continue
        groups.setdefault(key, (size, []))[1].append(node)
    fused = 0
    for number, (size, nodes) in enumerate(groups.values()):
        if len(nodes) < 2:
            continue
        group_size = size(sum(n.n for n in nodes))
        for node in nodes:
            decide(graph, node, fused=(number, group_size))
        fused += len(nodes)
    return fused
