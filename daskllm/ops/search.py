"""``search``: the k nearest documents of each query in a sharded index.

A shard of queries is one search task per index shard, pinned to the worker holding that
shard (the data decides, not placement), and a merge task taking the top k over them.
"""

from __future__ import annotations

from dask._task_spec import Task, TaskRef

from daskllm.annotations import SEARCH_TASK, TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.plan.ir import Node
from daskllm.worker.execute import run_search
from daskllm.worker.indexes import merge_shards


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
    index, k = node.params["index"], node.params["k"]
    todo, item_hashes = ctx.todo(node)
    calls = ctx.calls(node)
    for shard in ctx.shards(node, todo):
        token = ctx.token(node, item_hashes, shard, index.fingerprint, k)
        resolved, deps = ctx.resolve([calls[i] for i in shard])
        queries = [r[0] for r in resolved]
        shard_keys = []
        for s, worker in enumerate(index.workers):
            key = f"{SEARCH.name}-{token}-shard{s}"
            ctx.add(SEARCH.name, key, Task(key, run_search, key, index.name, s, k, queries, *deps),
                    TaskAnnotation(op=SEARCH.name, index=index.name, shard=len(shard), index_shard=s), pin=worker)
            shard_keys.append(key)
        key = f"{SEARCH.name}-{token}"
        ctx.add("merge", key, Task(key, merge_shards, k, *[TaskRef(sk) for sk in shard_keys]))
        ctx.place(node, item_hashes, shard, key)
    ctx.fill_duplicates(node, item_hashes)


SEARCH = TaskType(SEARCH_TASK, _lower, inputs=("query",), calls=True, cacheable=True)
