"""Stage decomposition (Teola): a big batched call is split into stages that pipeline.

A batched embed, search, rerank or generate larger than its engine's efficient batch is
cut into shards of that size; each shard of a consumer depends only on the shards of its
producers that hold its inputs, so the first stage of the downstream op starts while
later stages of the upstream one still run. A consumer that needs everything depends on
all shards (the aggregate). Without this pass a batched node is one task.
"""

from __future__ import annotations

import networkx as nx

from daskllm import config


class StageSplit:
    name = "stage"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        sizes = config.get("rewrite.stage-size")
        split = {}
        for node in graph:
            size = sizes.get(node.op)
            if size and node.batched and node.width > size:
                graph.nodes[node]["shard_size"] = int(size)
                split[node.label] = -(-node.width // int(size))
        graph.graph["report"]["stage"] = {"nodes_split": len(split), "stages": sum(split.values())}
        return graph
