"""Items: what each call of a node computes, resolved as far as is known before running.

A batched node of width n makes n calls. For an LLM call the item is a :class:`PromptCall`:
its token ids when everything is known at build time (static text, constant values), else
its text parts with :class:`Dyn` references to upstream outputs not yet computed, joined and
tokenized whole when they are. Every item has a structural
hash: identical calls anywhere in the graph have the same hash (common subexpression
elimination works item by item), and a deterministic call's result can be remembered
under it (the result cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from daskllm.ops import task_type
from daskllm.ops.values import input_part
from daskllm.plan.ir import Dyn, Node, stable_hash
from daskllm.prompts import InvalidText, Prompt, PromptTokenizer, Text, Tokens, render_chat, render_value, tokenizer_for


@dataclass(frozen=True, slots=True)
class PromptCall:
    """One LLM call's prompt.

    ``parts``: ``(ids,)`` when the whole prompt is known; else text (str), :class:`Dyn` and
    token-id tuples, joined and tokenized whole once the Dyn values are known (on the worker).
    A prompt whose text cannot be tokenized keeps its text parts and knows no ids: it fails as
    its own call when its task tokenizes it.
    ``special``: the tokenizer adds its special tokens (a plain prompt; a rendered chat
    template carries its own, and a prompt of token ids alone is exactly those ids). ``known``: the ids certain to begin the prompt (all of them
    when it is static): what prefix sharing and placement see before it runs.
    """

    parts: tuple
    special: bool
    known: tuple[int, ...]

    @property
    def static(self) -> bool:
        # In O(1), as passes ask it of every call: a known prompt is its ids alone; a waiting one has a Dyn.
        return len(self.parts) == 1 and not isinstance(self.parts[0], Dyn)


def items(graph: nx.DiGraph, node: Node) -> list:
    data = graph.nodes[node]
    if "items" not in data:
        data["items"] = _resolve(graph, node)
    return data["items"]


def hashes(graph: nx.DiGraph, node: Node) -> list[str]:
    data = graph.nodes[node]
    if "hashes" not in data:
        kind = task_type(node)
        data["hashes"] = kind.value_hashes(node) if kind.value_hashes is not None else _call_hashes(graph, node)
    return data["hashes"]


def _call_hashes(graph: nx.DiGraph, node: Node) -> list[str]:
    salt = stable_hash(node.op, node.params_for_hash())
    # A sampled call without a seed is unique: never merged, not even with its twin in a batch.
    unique = node.params.get("nonce")
    upstream: dict[Node, list[str]] = {}  # a producer's call hashes, looked up once per node

    def hash_of(part):
        if isinstance(part, Dyn):
            if part.node not in upstream:
                upstream[part.node] = hashes(graph, part.node)
            return ("dyn", upstream[part.node][part.index])
        return part

    return [stable_hash(salt, [hash_of(p) for p in _flat(item)], (node.hash, i) if unique else None)
            for i, item in enumerate(items(graph, node))]


def _flat(item) -> list:
    if isinstance(item, PromptCall):
        return [*item.parts, item.special]
    return item if isinstance(item, list) else list(item) if isinstance(item, tuple) else [item]


def prompt_calls(node: Node) -> list[PromptCall]:
    """Every call's prompt, tokenized whole where it is known. What the calls of one template
    share (the tokenizer, the rendered chat) is looked up once per node, not once per call."""
    tok = tokenizer_for(node.params["model"])
    segments = node.template
    if node.chat is not None:
        segments = render_chat(_chat_prompt(node), tok.tokenizer)
    # A prompt given entirely as token ids is those ids (as engine.generate(ids) takes them);
    # text, or text mixed with ids, gets the tokenizer's special tokens as tokenizer(text) does.
    special = node.chat is None and not all(isinstance(s, Tokens) for s in segments)
    return [_prompt_call(tok, node, segments, special, i) for i in range(node.n)]


def _prompt_call(tok: PromptTokenizer, node: Node, segments, special: bool, i: int) -> PromptCall:
    parts: list = []
    dynamic = None  # the first part waiting for an upstream output
    for seg in segments:
        if isinstance(seg, Tokens):
            parts.append(seg.ids)
            continue
        value = seg.text if isinstance(seg, Text) else input_part(node, seg.name, i)
        if isinstance(value, Dyn):
            if dynamic is None:
                dynamic = len(parts)
        else:
            value = render_value(value)
            if parts and isinstance(parts[-1], str):
                parts[-1] += value
                continue
        parts.append(value)
    try:
        if dynamic is None:
            ids = tok.encode_parts(parts, special)
            return PromptCall((ids,), special, ids)
        return PromptCall(tuple(parts), special, tok.stable_prefix(tuple(parts[:dynamic]), special))
    except InvalidText:
        # Kept as text: the call fails alone, on the worker, where its node's on_error decides.
        return PromptCall(tuple(parts), special, ())


def _chat_prompt(node: Node) -> Prompt:
    return Prompt(node.template, {}, chat=node.chat)


def _resolve(graph: nx.DiGraph, node: Node) -> list:
    kind = task_type(node)
    if kind.prompted:
        return prompt_calls(node)
    if kind.call_parts is not None:
        return [kind.call_parts(graph, node, i) for i in range(node.n)]
    if kind.inputs:
        return [[input_part(node, name, i) for name in kind.inputs] for i in range(node.n)]
    raise ValueError(f"{node.label}: op {node.op!r} makes no calls")


__all__ = ["Dyn", "PromptCall", "hashes", "items", "prompt_calls"]
