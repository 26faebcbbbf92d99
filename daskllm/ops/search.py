"""``search``: the k nearest documents of each query in a sharded index.

A shard of queries is one search task per index shard, pinned to the worker holding that
shard (the data decides, not placement), and a merge task taking the top k over them.
"""

from __future__ import annotations

from dask._task_spec import Task, TaskRef

from daskllm.annotations import SEARCH_TASK, TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.batched import each_fused_shard, each_shard, on_error, origins
from daskllm.plan.ir import Node
from daskllm.worker.execute import merge_search, run_search


class IndexRef:
    """What a search task needs to know about a ShardedIndex: name and shard placement."""

    __slots__ = ("name", "workers", "embedder", "fingerprint")

    def __init__(self, name, workers, embedder, sizes, version):
        self.name, self.workers, self.embedder = name, list(workers), embedder
        self.fingerprint = (name, tuple(workers), tuple(sizes), version)

    @classmethod
    def of(cls, index) -> IndexRef:
        return cls(index.name, index.workers, index.embedder, index.sizes, index.version)


def _lower(ctx: Lowering, node: Node) -> None:
    each_shard(ctx, node, lambda entries: _search(ctx, node.params, entries))


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    """Searches the stage pass consolidated (one index, one k): their queries share tasks."""
    each_fused_shard(ctx, nodes, lambda entries: _search(ctx, nodes[0].params, entries))


def _search(ctx: Lowering, params: dict, entries: list[tuple[Node, int]]) -> None:
    index, k = params["index"], params["k"]
    token = ctx.entries_token(entries, index.fingerprint, k)
    resolved, deps = ctx.resolve([ctx.calls(node)[i] for node, i in entries])
    queries = [r[0] for r in resolved]
    shard_keys = []
    for s, worker in enumerate(index.workers):
        key = f"{SEARCH.name}-{token}-shard{s}"
        ctx.add(SEARCH.name, key, Task(key, run_search, key, index.name, s, k, queries, *deps),
                TaskAnnotation(op=SEARCH.name, index=index.name, shard=len(entries), index_shard=s), pin=worker)
        shard_keys.append(key)
    key = f"{SEARCH.name}-{token}"
    ctx.add("merge", key, Task(key, merge_search, origins(entries), k, *[TaskRef(sk) for sk in shard_keys]))
    ctx.place_calls(entries, key)


def _group_key(graph, node: Node) -> tuple:
    return node.params["index"].fingerprint, node.params["k"], on_error(node)


SEARCH = TaskType(SEARCH_TASK, _lower, inputs=("query",), calls=True, cacheable=True, lower_fused=_lower_fused,
                  group_key=_group_key)
