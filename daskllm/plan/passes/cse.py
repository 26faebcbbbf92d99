"""Common subexpression elimination (Helium): identical deterministic calls run once.

Every call has a structural hash over its operator, parameters and inputs (see
:mod:`daskllm.plan.items`), so identical calls are found item by item, across nodes and
across batches. This pass switches on the merge at lowering and counts what it merges. A
sampled call without a seed carries a unique nonce in its hash and is never merged.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import task_type
from daskllm.plan.context import state
from daskllm.plan.items import hashes


class CommonSubexpressions:
    name = "cse"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        plan.dedupe = True
        calls = distinct = 0
        seen: set[str] = set()
        for node in graph:
            if task_type(node).calls:
                for h in hashes(graph, node):
                    calls += 1
                    if h not in seen:
                        seen.add(h)
                        distinct += 1
        plan.report["cse"] = {"calls": calls, "distinct": distinct, "merged": calls - distinct}
        return graph
