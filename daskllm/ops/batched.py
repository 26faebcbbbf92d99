"""Lowering shared by the batchable calls: each shard of distinct calls is one task."""

from __future__ import annotations

from collections.abc import Callable

from daskllm.annotations import TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.plan.ir import Node
from daskllm.worker.failures import Origins


def each_shard(ctx: Lowering, node: Node, lower_shard: Callable) -> None:
    """``lower_shard(entries)`` for each shard of a node's distinct calls (node, call)."""
    todo, item_hashes = ctx.todo(node)
    for shard in ctx.shards(node, todo):
        lower_shard([(node, i) for i in shard])
    ctx.fill_duplicates(node, item_hashes)


def each_fused_shard(ctx: Lowering, nodes: list[Node], lower_shard: Callable) -> None:
    """:func:`each_shard` for nodes the stage pass consolidated: their calls share shards."""
    entries, hashes = ctx.group_todo(nodes)
    for shard in ctx.group_shards(nodes, entries):
        lower_shard(shard)
    for node in nodes:
        ctx.fill_duplicates(node, hashes[node])


def origins(entries: list[tuple[Node, int]]) -> Origins:
    """Where a task's calls (node, call) come from, for their errors: the builder, each call's
    index in its node's batch, and the nodes' ``on_error`` (nodes sharing a task share it)."""
    node = entries[0][0]
    return Origins(node.op, tuple(i if n.batched else None for n, i in entries), on_error(node))


def on_error(node: Node) -> str:
    """What a failed call of ``node`` becomes: raise (the default, kept out of its params) or null."""
    return node.params.get("on_error", "raise")


def lower_shards(ctx: Lowering, node: Node, kind: TaskType, fn: Callable, *params) -> None:
    """One ``fn(key, *params, origins, calls, *deps)`` task of type ``kind`` per shard; ``params[0]`` is the model."""
    each_shard(ctx, node, lambda entries: _task(ctx, entries, kind, fn, params))


def lower_fused_shards(ctx: Lowering, nodes: list[Node], kind: TaskType, fn: Callable, *params) -> None:
    """:func:`lower_shards` for nodes the stage pass consolidated: their calls share tasks."""
    each_fused_shard(ctx, nodes, lambda entries: _task(ctx, entries, kind, fn, params))


def _task(ctx: Lowering, entries: list[tuple[Node, int]], kind: TaskType, fn: Callable, params: tuple) -> None:
    task = kind.name
    key = f"{task}-{ctx.entries_token(entries)}"
    resolved, deps = ctx.resolve([ctx.calls(node)[i] for node, i in entries])
    args = [r[0] if len(r) == 1 else tuple(r) for r in resolved]
    ctx.add(task, key, ctx.engine_task(key, fn, key, *params, origins(entries), args, *deps),
            TaskAnnotation(op=task, engine=kind.engine, model=params[0], shard=len(entries)))
    ctx.place_calls(entries, key)


def model_key(graph, node: Node) -> tuple:
    """Calls of nodes with the same params (model, k) may share a task."""
    return tuple(sorted(node.params.items()))
