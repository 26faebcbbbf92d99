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

from daskllm.graph.nodes import Node, stable_hash
from daskllm.graph.prompt import Slot, Text, Tokens, render_chat, render_value, tokenizer_for


@dataclass(frozen=True, slots=True)
class Dyn:
    """Item ``index`` of an upstream node's output (0 for a scalar node)."""

    node: Node
    index: int


@dataclass(frozen=True, slots=True)
class PromptCall:
    """One LLM call's prompt.

    ``parts``: ``(ids,)`` when the whole prompt is known; else text (str), :class:`Dyn` and
    token-id tuples, joined and tokenized whole once the Dyn values are known (on the worker).
    ``special``: the tokenizer adds its special tokens (a plain prompt; a rendered chat
    template carries its own). ``known``: the ids certain to begin the prompt (all of them
    when it is static): what prefix sharing and placement see before it runs.
    """

    parts: tuple
    special: bool
    known: tuple[int, ...]

    @property
    def static(self) -> bool:
        return not any(isinstance(p, Dyn) for p in self.parts)


def item_of(node: Node, i: int) -> int:
    return i if node.batched else 0


def _input(graph: nx.DiGraph, node: Node, name: str, i: int):
    """An input's value for item i: the constant itself, or a Dyn."""
    producer = node.inputs[name]
    if producer.op == "const":
        return producer.value[i] if producer.batched else producer.value
    return Dyn(producer, item_of(producer, i))


def _hash_of(graph: nx.DiGraph, part) -> object:
    if isinstance(part, Dyn):
        return ("dyn", hashes(graph, part.node)[part.index])
    return part


def items(graph: nx.DiGraph, node: Node) -> list:
    data = graph.nodes[node]
    if "items" not in data:
        data["items"] = _resolve(graph, node)
    return data["items"]


def hashes(graph: nx.DiGraph, node: Node) -> list[str]:
    data = graph.nodes[node]
    if "hashes" not in data:
        if node.op in ("const",):
            values = node.value if node.batched else [node.value]
            data["hashes"] = [stable_hash("const", v) for v in values]
        elif node.op in ("delayed", "persisted"):
            data["hashes"] = [stable_hash(node.op, node.key, i) for i in range(node.n)]
        else:
            salt = stable_hash(node.op, node.params_for_hash())
            # A sampled call without a seed is unique: never merged, not even with its twin in a batch.
            unique = node.params.get("nonce")
            data["hashes"] = [stable_hash(salt, [_hash_of(graph, p) for p in _flat(item)],
                                          (node.hash, i) if unique else None)
                              for i, item in enumerate(items(graph, node))]
    return data["hashes"]


def _flat(item) -> list:
    if isinstance(item, PromptCall):
        return [*item.parts, item.special]
    return item if isinstance(item, list) else list(item) if isinstance(item, tuple) else [item]


def prompt_call(graph: nx.DiGraph, node: Node, i: int) -> PromptCall:
    """The prompt of call i, tokenized whole where it is known."""
    tok = tokenizer_for(node.params["model"])
    segments = node.template
    if node.chat is not None:
        segments = graph.nodes[node].get("rendered")
        if segments is None:
            segments = graph.nodes[node]["rendered"] = render_chat(_chat_prompt(node), tok.tokenizer)
    special = node.chat is None
    parts: list = []
    for seg in segments:
        if isinstance(seg, Tokens):
            parts.append(seg.ids)
            continue
        value = seg.text if isinstance(seg, Text) else _input(graph, node, seg.name, i)
        if not isinstance(value, Dyn):
            value = render_value(value)
            if parts and isinstance(parts[-1], str):
                parts[-1] += value
                continue
        parts.append(value)
    dynamic = next((j for j, p in enumerate(parts) if isinstance(p, Dyn)), None)
    if dynamic is None:
        ids = tok.encode_parts(parts, special)
        return PromptCall((ids,), special, ids)
    return PromptCall(tuple(parts), special, tok.stable_prefix(tuple(parts[:dynamic]), special))


def _chat_prompt(node: Node):
    from daskllm.graph.prompt import Prompt

    return Prompt(node.template, {}, chat=node.chat)


def _resolve(graph: nx.DiGraph, node: Node) -> list:
    n = node.n
    if node.op in ("generate", "prefill"):
        return [prompt_call(graph, node, i) for i in range(n)]
    if node.op == "embed":
        return [[_input(graph, node, "text", i)] for i in range(n)]
    if node.op == "search":
        return [[_input(graph, node, "query", i)] for i in range(n)]
    if node.op == "rerank":
        return [[_input(graph, node, "query", i), _input(graph, node, "docs", i)] for i in range(n)]
    if node.op == "pmap":
        source, args = node.inputs["stream"], pmap_args(node)
        return [[Dyn(source, item_of(source, i)), *(_arg(a, i) for a in args)] for i in range(n)]
    if node.op == "collect":
        source = node.inputs["stream"]
        return [[Dyn(source, item_of(source, i))] for i in range(n)]
    if node.op == "gather":
        source = node.inputs["items"]
        return [[Dyn(source, j) for j in range(source.n)]]
    raise ValueError(f"{node.label}: no items for op {node.op!r}")


def pmap_args(node: Node) -> list[Node]:
    """A pmap's stage arguments, in order (inputs ``arg0``, ``arg1``, ...)."""
    return [node.inputs[f"arg{j}"] for j in range(len(node.inputs) - 1)]


def _arg(producer: Node, i: int):
    if producer.op == "const":
        return producer.value[i] if producer.batched else producer.value
    return Dyn(producer, item_of(producer, i))


def static_prefix(item: PromptCall) -> tuple[int, ...]:
    """The token ids of a prompt known before any upstream output is."""
    return item.known


def is_static(item: PromptCall) -> bool:
    return item.static


__all__ = ["Dyn", "PromptCall", "Slot", "hashes", "is_static", "item_of", "items", "pmap_args", "prompt_call",
           "static_prefix"]
