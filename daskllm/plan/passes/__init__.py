"""The graph-rewrite plugin: passes over the LLM IR, run on the client before lowering.

Each pass is one class with ``run(graph) -> graph``. The pass manager runs the passes named
in ``daskllm.rewrite.passes`` (dask config) in order; a computation can override them
(``node.compute(passes=[...])``, ``daskllm.compute(..., passes=...)``), and users can
register their own with :func:`register_pass`.

The graph is a networkx DiGraph of :class:`~daskllm.plan.ir.Node`; a pass reads the plan's
options and cluster view from :func:`~daskllm.plan.context.state`, records its decisions
about a node with :func:`~daskllm.plan.context.decide` (a typed
:class:`~daskllm.plan.context.NodePlan`) and what it did in ``state(graph).report``, which
:func:`daskllm.explain` prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import networkx as nx

from daskllm.plan.context import state
from daskllm.plan.passes.cache import ResultCache
from daskllm.plan.passes.cse import CommonSubexpressions
from daskllm.plan.passes.parts import SmallPlanParts
from daskllm.plan.passes.pipeline import DecodePipelining
from daskllm.plan.passes.prefix import SharedPrefixPrefill
from daskllm.plan.passes.prune import Prune
from daskllm.plan.passes.stage import StageSplit


class Pass(Protocol):
    name: str

    def run(self, graph: nx.DiGraph) -> nx.DiGraph: ...


REGISTRY: dict[str, type] = {
    "cse": CommonSubexpressions,
    "cache": ResultCache,
    "prune": Prune,
    "parts": SmallPlanParts,
    "prefix": SharedPrefixPrefill,
    "pipeline": DecodePipelining,
    "stage": StageSplit,
}


def register_pass(name: str, cls: type) -> None:
    """Make a pass usable by name in ``daskllm.rewrite.passes``."""
    if not callable(getattr(cls, "run", None)):
        raise TypeError(f"pass {name!r} must have a run(graph) -> graph method")
    REGISTRY[name] = cls


class PassManager:
    def __init__(self, passes: Iterable[str | Pass]):
        self.passes = []
        for p in passes:
            if isinstance(p, str):
                if p not in REGISTRY:
                    raise ValueError(f"unknown rewrite pass {p!r}; known: {sorted(REGISTRY)}")
                p = REGISTRY[p]()
            self.passes.append(p)

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        for p in self.passes:
            graph = p.run(graph)
            state(graph).applied.append(p.name)
        return graph


__all__ = ["REGISTRY", "Pass", "PassManager", "register_pass"]
