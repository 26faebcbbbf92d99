"""Planning: build -> rewrite passes -> lowering, a pure function of its inputs."""

from __future__ import annotations

import networkx as nx

from daskllm.plan import collector
from daskllm.plan.context import ClusterView, PlanOptions, PlanState, state
from daskllm.plan.ir import Node
from daskllm.plan.lower import Lowered, lower
from daskllm.plan.parts import as_parts
from daskllm.plan.passes import PassManager


def build(outputs: list[Node], options: PlanOptions, view: ClusterView) -> nx.DiGraph:
    """The IR graph of everything ``outputs`` need."""
    graph = nx.DiGraph(state=PlanState(list(outputs), options, view))
    stack = list(outputs)
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        graph.add_node(node)
        for producer in node.inputs.values():
            graph.add_edge(producer, node)
            stack.append(producer)
    _check_acyclic(graph)
    return graph


@collector.paused()
def optimize(outputs: list[Node], options: PlanOptions, view: ClusterView) -> nx.DiGraph:
    """The IR graph of ``outputs`` with the options' passes applied."""
    graph = PassManager(options.passes).run(build(outputs, options, view))
    _check_acyclic(graph)  # a user pass may have added edges
    return graph


def plan(outputs: list[Node], options: PlanOptions, view: ClusterView) -> Lowered:
    """Plan and lower ``outputs`` together (as parts, where the parts pass decided so)."""
    graph = optimize(outputs, options, view)
    lowered = lower(graph)
    return as_parts(lowered) if state(graph).as_parts else lowered


def _check_acyclic(graph: nx.DiGraph) -> None:
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise ValueError(f"the graph has a cycle through {cycle[0][0].label}")
