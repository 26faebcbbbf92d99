"""Common subexpression elimination (Helium): identical deterministic calls run once.

Every call has a structural hash over its operator, parameters and inputs (see
:mod:`daskllm.graph.items`), so identical calls are found item by item, across nodes and
across batches. This pass switches on the merge at lowering and counts what it merges. A
sampled call without a seed carries a unique nonce in its hash and is never merged.
"""

from __future__ import annotations

import networkx as nx

from daskllm.graph.items import hashes
from daskllm.graph.nodes import BATCHABLE_OPS, LLM_OPS


class CommonSubexpressions:
    name = "cse"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        graph.graph["cse"] = True
        calls = distinct = 0
        seen: set[str] = set()
        for node in graph:
            if node.op in BATCHABLE_OPS or node.op in LLM_OPS:
                for h in hashes(graph, node):
                    calls += 1
                    if h not in seen:
                        seen.add(h)
                        distinct += 1
        graph.graph["report"]["cse"] = {"calls": calls, "distinct": distinct, "merged": calls - distinct}
        return graph
