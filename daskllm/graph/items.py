"""Items: what each call of a node computes, resolved as far as is known before running.

A batched node of width n makes n calls. For an LLM call the item is its prompt as parts:
runs of token ids for everything known at build time (static text, constant values) and
:class:`Dyn` references to upstream outputs not yet computed. Every item has a structural
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
    return item if isinstance(item, list) else list(item) if isinstance(item, tuple) else [item]


def prompt_parts(graph: nx.DiGraph, node: Node, i: int) -> list:
    """The prompt of call i: runs of token ids and Dyn parts."""
    tok = tokenizer_for(node.params["model"])
    segments = node.template
    if node.chat is not None:
        segments = graph.nodes[node].get("rendered")
        if segments is None:
            segments = graph.nodes[node]["rendered"] = render_chat(_chat_prompt(node), tok.tokenizer)
    parts: list = []
    static: list[int] = list(tok.prefix_ids)
    for seg in segments:
        if isinstance(seg, Tokens):
            static += seg.ids
            continue
        value = seg.text if isinstance(seg, Text) else _input(graph, node, seg.name, i)
        if isinstance(value, Dyn):
            if static:
                parts.append(tuple(static))
                static = []
            parts.append(value)
        else:
            static += tok.encode(render_value(value))
    if static:
        parts.append(tuple(static))
    return parts


def _chat_prompt(node: Node):
    from daskllm.graph.prompt import Prompt

    return Prompt(node.template, {}, chat=node.chat)


def _resolve(graph: nx.DiGraph, node: Node) -> list:
    n = node.n
    if node.op in ("generate", "prefill"):
        return [prompt_parts(graph, node, i) for i in range(n)]
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


def static_prefix(item: list) -> tuple[int, ...]:
    """The token ids of a prompt known before any upstream output is."""
    return item[0] if item and isinstance(item[0], tuple) else ()


def is_static(item: list) -> bool:
    return all(not isinstance(p, Dyn) for p in item)


__all__ = ["Dyn", "Slot", "hashes", "is_static", "item_of", "items", "pmap_args", "prompt_parts", "static_prefix"]
