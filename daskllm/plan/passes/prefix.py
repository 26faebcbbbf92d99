"""Shared-prefix prefill (Helium's templated radix tree, Teola's partial prefill).

The static prefixes of all calls to one model go into a radix tree over cache blocks. For
each group of fully known prompts whose longest shared prefix is at least
``prefix-min-tokens`` long, one ``prefill`` node computes that prefix once; the calls'
decodes depend on it, so they find it in the engine's cache. A call whose prompt still
waits for upstream outputs (retrieval, another generation) gets everything it already
knows prefilled early, in parallel with that upstream work: only a true prefix, since
attention is causal. Shared parts of those prefixes are computed once by the engine's
prefix cache. A prefill whose calls are all answered by the persistent result store
(``PlanOptions.stored``) is not made: nothing would read what it computes.
"""

from __future__ import annotations

import os

import networkx as nx

from daskllm.ops import generate as generate_op
from daskllm.ops import prefill as prefill_op
from daskllm.plan.context import StoredLookup, decide, decision, state
from daskllm.plan.ir import Node
from daskllm.plan.items import items


class _Trie:
    """A radix tree over fixed-size token blocks, counting the calls through each node."""

    __slots__ = ("children", "count", "members", "_common")

    def __init__(self):
        self.children: dict[tuple[int, ...], _Trie] = {}
        self.count = 0
        self.members: list[tuple[int, ...]] = []  # the distinct prefixes through this node
        self._common: tuple[int, ...] | None = None

    def insert(self, prefix: tuple[int, ...], blocks: list[tuple[int, ...]], calls: int = 1) -> None:
        node = self
        for block in blocks:
            node = node.children.setdefault(block, _Trie())
            node.count += calls
            node.members.append(prefix)

    def shared(self, blocks: list[tuple[int, ...]]) -> tuple[int, _Trie | None]:
        """The deepest node this sequence shares with at least one other call, and its depth."""
        node, depth, found = self, 0, None
        for block in blocks:
            node = node.children[block]
            if node.count < 2:
                break
            depth, found = depth + 1, node
        return depth, found

    def common_prefix(self) -> tuple[int, ...]:
        """The token-level common prefix of every call through this node (at least its blocks)."""
        if self._common is None:  # many calls share a node: compute it once
            self._common = tuple(os.path.commonprefix(self.members))
        return self._common


def _blocks(tokens: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [tokens[i:i + size] for i in range(0, len(tokens) - size + 1, size)]


def _all_stored(graph: nx.DiGraph, stored: StoredLookup | None, model: str,
                served: list[tuple[Node, list[int], bool, int]]) -> bool:
    """Whether the result store answers every call a prefill serves (asked lazily: a first run
    stops at its first call). A call still waiting for upstream output cannot be looked up."""
    if stored is None or not all(static for _, _, static, _ in served):
        return False
    return all(all(stored.stored(model, node.params["sampling"], [items(graph, node)[i].known for i in members]))
               for node, members, _, _ in served)


def served_calls(served: list[tuple]) -> int:
    return sum(len(entry[1]) for entry in served)


def _replicas_needed(workers: int, calls: int, model_calls: int) -> int:
    """Copies of a shared prefill: one per worker its calls fill at a fair share of the model's
    calls (Halo's replication for a popular prefix), not one per worker whatever its size: four
    equal prefixes on two workers are each computed once, two on each worker."""
    fair = -(-model_calls // max(1, workers))
    return max(1, min(workers, -(-calls // max(1, fair))))


class SharedPrefixPrefill:
    name = "prefix"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        plan = state(graph)
        if plan.as_parts:  # one engine runs each part's calls: its prefix cache shares their prefixes
            return graph
        block, threshold = plan.options.block_size, plan.options.prefix_min_tokens
        # model -> static prefix -> [(node, its calls with that prefix, fully static?)]: calls from
        # one template share a prefix, so the tree is built over distinct prefixes, weighted by
        # their calls, and what a group of calls waits for is decided once for the group.
        calls: dict[str, dict[tuple[int, ...], list[tuple[Node, list[int], bool]]]] = {}
        for node in list(graph):
            if node.op != generate_op.GENERATE.name:
                continue
            cached = decision(graph, node).cached or (None,) * node.n
            groups: dict[tuple[tuple[int, ...], bool], list[int]] = {}
            for i, item in enumerate(items(graph, node)):
                if cached[i] is not None:
                    continue
                members = groups.setdefault((item.known, item.static), [])
                if not (item.static and members):  # identical static prompts are one call (CSE): count them once
                    members.append(i)
            by_prefix = calls.setdefault(node.params["model"], {})
            for (prefix, static), members in groups.items():
                by_prefix.setdefault(prefix, []).append((node, members, static))
        prefills: dict[tuple[str, tuple[int, ...]], Node] = {}
        # prefill -> the calls it serves: (generate node, their indexes, fully known?, tokens each reads from it)
        serves: dict[tuple[str, tuple[int, ...]], list[tuple[Node, list[int], bool, int]]] = {}
        for model, by_prefix in calls.items():
            trie = _Trie()
            blocks_of = {prefix: _blocks(prefix, block) for prefix in by_prefix}
            for prefix, group in by_prefix.items():
                trie.insert(prefix, blocks_of[prefix], sum(len(members) for _, members, _ in group))
            for prefix, group in by_prefix.items():
                depth, shared_node = trie.shared(blocks_of[prefix])
                for node, members, static in group:
                    if not static and len(prefix) >= threshold:
                        # Waits for upstream output: prefill all it knows now (this covers
                        # any shared part too; the engine reuses that across calls).
                        tokens, kind = prefix, "partial"
                    elif depth * block >= threshold:
                        # Down to the token (a partly filled last block is cached too).
                        tokens, kind = shared_node.common_prefix(), "shared"
                    else:
                        continue
                    key = (model, tokens)
                    if key not in prefills:
                        # A partial prefill serves one call: lowering batches those of a decode
                        # shard into one task, placed with the shard.
                        prefills[key] = prefill_op.shared(model, tokens, partial=kind == "partial")
                    # What each decode then reads from the cache (what usage reports as prefill
                    # tokens cached): the prefix, less the last prompt token that a generation
                    # always computes; the prefill's own tokens are computed, not read.
                    reads = min(len(tokens), len(prefix) - 1) if static else len(tokens)
                    serves.setdefault(key, []).append((node, members, static, reads))
        # A prefill whose calls the result store answers all would warm a cache nothing reads:
        # their decode tasks take the stored results and run nothing (a rerun computes nothing).
        answered = [key for key, served in serves.items() if _all_stored(graph, plan.options.stored, key[0], served)]
        for key in answered:
            del prefills[key], serves[key]
        assigned: dict[Node, list] = {}  # generate node -> per call, the prefill it waits for
        for key, pre in prefills.items():
            graph.add_node(pre)
            for node, members, _, _ in serves[key]:
                pres = assigned.setdefault(node, [None] * node.n)
                for i in members:
                    pres[i] = pre
                graph.add_edge(pre, node)
        for node, pres in assigned.items():
            decide(graph, node, prefills=tuple(pres))
        for key, pre in prefills.items():
            decide(graph, pre, replicas=_replicas_needed(plan.view.holding(key[0], "llm"), served_calls(serves[key]),
                                                         sum(served_calls(g) for g in calls[key[0]].values())))
        partial = sum(prefill_op.is_partial(pre) for pre in prefills.values())
        plan.report["prefix"] = {"prefills": len(prefills), "shared": len(prefills) - partial, "partial": partial,
                                 "prefill_tokens_cached": sum(len(members) * reads for served in serves.values()
                                                              for _, members, _, reads in served),
                                 "answered_by_store": len(answered)}
        return graph
