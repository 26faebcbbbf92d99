"""Decode pipelining (Teola's partial decoding, Alto's streaming).

A split generation whose consumers work item by item (``pmap``, or embed / search /
rerank / generate given the stream, which build a pmap) is rewritten into a streamed
decode feeding per-item consumers: the decode sends each complete item through a queue and
the consumer starts that item's work at once, while the decode goes on.

Chains of pmaps (``search(idx, embed(stream))``) are fused into one pmap whose stages run
back to back for each item, so an item flows through the whole chain without waiting for
its siblings at each step; builder stages take the previous stage's node directly and an
item's whole chain is one graph.

A decode that would finish within ``daskllm.rewrite.stream-min-seconds`` is not streamed
(:func:`_pays`). Without this pass the same pipeline runs unstreamed: the decode finishes,
then each pmap runs over the complete list, one pmap after the other; the results are the same.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import generate as generate_op
from daskllm.ops import pmap as pmap_op
from daskllm.plan.context import decide, state
from daskllm.streaming.stages import PmapSpec


class DecodePipelining:
    name = "pipeline"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        outputs = set(plan.outputs)
        fused = 0
        for node in list(nx.topological_sort(graph)):
            if not pmap_op.is_pmap(node):
                continue
            spec, args = pmap_op.spec_and_args(graph, node)
            source = pmap_op.source(graph, node)
            while (pmap_op.is_pmap(source) and source not in outputs and list(graph.successors(source)) == [node]
                   and _compatible(source.value, spec)):
                inner, inner_args = pmap_op.spec_and_args(graph, source)
                spec = PmapSpec(inner.stages + spec.stages, spec.errors, spec.sticky, spec.ancestry)
                args = [*inner_args, *args]
                below = pmap_op.source(graph, source)
                graph.remove_node(source)
                graph.add_edges_from((n, node) for n in (below, *inner_args))
                source = below
                fused += 1
            decide(graph, node, spec=spec, args=tuple(args), source=source)
        streamed = short = 0
        if plan.view.on_cluster:  # queues need a cluster; computing locally, pmaps take the finished list
            for node in graph:
                source = pmap_op.source(graph, node) if pmap_op.is_pmap(node) else None
                if source is None or not generate_op.is_split(source):
                    continue
                if _pays(plan, source):
                    decide(graph, node, streamed=True)
                    streamed += 1
                else:
                    short += 1
        plan.report["pipeline"] = {"pmaps_fused": fused, "streamed": streamed, "short_decodes": short}
        return graph


def _pays(plan, source) -> bool:
    """Streaming overlaps a decode's later items with the work of its first ones, and costs
    its consumers a round of nested planning and submission per batch of items that arrive.
    A decode shorter than ``stream-min-seconds`` at best (its ``max_tokens`` at its holders'
    fastest measured decode step) gives that overlap too little to pay; one not measured
    yet streams."""
    expected = plan.view.decode_seconds(source.params["model"], source.params["sampling"].max_tokens)
    return expected is None or expected >= plan.options.stream_min_seconds


def _compatible(inner: PmapSpec, outer: PmapSpec) -> bool:
    return inner.errors == outer.errors and inner.sticky == outer.sticky
