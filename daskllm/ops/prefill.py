"""``prefill``: warm an engine's prefix cache; the value is a small handle, never KV tensors.

A user's ``daskllm.prefill(prefix)`` lowers to one task per call. The shared-prefix pass makes
prefill nodes of its own (``params["tokens"]``): a shared prefix gets one copy per worker its
calls fill at a fair share of the model's calls (Halo's replication of a popular prefix;
decode shards take the copies in turn), and the
prefixes a decode shard's waiting calls already know are prefilled by one task placed with
that shard (Teola's partial prefill).
"""

from __future__ import annotations

import os


from daskllm.annotations import PREFILL_TASK, TaskAnnotation
from daskllm.ops.base import Lowering, TaskType
from daskllm.plan.context import decision
from daskllm.plan.ir import Node, stable_hash
from daskllm.worker.execute import run_prefill, run_prefill_many

TASK = PREFILL_TASK


def prompt_annotation(ctx: Lowering, task: str, model: str, prefixes: list[tuple[int, ...]], max_tokens: int,
                      shard: int) -> TaskAnnotation:
    """What placement needs to know about a task of prompted calls: the prefix they share, their work."""
    common = _common_prefix(prefixes)
    return TaskAnnotation(op=task, engine="llm", model=model, prefix=ctx.prefix_hashes(common),
                          prompt_tokens=sum(len(p) for p in prefixes), max_tokens=max_tokens * shard, shard=shard)


def _common_prefix(prefixes: list[tuple[int, ...]]) -> tuple[int, ...]:
    # os.path.commonprefix compares id by id in Python; where a task's calls all know the same
    # ids (one call, or a template's waiting calls) one comparison in C says so.
    if not prefixes:
        return ()
    first, last = min(prefixes), max(prefixes)
    return tuple(first if first == last else os.path.commonprefix([first, last]))


def shared(model: str, tokens: tuple[int, ...], *, partial: bool = False) -> Node:
    """A prefill of known tokens, made by the shared-prefix pass; ``partial``: what one waiting call knows."""
    return Node(PREFILL.name, params={"model": model, "tokens": tokens, **({"partial": True} if partial else {})})


def is_pass_made(node: Node) -> bool:
    return node.op == PREFILL.name and "tokens" in node.params


def is_partial(node: Node) -> bool:
    return bool(node.params.get("partial"))


def _lower(ctx: Lowering, node: Node) -> None:
    if is_pass_made(node):  # its copies are made as decode shards ask (replica, partial)
        ctx.loc[node] = [None]
        return
    model = node.params["model"]
    ctx.loc[node] = []
    item_hashes = ctx.call_hashes(node)
    for i, call in enumerate(ctx.calls(node)):
        key = f"{TASK}-{item_hashes[i]}"
        resolved, deps = ctx.resolve([call.parts])
        ctx.add(TASK, key, ctx.engine_task(key, run_prefill, key, model, (call.special, resolved[0]), *deps),
                prompt_annotation(ctx, TASK, model, [call.known], 0, 1))
        ctx.loc[node].append((key, None))


def replica(ctx: Lowering, pre: Node, shard_number: int) -> str:
    """The key of the copy of a shared prefill that decode shard ``shard_number`` waits for."""
    model, tokens = pre.params["model"], pre.params["tokens"]
    copy = shard_number % _replicas(ctx, pre)
    made = ctx.memo.setdefault("prefill_copies", {})  # (prefill, copy) -> key: many shards wait for one copy
    if (pre, copy) not in made:
        key = made[pre, copy] = f"{TASK}-{stable_hash(model, tokens)}-r{copy}"
        if not ctx.has(key):
            ctx.add(TASK, key, ctx.engine_task(key, run_prefill, key, model, (True, [tokens])),
                    prompt_annotation(ctx, TASK, model, [tokens], 0, 1))
            if copy:  # a copy on another worker: prefill work above the single-engine bound
                ctx.memo["prefill_replica_tokens"] = ctx.memo.get("prefill_replica_tokens", 0) + len(tokens)
    return made[pre, copy]


def partials(ctx: Lowering, model: str, prefills: list[Node]) -> str:
    """One task prefilling what a decode shard's waiting calls already know: it is placed
    (and its blocks cached) where the shard will run, and costs one task, not one per call."""
    made = ctx.memo.setdefault("partial_prefills", {})  # the shards of one template wait for the same ones
    group = (model, frozenset(prefills))
    if group not in made:
        tokens = sorted({p.params["tokens"] for p in prefills})
        key = made[group] = f"{TASK}-{stable_hash(model, tokens)}"
        if not ctx.has(key):
            ctx.add(TASK, key, ctx.engine_task(key, run_prefill_many, key, model, tokens),
                    prompt_annotation(ctx, TASK, model, tokens, 0, len(tokens)))
    return made[group]


def _replicas(ctx: Lowering, pre: Node) -> int:
    setting = ctx.options.prefill_replicas
    if setting != "auto":
        return max(1, int(setting))
    return decision(ctx.graph, pre).replicas or ctx.view.holding(pre.params["model"], "llm")


PREFILL = TaskType(PREFILL_TASK, _lower, engine="llm", calls=True, prompted=True)
