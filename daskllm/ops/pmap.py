"""``pmap``: a function over every item of a stream (or list), as items arrive, across workers.

Streamed (the pipelining pass), one consumer task per call of its source reads the decode's
queue, and a join task, waiting for both, stands for its value, so the decode always runs.
Over finished lists, one consumer task takes a shard of calls (the stage pass's
``stage-size.pmap``): their items' nested work is planned and submitted together, one plan
and one scheduler message per round for the shard rather than per call. The lazy work its stages return is planned and
submitted from the worker by the runtime's ``submit_nested``, with this plan's options and
cluster view, so nested work is planned the same way.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
from dask._task_spec import Task, TaskRef

from daskllm.annotations import PMAP_TASK
from daskllm.ops.base import INLINE, Lowering, TaskType
from daskllm.ops.values import input_part
from daskllm.plan.context import decision
from daskllm.plan.ir import Dyn, Node, item_of, stable_hash
from daskllm.streaming.stages import PmapSpec
from daskllm.streaming.wire import Source
from daskllm.worker.execute import first, run_pmap


def is_pmap(node: Node) -> bool:
    return node.op == PMAP.name


def args(node: Node) -> list[Node]:
    """A pmap's stage arguments, in order (inputs ``arg0``, ``arg1``, ...)."""
    return [node.inputs[f"arg{j}"] for j in range(len(node.inputs) - 1)]


def source(graph: nx.DiGraph, node: Node) -> Node:
    """Where a pmap's items come from, once pmaps feeding it are fused into it."""
    fused_source = decision(graph, node).source
    return fused_source if fused_source is not None else node.inputs["stream"]


def spec_and_args(graph: nx.DiGraph, node: Node) -> tuple[PmapSpec, list[Node]]:
    plan = decision(graph, node)
    return (plan.spec, list(plan.args)) if plan.spec is not None else (node.value, args(node))


def task_key(ctx: Lowering, node: Node, i: int, *inputs: str) -> str:
    # What the task reads (a stream from its decode, or its inputs' task keys) and the
    # rewrite settings its nested work is planned with are part of the key: the same pmap
    # planned otherwise is another task, never one key with two specs.
    return f"{PMAP.name}-{stable_hash(node.hash, i, ctx.options.settings, *inputs)}"


def _call_parts(graph: nx.DiGraph, node: Node, i: int) -> list:
    src = node.inputs["stream"]
    return [Dyn(src, item_of(src, i)), *(input_part(node, f"arg{j}", i) for j in range(len(node.inputs) - 1))]


def is_plain(graph: nx.DiGraph, node: Node) -> bool:
    """An unstreamed pmap: its calls may share consumer tasks with others' (a fused source is
    one of its predecessors, as the pipeline pass links them)."""
    return is_pmap(node) and not decision(graph, node).streamed


def base_spec(graph: nx.DiGraph, node: Node) -> PmapSpec:
    """Its spec without the ancestry of the item it was built for (which only names items in
    errors): pmaps built by the same code for different items have the same base spec."""
    return dataclasses.replace(spec_and_args(graph, node)[0], ancestry=())


def _lower(ctx: Lowering, node: Node) -> None:
    src = source(ctx.graph, node)
    spec, stage_args = spec_and_args(ctx.graph, node)
    spec = _planned(ctx, spec)
    streamed = decision(ctx.graph, node).streamed
    ctx.count_requested(PMAP.name, node.n)
    ctx.loc[node] = [None] * node.n
    finished = []  # calls over finished lists: consumed in shards, one task each
    for i in range(node.n):
        where = ctx.loc[src][item_of(src, i)]
        if not (streamed and where[0] != INLINE):  # a cached decode has nothing to stream
            finished.append(i)
            continue
        producer_key, pos = where
        key = task_key(ctx, node, i, producer_key)
        stream = Source(producer_key, pos, src.params["sampling"].deterministic)
        resolved, deps = ctx.resolve([[Dyn(a, item_of(a, i)) for a in stage_args]])
        ctx.add(PMAP.name, key, Task(key, run_pmap, key, spec, stream, [(i, None, resolved[0], spec.ancestry)], *deps))
        join = f"stream-{key}"
        ctx.add(PMAP.name, join, Task(join, first, TaskRef(key), TaskRef(producer_key)))
        ctx.loc[node][i] = (join, 0)
    for shard in ctx.shards(node, finished):
        _consumer(ctx, spec, [(node, i) for i in shard])


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    """Pmaps the stage pass consolidated (one base spec, unstreamed): their calls share consumer tasks."""
    for node in nodes:
        ctx.count_requested(PMAP.name, node.n)
        ctx.loc[node] = [None] * node.n
    spec = _planned(ctx, base_spec(ctx.graph, nodes[0]))
    for shard in ctx.group_shards(nodes, [(node, i) for node in nodes for i in range(node.n)]):
        _consumer(ctx, spec, shard)


def _planned(ctx: Lowering, spec: PmapSpec) -> PmapSpec:
    """The spec a task runs: nested work planned with this plan's options and view."""
    nested = dataclasses.replace(ctx.options, results=None)  # a store stays in its process; the worker has its own
    return dataclasses.replace(spec, submit=ctx.options.submit_nested, planning=(nested, ctx.view))


def _consumer(ctx: Lowering, spec: PmapSpec, shard: list[tuple[Node, int]]) -> None:
    """One consumer task over finished lists for calls (node, call); a call carries its own
    node's ancestry, so errors name its item."""
    parts, ancestry = [], []
    for node, i in shard:
        node_spec, stage_args = spec_and_args(ctx.graph, node)
        src = source(ctx.graph, node)
        parts.append([Dyn(src, item_of(src, i)), *(Dyn(a, item_of(a, i)) for a in stage_args)])
        ancestry.append(node_spec.ancestry)
    resolved, deps = ctx.resolve(parts)
    key = f"{PMAP.name}-" + stable_hash([(node.hash, i) for node, i in shard], ctx.options.settings, "unstreamed",
                                        *sorted(str(d.key) for d in deps))
    calls = [(i, r[0], r[1:], a) for (_, i), r, a in zip(shard, resolved, ancestry)]
    ctx.add(PMAP.name, key, Task(key, run_pmap, key, spec, Source(), calls, *deps))
    for pos, (node, i) in enumerate(shard):
        ctx.loc[node][i] = (key, pos)


PMAP = TaskType(PMAP_TASK, _lower, inputs=("stream",), call_parts=_call_parts, is_stream=lambda node: True,
                lower_fused=_lower_fused)
