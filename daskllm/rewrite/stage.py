"""Stage decomposition (Teola): a big batched call is split into stages that pipeline.

A batched embed, search, rerank or generate larger than its engine's efficient batch is
cut into shards of that size, and a batch smaller than that into one shard per worker
holding its model (Halo's (operator, query shard) tasks: every engine gets work); each shard of a consumer depends only on the shards of its
producers that hold its inputs, so the first stage of the downstream op starts while
later stages of the upstream one still run. A consumer that needs everything depends on
all shards (the aggregate). Without this pass a batched node is one task.
"""

from __future__ import annotations

import networkx as nx

from daskllm import config


# The engine kind each op runs on (its model is in node.params["model"]).
KIND = {"generate": "llm", "embed": "embed", "rerank": "rerank"}


class StageSplit:
    name = "stage"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        from daskllm.worker import workers_holding

        sizes = config.get("rewrite.stage-size")
        holding = graph.graph.setdefault("holding", {})  # lowering asks the same (prefill replicas)
        split = {}
        for node in graph:
            size = sizes.get(node.op)
            if not (size and node.batched):
                continue
            size = int(size)
            if "model" in node.params and node.op in KIND:
                workers = workers_holding(node.params["model"], KIND[node.op], memo=holding)
                size = min(size, -(-node.width // workers))
            if node.width > size:
                graph.nodes[node]["shard_size"] = size
                split[node.label] = -(-node.width // size)
        graph.graph["report"]["stage"] = {"nodes_split": len(split), "stages": sum(split.values())}
        return graph
