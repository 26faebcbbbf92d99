"""``pmap``: a function over every item of a stream (or list), as items arrive, across workers.

Streamed (the pipelining pass), the calls whose items one decode task makes share one
consumer task (per pmap, or per group of pmaps the stage pass consolidated), which reads
them all through one queue; a join task, waiting for both, stands for their values, so the
decode always runs. Over finished lists, one consumer task takes a shard of calls (the stage
pass's ``stage-size.pmap``). Either way the items' nested work is planned and submitted
together, one plan and one scheduler message per round for the task rather than per call.
The lazy work its stages return is planned and submitted from the worker by the runtime's
``submit_nested``, with this plan's options and cluster view, so nested work is planned the
same way.
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


STREAMS = "pmap_streams"  # memo: (pmap node, call) -> (its consumer task's key, its position in the decode task)


def stream_key(ctx: Lowering, producer_key: str, calls: list[tuple[Node, int]]) -> str:
    # The decode it reads, the calls it runs and the rewrite settings its nested work is
    # planned with are the key: the same pmap planned otherwise is another task, never one
    # key with two specs.
    return f"{PMAP.name}-" + stable_hash(producer_key, [(node.hash, i) for node, i in calls], ctx.options.settings)


def stream_channels(ctx: Lowering, producer_key: str, readers: list[list[tuple[Node, int]]]) -> list[list[str]]:
    """A streamed decode task's channels: per position, the consumer tasks reading it. The
    calls of one pmap (or one consolidated group of pmaps) reading this task share a consumer
    task; which one is recorded for their lowering, which comes after."""
    groups: dict = {}
    for pos, calls in enumerate(readers):
        for node, i in calls:
            fused = decision(ctx.graph, node).fused
            groups.setdefault(("group", fused[0]) if fused else node, []).append((pos, node, i))
    streams = ctx.memo.setdefault(STREAMS, {})
    channels: list[list[str]] = [[] for _ in readers]
    for members in groups.values():
        key = stream_key(ctx, producer_key, [(node, i) for _, node, i in members])
        for pos, node, i in members:
            streams[node, i] = (key, pos)
            if key not in channels[pos]:
                channels[pos].append(key)
    return channels


def _group_key(graph: nx.DiGraph, node: Node) -> tuple:
    """Pmaps built by the same code for different items share consumer tasks: the same stages
    (by fingerprint: a stage may hold unhashable values, such as an index), errors and stickiness."""
    spec = base_spec(graph, node)
    return tuple(stage.fingerprint for stage in spec.stages), spec.errors, spec.sticky


def _call_parts(graph: nx.DiGraph, node: Node, i: int) -> list:
    src = node.inputs["stream"]
    return [Dyn(src, item_of(src, i)), *(input_part(node, f"arg{j}", i) for j in range(len(node.inputs) - 1))]


def base_spec(graph: nx.DiGraph, node: Node) -> PmapSpec:
    """Its spec without the ancestry of the item it was built for (which only names items in
    errors): pmaps built by the same code for different items have the same base spec."""
    return dataclasses.replace(spec_and_args(graph, node)[0], ancestry=())


def _lower(ctx: Lowering, node: Node) -> None:
    cut = lambda entries: [[(node, i) for i in shard] for shard in ctx.shards(node, [i for _, i in entries])]
    _lower_calls(ctx, [node], _planned(ctx, spec_and_args(ctx.graph, node)[0]), cut)


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    """Pmaps the stage pass consolidated (one base spec): their calls share consumer tasks."""
    _lower_calls(ctx, nodes, _planned(ctx, base_spec(ctx.graph, nodes[0])), lambda entries: ctx.group_shards(nodes, entries))


def _lower_calls(ctx: Lowering, nodes: list[Node], spec: PmapSpec, cut) -> None:
    """Streamed calls: one consumer per decode task they read; the others (over finished
    lists, or a decode served by the cache, with nothing to stream): in shards, ``cut(calls)``."""
    registered = ctx.memo.get(STREAMS, {})
    finished, streams = [], {}
    for node in nodes:
        ctx.count_requested(PMAP.name, node.n)
        ctx.loc[node] = [None] * node.n
        streamed, src = decision(ctx.graph, node).streamed, source(ctx.graph, node)
        for i in range(node.n):
            producer_key, pos = ctx.loc[src][item_of(src, i)]
            if not streamed or producer_key == INLINE:
                finished.append((node, i))
                continue
            # A decode that found this call a duplicate of another node's did not register it: its own key, read from the result
            key, pos = registered.get((node, i)) or (stream_key(ctx, producer_key, [(node, i)]), pos)
            streams.setdefault(key, (producer_key, []))[1].append((node, i, pos))
    for key, (producer_key, members) in streams.items():
        _stream_consumer(ctx, spec, key, producer_key, members)
    for shard in cut(finished):
        _consumer(ctx, spec, shard)


def _planned(ctx: Lowering, spec: PmapSpec) -> PmapSpec:
    """The spec a task runs: nested work planned with this plan's options and view."""
    nested = dataclasses.replace(ctx.options, results=None)  # a store stays in its process; the worker has its own
    return dataclasses.replace(spec, submit=ctx.options.submit_nested, planning=(nested, ctx.view))


def _stream_consumer(ctx: Lowering, spec: PmapSpec, key: str, producer_key: str, members: list[tuple[Node, int, int]]) -> None:
    """One consumer task reading calls (node, call, position) of decode task ``producer_key``."""
    parts, ancestry, deterministic = [], [], True
    for node, i, _ in members:
        node_spec, stage_args = spec_and_args(ctx.graph, node)
        parts.append([Dyn(a, item_of(a, i)) for a in stage_args])
        ancestry.append(node_spec.ancestry)
        deterministic &= source(ctx.graph, node).params["sampling"].deterministic
    resolved, deps = ctx.resolve(parts)
    calls = [(i, None, r, a) for (_, i, _), r, a in zip(members, resolved, ancestry)]
    stream = Source(producer_key, tuple(pos for _, _, pos in members), deterministic)
    ctx.add(PMAP.name, key, Task(key, run_pmap, key, spec, stream, calls, *deps))
    join = f"stream-{key}"
    ctx.add(PMAP.name, join, Task(join, first, TaskRef(key), TaskRef(producer_key)))
    for n, (node, i, _) in enumerate(members):
        ctx.loc[node][i] = (join, n)


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
                lower_fused=_lower_fused, group_key=_group_key)
