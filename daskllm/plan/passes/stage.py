"""Stage decomposition (Teola): a big batched call is split into stages that pipeline.

A batched embed, search, rerank or generate larger than its engine's efficient batch is
cut into shards of that size, and a batch smaller than that into one shard per worker
holding its model (Halo's (operator, query shard) tasks: every engine gets work); each
shard of a consumer depends only on the shards of its producers that hold its inputs, so the first stage of the downstream op starts while
later stages of the upstream one still run. A consumer that needs everything depends on
all shards (the aggregate). Without this pass a batched node is one task.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import engine_of
from daskllm.plan.context import decide, state


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
        plan.report["stage"] = {"nodes_split": len(split), "stages": sum(split.values())}
        return graph
