"""Decode pipelining (Teola's partial decoding, Alto's streaming).

A split generation whose consumers work item by item (``pmap``, or embed / search /
rerank / generate given the stream, which build a pmap) is rewritten into a streamed
decode feeding per-item consumers: the decode sends each complete item through a queue and
the consumer starts that item's work at once, while the decode goes on.

Chains of pmaps (``search(idx, embed(stream))``) are fused into one pmap whose stages run
back to back for each item, so an item flows through the whole chain without waiting for
its siblings at each step; builder stages take the previous stage's node directly and an
item's whole chain is one graph.

Without this pass the same pipeline runs unstreamed: the decode finishes, then each pmap
runs over the complete list, one pmap after the other; the results are the same.
"""

from __future__ import annotations

import networkx as nx

from daskllm.graph.items import pmap_args
from daskllm.streaming import PmapSpec


def _on_cluster() -> bool:
    try:
        from distributed.client import _get_global_client
    except ImportError:
        return False
    return _get_global_client() is not None


class DecodePipelining:
    name = "pipeline"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        outputs = set(graph.graph["outputs"])
        fused = 0
        for node in list(nx.topological_sort(graph)):
            if node.op != "pmap":
                continue
            spec, args = graph.nodes[node].get("fused") or (node.value, pmap_args(node))
            source = graph.nodes[node].get("source", node.inputs["stream"])
            while (source.op == "pmap" and source not in outputs and list(graph.successors(source)) == [node]
                   and _compatible(source.value, spec)):
                inner, inner_args = graph.nodes[source].get("fused") or (source.value, pmap_args(source))
                spec = PmapSpec(inner.stages + spec.stages, spec.errors, spec.sticky, spec.ancestry)
                args = [*inner_args, *args]
                below = graph.nodes[source].get("source", source.inputs["stream"])
                graph.remove_node(source)
                graph.add_edges_from((n, node) for n in (below, *inner_args))
                source = below
                fused += 1
            graph.nodes[node].update(fused=(spec, args), source=source)
        streamed = 0
        if _on_cluster():  # queues need a cluster; computing locally, pmaps take the finished list
            for node in graph:
                if node.op == "pmap":
                    source = graph.nodes[node]["source"]
                    if source.op == "generate" and source.streaming:
                        graph.nodes[node]["streamed"] = True
                        streamed += 1
        graph.graph["report"]["pipeline"] = {"pmaps_fused": fused, "streamed": streamed}
        return graph


def _compatible(inner: PmapSpec, outer: PmapSpec) -> bool:
    return inner.errors == outer.errors and inner.sticky == outer.sticky
