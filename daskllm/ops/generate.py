"""``generate``: an LLM call (or a batch from one template), lowered to ``decode`` tasks.

Each shard of calls is one decode task: its prompts join the engine's batch together. A
decode waits for the prefill copies the shared-prefix pass gave its calls, so it finds them
in its engine's cache (placement sends it where they went). A split generation is a stream:
its decode cuts each completion into items and, when the pipelining pass streams its
consumers, sends every item to their queues as soon as it is complete.
"""

from __future__ import annotations

from collections import defaultdict

from dask._task_spec import TaskRef

from daskllm.annotations import DECODE_TASK
from daskllm.ops import pmap as pmap_op
from daskllm.ops import prefill as prefill_op
from daskllm.ops.base import Lowering, TaskType
from daskllm.ops.batched import on_error, origins
from daskllm.plan.context import decision
from daskllm.plan.ir import Node, item_of
from daskllm.worker.execute import run_decode, run_decode_split

TASK = DECODE_TASK


def is_split(node: Node) -> bool:
    return node.op == GENERATE.name and node.params.get("split") is not None


def _lower(ctx: Lowering, node: Node) -> None:
    split = node.params.get("split")
    todo, item_hashes = ctx.todo(node)
    consumers = _stream_consumers(ctx, node, item_hashes) if split is not None else {}
    _note_static(ctx, node)
    for number, shard in enumerate(ctx.shards(node, todo)):
        _decode(ctx, node.params, [(node, i) for i in shard], number, consumers)
    ctx.fill_duplicates(node, item_hashes)


def _lower_fused(ctx: Lowering, nodes: list[Node]) -> None:
    """Nodes the stage pass consolidated (same model, sampling and split): their distinct
    calls, in order, cut into shared shards."""
    entries, hashes = ctx.group_todo(nodes)
    consumers: dict = {}
    for node in nodes:
        if is_split(node):
            for h, readers in _stream_consumers(ctx, node, hashes[node]).items():
                consumers.setdefault(h, []).extend(readers)
        _note_static(ctx, node)
    for number, shard in enumerate(ctx.group_shards(nodes, entries)):
        _decode(ctx, nodes[0].params, shard, number, consumers)
    for node in nodes:
        ctx.fill_duplicates(node, hashes[node])


def _note_static(ctx: Lowering, node: Node) -> None:
    model = node.params["model"]
    ctx.memo.setdefault("static_prompts", set()).update((model, call.known) for call in ctx.calls(node) if call.static)


def _decode(ctx: Lowering, params: dict, entries: list[tuple[Node, int]], number: int,
            consumers: dict) -> None:
    """One decode task for ``entries`` (node, call) of one model and sampling (shard ``number``
    of its batch); ``consumers``: a split generation's streamed consumers per call hash."""
    model, sampling, split = params["model"], params["sampling"], params.get("split")
    calls = [ctx.calls(node)[i] for node, i in entries]
    key = f"{TASK}-{ctx.entries_token(entries)}"
    resolved, deps = ctx.resolve([call.parts for call in calls])
    resolved = [(call.special, parts) for call, parts in zip(calls, resolved)]
    # The prefills the calls wait for, each once: a template's calls share them.
    waiting = [p for p in dict.fromkeys(_prefill_of(ctx, node, i) for node, i in entries) if p is not None]
    partial = [p for p in waiting if prefill_op.is_partial(p)]
    pre_keys = {prefill_op.replica(ctx, p, number) if ctx.loc[p] == [None] else ctx.loc[p][0][0]
                for p in waiting if not prefill_op.is_partial(p)}
    if partial:
        pre_keys.add(prefill_op.partials(ctx, model, partial))
    deps += [TaskRef(k) for k in sorted(pre_keys)]
    if split is None:
        # A call kept out of the result cache (cache=False) keeps its task's calls out of the persistent store.
        task = ctx.engine_task(key, run_decode, key, model, sampling, origins(entries), resolved, *deps,
                               store=all(node.params.get("cache", True) and not node.params.get("nonce")
                                         for node, _ in entries))
    else:
        channels = pmap_op.stream_channels(ctx, key, [consumers.get(ctx.call_hashes(node)[i], []) for node, i in entries])
        task = ctx.engine_task(key, run_decode_split, key, model, sampling, split, channels, resolved, *deps)
    ctx.add(TASK, key, task, prefill_op.prompt_annotation(ctx, TASK, model, [c.known for c in calls],
                                                          sampling.max_tokens, len(entries)))
    ctx.place_calls(entries, key)


def _prefill_of(ctx: Lowering, node: Node, i: int) -> Node | None:
    prefills = decision(ctx.graph, node).prefills
    return prefills[i] if prefills else None


def _stream_consumers(ctx: Lowering, node: Node, item_hashes: list[str]) -> dict[str, list[tuple[Node, int]]]:
    """Per call (by hash, so duplicates of a call share its decode): its streamed consumers."""
    consumers: dict[str, list[tuple[Node, int]]] = defaultdict(list)
    for consumer in ctx.graph.successors(node):
        plan = decision(ctx.graph, consumer)
        if pmap_op.is_pmap(consumer) and plan.streamed and pmap_op.source(ctx.graph, consumer) is node:
            for i in range(consumer.n):
                consumers[item_hashes[item_of(node, i)]].append((consumer, i))
    return consumers


def _group_key(graph, node: Node) -> tuple:
    """Model, sampling, split, on_error and the shared prefixes the calls wait for (so a shared
    task's calls find one prefix on one worker)."""
    shared = frozenset(p for p in decision(graph, node).prefills or () if p is not None and not prefill_op.is_partial(p))
    split = node.params.get("split")
    return node.params["model"], node.params["sampling"], split and split.fingerprint, on_error(node), shared


GENERATE = TaskType("generate", _lower, engine="llm", calls=True, prompted=True, cacheable=True, is_stream=is_split,
                    lower_fused=_lower_fused, group_key=_group_key)
