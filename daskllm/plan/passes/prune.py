"""Dependency pruning (Teola): drop work no requested output needs, and edges that carry no data.

An input that no slot of a node's prompt reads is not a dependency; a node whose every
call is served by the result cache does not need its inputs; anything left that no
output depends on is removed, so independent branches run in parallel and unneeded ones
not at all.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import task_type
from daskllm.plan.context import decision, state
from daskllm.prompts import Slot


class Prune:
    name = "prune"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        edges = 0
        for node in list(graph):
            if task_type(node).prompted and node.template is not None:
                used = {s.name for s in node.template if isinstance(s, Slot)}
                for name, producer in node.inputs.items():
                    if name not in used and graph.has_edge(producer, node):
                        graph.remove_edge(producer, node)
                        edges += 1
            cached = decision(graph, node).cached
            if cached is not None and all(c is not None for c in cached):
                for producer in list(graph.predecessors(node)):
                    graph.remove_edge(producer, node)
                    edges += 1
        needed: set = set()
        for out in state(graph).outputs:
            needed |= nx.ancestors(graph, out) | {out}
        removed = [n for n in graph if n not in needed]
        graph.remove_nodes_from(removed)
        state(graph).report["prune"] = {"nodes_removed": len(removed), "edges_removed": edges}
        return graph
