"""Lowering shared by the batchable calls: each shard of distinct calls is one task."""

from __future__ import annotations

from collections.abc import Callable


from daskllm.annotations import TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.plan.ir import Node


def lower_shards(ctx: Lowering, node: Node, kind: TaskType, fn: Callable, *params) -> None:
    """One ``fn(key, *params, calls, *deps)`` task of type ``kind`` per shard; ``params[0]`` is the model."""
    task, engine = kind.name, kind.engine
    todo, item_hashes = ctx.todo(node)
    calls = ctx.calls(node)
    for shard in ctx.shards(node, todo):
        key = f"{task}-{ctx.token(node, item_hashes, shard)}"
        resolved, deps = ctx.resolve([calls[i] for i in shard])
        args = [r[0] if len(r) == 1 else tuple(r) for r in resolved]
        ctx.add(task, key, ctx.engine_task(key, fn, key, *params, args, *deps),
                TaskAnnotation(op=task, engine=engine, model=params[0], shard=len(shard)))
        ctx.place(node, item_hashes, shard, key)
    ctx.fill_duplicates(node, item_hashes)
