"""Reshaping ops: ``gather`` (a whole batch as one value) and ``collect`` (a stream's items as one list)."""

from __future__ import annotations

from dask._task_spec import Task

from daskllm.ops.base import Lowering, TaskType
from daskllm.plan.ir import Dyn, Node
from daskllm.worker.execute import assemble


def _gather_parts(graph, node: Node, i: int) -> list:
    source = node.inputs["items"]
    return [Dyn(source, j) for j in range(source.n)]


def _lower_gather(ctx: Lowering, node: Node) -> None:
    source = node.inputs["items"]
    key = f"gather-{node.hash}"
    spec, deps = ctx.resolve([[Dyn(source, i)] for i in range(source.n)])
    ctx.add(GATHER.name, key, Task(key, assemble, [p[0] for p in spec], *deps))
    ctx.loc[node] = [(key, None)]


def _lower_collect(ctx: Lowering, node: Node) -> None:
    ctx.loc[node] = ctx.loc[node.inputs["stream"]]


GATHER = TaskType("gather", _lower_gather, inputs=("items",), call_parts=_gather_parts)
COLLECT = TaskType("collect", _lower_collect, inputs=("stream",))
