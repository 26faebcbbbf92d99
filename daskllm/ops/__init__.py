"""The task-type registry: the one place that says what each operator of the IR is.

Each module declares one (or a few related) :class:`~daskllm.ops.base.TaskType`: its inputs,
the engine that serves it, how a node of it is lowered to Dask tasks, what placement learns
about those tasks (:class:`~daskllm.ops.base.TaskAnnotation`) and, through the task functions
of :mod:`daskllm.worker.execute` it lowers to, how a worker executes it. The builders
(:mod:`daskllm.api`), the planner and the runtime all read it.
"""

from __future__ import annotations

from daskllm.annotations import TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.collections import COLLECT, GATHER
from daskllm.ops.embed import EMBED
from daskllm.ops.generate import GENERATE
from daskllm.ops.pmap import PMAP
from daskllm.ops.prefill import PREFILL
from daskllm.ops.rerank import RERANK
from daskllm.ops.search import SEARCH
from daskllm.ops.values import CONST, DELAYED, PERSISTED
from daskllm.plan.ir import Node

REGISTRY: dict[str, TaskType] = {t.name: t for t in (CONST, DELAYED, PERSISTED, GENERATE, PREFILL, EMBED, SEARCH,
                                                      RERANK, PMAP, COLLECT, GATHER)}


def task_type(node_or_op: Node | str) -> TaskType:
    op = node_or_op.op if isinstance(node_or_op, Node) else node_or_op
    try:
        return REGISTRY[op]
    except KeyError:
        raise ValueError(f"unknown task type {op!r}; known: {sorted(REGISTRY)}") from None


def is_stream(value) -> bool:
    """A stream: a split generation or a pmap; builders given one work item by item."""
    return isinstance(value, Node) and task_type(value).is_stream(value)


def cacheable(node: Node) -> bool:
    """A node whose calls' results may be remembered: deterministic calls of a cacheable type."""
    return task_type(node).cacheable and node.params.get("cache", True) and not node.params.get("nonce")


def engine_of(node: Node) -> tuple[str, str] | None:
    """``(engine kind, model)`` serving a node's calls, or None."""
    kind = task_type(node).engine
    return (kind, node.params["model"]) if kind is not None else None


__all__ = ["REGISTRY", "Lowering", "TaskAnnotation", "TaskType", "cacheable", "engine_of", "is_stream", "task_type"]
