"""What a task type is: the typed record every op module declares, and the annotation placement reads.

An op module (:mod:`daskllm.ops.generate`, ``prefill``, ``embed``, ``search``, ``rerank``,
``pmap``, ...) declares one :class:`TaskType`: its inputs, which engine serves it, how one
node of it is lowered to Dask tasks (against a :class:`Lowering`, the planner's side of the
contract) and, through the task functions it lowers to, how a worker executes it. Each
lowered task that placement should see carries a :class:`TaskAnnotation`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import networkx as nx

from daskllm.plan.ir import Node


@dataclass(frozen=True, slots=True)
class TaskAnnotation:
    """What placement knows about one lowered task (ARCHITECTURE.md's contract).

    ``op``: the lowered task type (prefill, decode, embed, search, rerank); ``engine``: the
    engine kind that runs it (llm, embed, rerank), or None for a task pinned by data (an
    index shard); ``prefix``: the hex block-hash chain of the prompt prefix the task's calls
    share; ``prompt_tokens``/``max_tokens``: its work estimate; ``shard``: calls in the task.
    It travels as a plain dict (msgpack) in the graph's ``daskllm`` annotation.
    """

    op: str
    engine: str | None = None
    model: str | None = None
    prefix: tuple[str, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0
    shard: int = 1
    index: str | None = None
    index_shard: int | None = None

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["prefix"] = list(self.prefix)
        return out

    @classmethod
    def from_dict(cls, value) -> TaskAnnotation:
        """Parse an annotation from the wire; ValueError naming the field if it is malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"an annotation is a dict, got {type(value).__name__}")
        unknown = set(value) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"unknown annotation fields {sorted(unknown)}")
        if not isinstance(value.get("op"), str):
            raise ValueError(f"annotation field 'op' must be a str, got {value.get('op')!r}")
        for name in ("engine", "model", "index"):
            if value.get(name) is not None and not isinstance(value[name], str):
                raise ValueError(f"annotation field {name!r} must be a str, got {value[name]!r}")
        if value.get("engine") is not None and not isinstance(value.get("model"), str):
            raise ValueError("an annotation with an engine must name its model")
        for name in ("prompt_tokens", "max_tokens", "shard"):
            if not isinstance(value.get(name, 0), int) or isinstance(value.get(name), bool):
                raise ValueError(f"annotation field {name!r} must be an int, got {value.get(name)!r}")
        prefix = value.get("prefix", [])
        if not isinstance(prefix, (list, tuple)) or not all(isinstance(h, str) for h in prefix):
            raise ValueError(f"annotation field 'prefix' must be a list of str, got {prefix!r:.80}")
        return cls(**{**value, "prefix": tuple(prefix)})


class Lowering(Protocol):
    """The planner's lowering state, as op modules use it (:class:`daskllm.plan.lower.Lowering`)."""

    graph: nx.DiGraph
    loc: dict  # node -> per call: ("const", value) | (task key, position in its output)
    options: Any  # PlanOptions
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

    def place(self, node: Node, item_hashes: list[str], shard: list[int], key: str) -> None: ...

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
    ``value``: the node holds a value rather than computing one (const, delayed, persisted).
    ``lower(lowering, node)`` adds its tasks; ``call_parts(graph, node, i)``, if set, gives
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
    value: bool = False
    call_parts: Callable | None = field(default=None, compare=False)
    value_hashes: Callable[[Node], list[str]] | None = field(default=None, compare=False)
    is_stream: Callable[[Node], bool] = field(default=lambda node: False, compare=False)
