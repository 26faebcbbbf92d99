"""``rerank``: the documents most relevant to a query, best first, on the workers holding the reranker."""

from __future__ import annotations

from daskllm.annotations import RERANK_TASK
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.batched import lower_shards
from daskllm.plan.ir import Node
from daskllm.worker.execute import run_rerank


def _lower(ctx: Lowering, node: Node) -> None:
    lower_shards(ctx, node, RERANK, run_rerank, node.params["model"], node.params["k"])


RERANK = TaskType(RERANK_TASK, _lower, inputs=("query", "docs"), engine="rerank", calls=True, cacheable=True)
