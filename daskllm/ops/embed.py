"""``embed``: embedding vectors of texts, on the workers holding the embedding model."""

from __future__ import annotations

from daskllm.annotations import EMBED_TASK
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.batched import lower_fused_shards, lower_shards, model_key
from daskllm.plan.ir import Node
from daskllm.worker.execute import run_embed


def _lower(ctx: Lowering, node: Node) -> None:
    lower_shards(ctx, node, EMBED, run_embed, node.params["model"])


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    lower_fused_shards(ctx, nodes, EMBED, run_embed, nodes[0].params["model"])


EMBED = TaskType(EMBED_TASK, _lower, inputs=("text",), engine="embed", calls=True, cacheable=True,
                 lower_fused=_lower_fused, group_key=model_key)
