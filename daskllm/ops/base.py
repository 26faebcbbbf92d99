"""What a task type is: the typed record every op module declares, and the annotation placement reads.

An op module (:mod:`daskllm.ops.generate`, ``prefill``, ``embed``, ``search``, ``rerank``,
``pmap``, ...) declares one :class:`TaskType`: its inputs, which engine serves it, how one
node of it is lowered to Dask tasks (against a :class:`Lowering`, the planner's side of the
contract) and, through the task functions it lowers to, how a worker executes it. Each
lowered task that placement should see carries a :class:`~daskllm.annotations.TaskAnnotation`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import networkx as nx

from daskllm.annotations import TaskAnnotation
from daskllm.plan.ir import Node


# Where a call's value is, when it is not a task's output: the value itself, inline in the
# consumer's task (a constant, or a result the cache pass found).
INLINE = "inline"


class Lowering(Protocol):
    """The planner's lowering state, as op modules use it (:class:`daskllm.plan.lower.Lowering`)."""

    graph: nx.DiGraph
    loc: dict  # node -> per call: (INLINE, value) | (task key, position in its output)
    options: Any  # PlanOptions
    dedupe: bool  # identical calls are one physical call (CSE)
    view: Any  # ClusterView
    memo: dict  # op modules' own per-plan state, by name

    def calls(self, node: Node) -> list: ...

    def call_hashes(self, node: Node) -> list[str]: ...

    def todo(self, node: Node) -> tuple[list[int], list[str]]: ...

    def shards(self, node: Node, todo: list[int]) -> list[list[int]]: ...

    def token(self, node: Node, item_hashes: list[str], shard: list[int], *extra) -> str: ...

    def resolve(self, parts_lists: list[list]) -> tuple[list, list]: ...

    def add(self, layer: str, key: str, task, annotation: TaskAnnotation | None = None, *,
            pin: str | None = None) -> None: ...

    def engine_task(self, key: str, fn, *args, store: bool = True): ...  # a Task that secedes while it waits on its engine

    def place(self, node: Node, item_hashes: list[str], shard: list[int], key: str) -> None: ...

    def place_calls(self, entries: list[tuple[Node, int]], key: str) -> None: ...

    def entries_token(self, entries: list[tuple[Node, int]], *extra) -> str: ...

    def group_todo(self, nodes: list[Node]) -> tuple[list[tuple[Node, int]], dict[Node, list[str]]]: ...

    def group_shards(self, nodes: list[Node], entries: list) -> list[list]: ...

    def fill_duplicates(self, node: Node, item_hashes: list[str]) -> None: ...

    def prefix_hashes(self, tokens: tuple[int, ...]) -> tuple[str, ...]: ...

    def count_requested(self, op: str, n: int) -> None: ...

    def add_graph(self, graph) -> None: ...


@dataclass(frozen=True)
class TaskType:
    """One operator of the IR: everything the builders, the passes, lowering, placement and
    the workers need to know about it, declared in one place.

    ``inputs``: its input names, in the order of a call's parts. ``engine``: the engine kind
    whose ``model`` param serves it (None: no engine). ``calls``: one node makes one call per
    batch item (CSE, the result cache and sharding apply to them). ``prompted``: its calls are
    prompts (tokenized, prefix-shared). ``cacheable``: deterministic calls may be remembered.
    ``lower(lowering, node)`` adds its tasks (``lower_fused(lowering, nodes)``, if set, those of
    nodes the stage pass consolidated into shared tasks: small nodes of one depth with the same
    ``group_key(graph, node)``); ``call_parts(graph, node, i)``, if set, gives
    call i's parts where they are not simply its inputs in order; ``value_hashes(node)``, for a
    value node, the structural hash of each of its items.
    """

    name: str
    lower: Callable[[Lowering, Node], None]
    inputs: tuple[str, ...] = ()
    engine: str | None = None
    calls: bool = False
    prompted: bool = False
    cacheable: bool = False
    call_parts: Callable | None = field(default=None, compare=False)
    lower_fused: Callable | None = field(default=None, compare=False)  # (lowering, nodes): nodes sharing tasks
    group_key: Callable | None = field(default=None, compare=False)  # (graph, node): what nodes sharing tasks share
    value_hashes: Callable[[Node], list[str]] | None = field(default=None, compare=False)
    is_stream: Callable[[Node], bool] = field(default=lambda node: False, compare=False)
