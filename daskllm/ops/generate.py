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
from daskllm.plan.context import decision
from daskllm.plan.ir import Node, item_of
from daskllm.worker.execute import run_decode, run_decode_split

TASK = DECODE_TASK


def is_split(node: Node) -> bool:
    return node.op == GENERATE.name and node.params.get("split") is not None


def _lower(ctx: Lowering, node: Node) -> None:
    model, sampling, split = node.params["model"], node.params["sampling"], node.params.get("split")
    todo, item_hashes = ctx.todo(node)
    calls = ctx.calls(node)
    consumers = _stream_consumers(ctx, node, item_hashes) if split is not None else {}
    ctx.memo.setdefault("static_prompts", set()).update((model, call.known) for call in calls if call.static)
    prefills = decision(ctx.graph, node).prefills or (None,) * node.n
    for number, shard in enumerate(ctx.shards(node, todo)):
        key = f"{TASK}-{ctx.token(node, item_hashes, shard)}"
        resolved, deps = ctx.resolve([calls[i].parts for i in shard])
        resolved = [(calls[i].special, parts) for i, parts in zip(shard, resolved)]
        # The prefills the shard's calls wait for, each once: a template's calls share them.
        waiting = [p for p in dict.fromkeys(prefills[i] for i in shard) if p is not None]
        partial = [p for p in waiting if prefill_op.is_partial(p)]
        pre_keys = {prefill_op.replica(ctx, p, number) if ctx.loc[p] == [None] else ctx.loc[p][0][0]
                    for p in waiting if not prefill_op.is_partial(p)}
        if partial:
            pre_keys.add(prefill_op.partials(ctx, model, partial))
        deps += [TaskRef(k) for k in sorted(pre_keys)]
        if split is None:
            task = ctx.engine_task(key, run_decode, key, model, sampling, resolved, *deps)
        else:
            channels = [[pmap_op.task_key(ctx, c, j, key) for c, j in consumers.get(item_hashes[i], [])]
                        for i in shard]
            task = ctx.engine_task(key, run_decode_split, key, model, sampling, split, channels, resolved, *deps)
        ctx.add(TASK, key, task, prefill_op.prompt_annotation(ctx, TASK, model, [calls[i].known for i in shard],
                                                              sampling.max_tokens, len(shard)))
        ctx.place(node, item_hashes, shard, key)
    ctx.fill_duplicates(node, item_hashes)


def _stream_consumers(ctx: Lowering, node: Node, item_hashes: list[str]) -> dict[str, list[tuple[Node, int]]]:
    """Per call (by hash, so duplicates of a call share its decode): its streamed consumers."""
    consumers: dict[str, list[tuple[Node, int]]] = defaultdict(list)
    for consumer in ctx.graph.successors(node):
        plan = decision(ctx.graph, consumer)
        if pmap_op.is_pmap(consumer) and plan.streamed and pmap_op.source(ctx.graph, consumer) is node:
            for i in range(consumer.n):
                consumers[item_hashes[item_of(node, i)]].append((consumer, i))
    return consumers


GENERATE = TaskType("generate", _lower, engine="llm", calls=True, prompted=True, cacheable=True, is_stream=is_split)
