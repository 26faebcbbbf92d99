"""``rerank``: the documents most relevant to a query, best first, on the workers holding the reranker."""

from __future__ import annotations

from daskllm.annotations import RERANK_TASK
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.batched import lower_fused_shards, lower_shards, model_key
from daskllm.plan.ir import Node
from daskllm.worker.execute import run_rerank


def _lower(ctx: Lowering, node: Node) -> None:
    lower_shards(ctx, node, RERANK, run_rerank, node.params["model"], node.params["k"])


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    lower_fused_shards(ctx, nodes, RERANK, run_rerank, nodes[0].params["model"], nodes[0].params["k"])


RERANK = TaskType(RERANK_TASK, _lower, inputs=("query", "docs"), engine="rerank", calls=True, cacheable=True,
                  lower_fused=_lower_fused, group_key=model_key)
