"""Result cache (Helium's prompt cache): a deterministic call computed before becomes a fetch.

Results of the requested outputs' deterministic calls (greedy, or sampled with a seed) are
remembered under their structural hash (:mod:`daskllm.worker.results`, handed to the planner
as ``PlanOptions.results``); a later identical call is lowered to its remembered value and
runs nowhere. Sampled calls without
a seed are never cached. Switch off with ``daskllm.rewrite.result-cache: false`` or by
leaving ``cache`` out of the passes.
"""

from __future__ import annotations

import networkx as nx

from daskllm.ops import cacheable
from daskllm.plan.context import decide, state
from daskllm.plan.items import hashes


class ResultCache:
    name = "cache"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        results = plan.options.results
        if results is None:  # nothing remembered here (e.g. planning without a result store)
            return graph
        hits = 0
        for node in graph:
            if not cacheable(node):
                continue
            found = tuple(results.get(h) for h in hashes(graph, node))
            if any(v is not None for v in found):
                decide(graph, node, cached=found)
                hits += sum(v is not None for v in found)
        plan.report["cache"] = {"hits": hits, "size": len(results)}
        return graph
