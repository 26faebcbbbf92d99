"""Value nodes: a constant (or a batch of them), a ``dask.delayed`` value, a persisted value.

They compute nothing: lowering records where their value is (inline, or the key of the
Dask task holding it) for their consumers' calls to read.
"""

from __future__ import annotations

from dask.highlevelgraph import HighLevelGraph

from daskllm.ops.base import INLINE, Lowering, TaskType
from daskllm.plan.ir import Dyn, Node, item_of, stable_hash


def is_const(node: Node) -> bool:
    return node.op == CONST.name


def input_part(node: Node, name: str, i: int):
    """Input ``name``'s value for call ``i`` of ``node``: the constant itself, or a :class:`Dyn`."""
    producer = node.inputs[name]
    if is_const(producer):
        return producer.value[i] if producer.batched else producer.value
    return Dyn(producer, item_of(producer, i))


def _lower_const(ctx: Lowering, node: Node) -> None:
    values = node.value if node.batched else [node.value]
    ctx.loc[node] = [(INLINE, v) for v in values]


def _lower_delayed(ctx: Lowering, node: Node) -> None:
    ctx.add_graph(node.value.__dask_graph__())
    ctx.loc[node] = [(node.value.key, None)]


def _lower_persisted(ctx: Lowering, node: Node) -> None:
    graph, key = node.value
    ctx.add_graph(HighLevelGraph.from_collections(f"persisted-{key}", graph, ()))
    ctx.loc[node] = [(key, i if node.batched else None) for i in range(node.n)]


def _const_hashes(node: Node) -> list[str]:
    # By value: equal constants anywhere are one input (CSE sees through them).
    return [stable_hash(CONST.name, v) for v in (node.value if node.batched else [node.value])]


def _keyed_hashes(node: Node) -> list[str]:
    return [stable_hash(node.op, node.key, i) for i in range(node.n)]


CONST = TaskType("const", _lower_const, value_hashes=_const_hashes)
DELAYED = TaskType("delayed", _lower_delayed, value_hashes=_keyed_hashes)
PERSISTED = TaskType("persisted", _lower_persisted, value_hashes=_keyed_hashes)
