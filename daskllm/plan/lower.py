"""Lowering: the optimized IR becomes a Dask graph of task-type tasks with annotations.

Each op module (:mod:`daskllm.ops`) lowers its own nodes against a :class:`Lowering`, which
holds what they share: where every call's value will be (``loc``), which calls are
duplicates (with CSE on, identical calls anywhere in the graph are one physical call; calls
served by the result cache are literal values), how a batch is cut into shards (the stage
pass's ``shard_size``, or one task per call with ``granularity="query"``) and the layers
being built. A consumer's shard depends only on the producer tasks holding its inputs. Keys
are deterministic (a hash of the calls a task makes), so identical work is one key.

Every task placement should see carries a :class:`~daskllm.ops.base.TaskAnnotation` in the
graph's ``daskllm`` annotation; nothing else couples the graph side to the scheduler side.
"""

from __future__ import annotations

import functools
import os
import struct
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from daskllm.annotations import TaskAnnotation
from daskllm.engines.kv_cache import block_hashes
from daskllm.ops import cacheable, task_type
from daskllm.ops.base import INLINE
from daskllm.plan import collector
from daskllm.plan.context import ClusterView, PlanOptions, decision, depths, state
from daskllm.plan.items import hashes, items
from daskllm.plan.ir import Dyn, Node, stable_hash
from daskllm.worker.execute import Ref, assemble, off_thread, on_thread

OUTPUT = "output"  # the layer of the tasks holding the requested nodes' values


@dataclass
class Lowered:
    """A plan, lowered: the Dask graph, the optimized IR, what the passes did, and per
    requested node the key of the task holding its value and (if its calls are deterministic)
    their hashes, so the runtime can remember the results when they come back."""

    graph: HighLevelGraph
    plan: nx.DiGraph
    report: dict = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # node key -> output task key
    remember: dict[str, tuple[list[str], bool]] = field(default_factory=dict)  # node key -> (hashes, batched)
    annotations: dict[str, dict] = field(default_factory=dict)  # task key -> its placement annotation
    in_parts: tuple = ()  # keys of the tasks that run inside the graph's parts (daskllm.plan.parts)

    def task_keys(self) -> list:
        return [k for layer in self.graph.layers.values() for k in layer] + list(self.in_parts)


class Lowering:
    """The state of lowering one plan, and the operations op modules lower with."""

    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        plan = state(graph)
        self.options: PlanOptions = plan.options
        self.view: ClusterView = plan.view
        self.dedupe = plan.dedupe
        self.layers: dict[str, dict] = defaultdict(dict)
        self.annotations: dict[str, dict] = {}
        self.pinned: dict[str, list[str]] = {}
        self.loc: dict[Node, list] = {}  # node -> per call: (INLINE, value) | (task key, pos)
        self.physical: dict[str, tuple[str, int]] = {}  # call hash -> (task key, pos) across the graph
        self.counts: dict[str, int] = defaultdict(int)
        self.requested: dict[str, int] = defaultdict(int)
        self.extra_graphs: list[HighLevelGraph] = []
        self.outputs: dict[str, str] = {}
        self.remember: dict[str, tuple[list[str], bool]] = {}
        self.memo: dict = {}

    def run(self) -> Lowered:
        # The stage pass's consolidated nodes, by group and depth: a group is lowered when its
        # first node comes, every input of its nodes being of a smaller depth, lowered already.
        depth = depths(self.graph)
        order = sorted(depth, key=depth.__getitem__)  # topological, by depth (stable: topological within one)
        groups: dict[tuple, list[Node]] = defaultdict(list)
        for node in order:
            if (fused := decision(self.graph, node).fused) is not None:
                groups[fused[0], depth[node]].append(node)
        for node in order:
            fused = decision(self.graph, node).fused
            if fused is None:
                task_type(node).lower(self, node)
            elif (group := groups[fused[0], depth[node]])[0] is node:
                task_type(node).lower_fused(self, group)
        for out in state(self.graph).outputs:
            self._output(out)
        layers, deps, layer_of = {}, {}, {}
        for extra in self.extra_graphs:
            layers.update(extra.layers)
            deps.update(extra.dependencies)
            for name, layer in extra.layers.items():
                layer_of.update(dict.fromkeys(layer, name))
        names = {op: f"daskllm-{op}-{stable_hash(sorted(mapping))[:8]}" for op, mapping in self.layers.items()}
        for op, mapping in self.layers.items():
            layer_of.update(dict.fromkeys(mapping, names[op]))
        for op, mapping in self.layers.items():
            # Plain dict lookups: annotations travel to the scheduler with the graph.
            annotations = {"daskllm": self.annotations.get}
            if any(key in self.pinned for key in mapping):
                annotations.update(workers=self.pinned.get, allow_other_workers=False)
            layers[names[op]] = MaterializedLayer(mapping, annotations)
            deps[names[op]] = {layer_of[d] for task in mapping.values() for d in task.dependencies} - {names[op]}
        report = dict(state(self.graph).report)
        report.update(tasks=dict(self.counts), requested=dict(self.requested),
                      applied=list(state(self.graph).applied),
                      prefill_lower_bound=prefill_lower_bound(self.memo.get("static_prompts", ())),
                      prefill_replica_tokens=self.memo.get("prefill_replica_tokens", 0))
        return Lowered(HighLevelGraph(layers, deps), self.graph, report, self.outputs, self.remember, self.annotations)

    # --- what op modules use -----------------------------------------------------------------

    def calls(self, node: Node) -> list:
        return items(self.graph, node)

    def call_hashes(self, node: Node) -> list[str]:
        return hashes(self.graph, node)

    def has(self, key: str) -> bool:
        return any(key in mapping for mapping in self.layers.values())

    def add(self, layer: str, key: str, task, annotation: TaskAnnotation | None = None, *,
            pin: str | None = None) -> None:
        self.layers[layer][key] = task
        if annotation is not None:
            self.annotations[key] = annotation.as_dict()
        if pin is not None:
            self.pinned[key] = [pin]
        self.counts[layer] += 1

    def engine_task(self, key: str, fn, *args, store: bool = True) -> Task:
        """A task whose function waits on an engine: off the worker's thread count unless
        ``release_threads`` is off (then it holds its thread, as a plain Dask task does).
        ``store=False`` (calls kept out of the result cache), or ``result_cache=False`` for the
        computation: its calls neither read nor write the persistent result store."""
        store = {} if store and dict(self.options.settings).get("result-cache", True) else {"store": False}
        if self.options.release_threads:
            return Task(key, off_thread, fn, *args, **store)
        return Task(key, on_thread, fn, *args, **store) if store else Task(key, fn, *args)

    def add_graph(self, graph: HighLevelGraph) -> None:
        self.extra_graphs.append(graph)

    def count_requested(self, op: str, n: int) -> None:
        self.requested[op] += n

    def prefix_hashes(self, tokens: tuple[int, ...]) -> tuple[str, ...]:
        return _hex_block_hashes(tuple(tokens), self.options.block_size)

    def resolve(self, parts_lists: list[list]) -> tuple[list, list]:
        """Replace Dyn parts by Refs into the task's dependency list."""
        dep_index: dict[str, int] = {}
        deps: list = []
        out = []
        for parts in parts_lists:
            resolved = []
            for part in parts:
                if isinstance(part, Dyn):
                    where = self.loc[part.node][part.index]
                    if where[0] == INLINE:
                        resolved.append(where[1])
                        continue
                    key, pos = where
                    if key not in dep_index:
                        dep_index[key] = len(deps)
                        deps.append(TaskRef(key))
                    resolved.append(Ref(dep_index[key], pos))
                else:
                    resolved.append(part)
            out.append(resolved)
        return out, deps

    def shards(self, node: Node, todo: list[int]) -> list[list[int]]:
        if self.options.granularity == "query":
            size = 1
        else:
            size = decision(self.graph, node).shard_size or max(1, len(todo))
        return [todo[i:i + size] for i in range(0, len(todo), size)]

    def group_shards(self, nodes: list[Node], entries: list) -> list[list]:
        """:meth:`shards` for the calls (entries) of nodes the stage pass consolidated."""
        size = 1 if self.options.granularity == "query" else decision(self.graph, nodes[0]).fused[1]
        return [entries[i:i + size] for i in range(0, len(entries), size)]

    def todo(self, node: Node) -> tuple[list[int], list[str]]:
        """Which calls must run (first occurrences), and fill ``loc`` for the rest."""
        item_hashes = hashes(self.graph, node)
        cached = decision(self.graph, node).cached or (None,) * node.n
        self.loc[node] = [None] * node.n
        self.requested[node.op] += node.n
        todo, seen = [], {}
        for i, h in enumerate(item_hashes):
            if cached[i] is not None:
                self.loc[node][i] = (INLINE, cached[i])
            elif self.dedupe and h in self.physical:
                self.loc[node][i] = self.physical[h]
            elif self.dedupe and h in seen:
                continue
            else:
                seen[h] = i
                todo.append(i)
        return todo, item_hashes

    def token(self, node: Node, item_hashes: list[str], shard: list[int], *extra) -> str:
        """A task key token: the calls it makes; without CSE also where they are, so repeats stay apart."""
        where = None if self.dedupe else (node.hash, shard)
        return stable_hash([item_hashes[i] for i in shard], where, *extra)

    def entries_token(self, entries: list[tuple[Node, int]], *extra) -> str:
        """:meth:`token` for a task whose calls (node, call) may come from several nodes."""
        nodes = {node for node, _ in entries}
        if len(nodes) == 1:
            node = entries[0][0]
            return self.token(node, self.call_hashes(node), [i for _, i in entries], *extra)
        where = None if self.dedupe else [(node.hash, i) for node, i in entries]
        return stable_hash([self.call_hashes(node)[i] for node, i in entries], where, *extra)

    def group_todo(self, nodes: list[Node]) -> tuple[list[tuple[Node, int]], dict[Node, list[str]]]:
        """:meth:`todo` for nodes the stage pass consolidated: their distinct calls (node, call),
        in order (a duplicate across the nodes points at the first), and each node's call hashes."""
        hashes, entries, seen = {}, [], set()
        for node in nodes:
            todo, hashes[node] = self.todo(node)
            for i in todo:
                h = hashes[node][i]
                if not (self.dedupe and h in seen):
                    seen.add(h)
                    entries.append((node, i))
        return entries, hashes

    def place(self, node: Node, item_hashes: list[str], shard: list[int], key: str) -> None:
        self.place_calls([(node, i) for i in shard], key)

    def place_calls(self, entries: list[tuple[Node, int]], key: str) -> None:
        """Calls (node, call) are computed by task ``key``, in this order."""
        for pos, (node, i) in enumerate(entries):
            self.loc[node][i] = (key, pos)
            if self.dedupe:
                self.physical[self.call_hashes(node)[i]] = (key, pos)

    def fill_duplicates(self, node: Node, item_hashes: list[str]) -> None:
        for i, where in enumerate(self.loc[node]):
            if where is None:
                self.loc[node][i] = self.physical[item_hashes[i]]

    def _output(self, node: Node) -> None:
        """The task holding a node's value. Its key is the node's key plus a token of what it
        depends on: the same node planned differently (other passes, a result-cache hit) is a
        different task, so Dask never sees one key with two specs (which it may deadlock on)."""
        spec, deps = self.resolve([[Dyn(node, i)] for i in range(node.n)])
        parts = [p[0] for p in spec] if node.batched else (spec[0][0],)
        token = stable_hash(sorted(str(d.key) for d in deps), None if deps else hashes(self.graph, node))
        key = f"{node.key}-{token[:10]}"
        self.add(OUTPUT, key, Task(key, assemble, parts, *deps))
        self.outputs[node.key] = key
        if cacheable(node):
            self.remember[node.key] = (hashes(self.graph, node), node.batched)


@functools.lru_cache(maxsize=65536)
def _hex_block_hashes(tokens: tuple[int, ...], block: int) -> tuple[str, ...]:
    return tuple(format(h, "x") for h in block_hashes(tokens, block))


def prefill_lower_bound(prompts) -> int:
    """Distinct tokens in the prefix tree of all prompts (per model): no run can prefill fewer."""
    total, previous = 0, None
    for model, tokens in sorted(prompts, key=_by_ids):
        if previous is not None and previous[0] == model:
            shared = len(os.path.commonprefix([previous[1], tokens]))
        else:
            shared = 0
        total += len(tokens) - shared
        previous = (model, tokens)
    return total


def _by_ids(prompt: tuple[str, tuple[int, ...]]) -> tuple[str, bytes]:
    # Big-endian bytes order as the ids do, and compare at C speed: prompts from one template
    # share long prefixes, slow to compare id by id.
    model, tokens = prompt
    return model, struct.pack(f">{len(tokens)}I", *tokens)


@collector.paused()
def lower(graph: nx.DiGraph) -> Lowered:
    return Lowering(graph).run()
