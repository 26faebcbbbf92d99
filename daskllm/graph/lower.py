"""Lowering: the optimized IR becomes a Dask graph of task-type tasks with annotations.

Each batched node becomes shards (its ``shard_size`` from the stage pass, or one shard, or
one task per call with ``granularity="query"``). With CSE on, identical calls anywhere in
the graph are one physical call; calls found in the result cache are literal values. A
consumer's shard depends only on the producer tasks that hold its inputs. Keys are
deterministic (a hash of the calls a task makes), so identical work is one key.

Every LLM task carries the ``daskllm`` annotation (ARCHITECTURE.md): op, model or index,
the prefix hash chain, prompt tokens, output-token estimate and shard size. Nothing else
couples the graph side to the scheduler side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from daskllm import config, streaming, tasks
from daskllm.engines.kv_cache import block_hashes
from daskllm.graph.items import Dyn, hashes, item_of, items, pmap_args, static_prefix
from daskllm.graph.nodes import BATCHABLE_OPS, Node, _registry, stable_hash
from daskllm.graph.prompt import tokenizer_for
from daskllm.worker import check_served, workers_holding
from daskllm.rewrite import PassManager
from daskllm.rewrite.cache import RESULTS, cacheable

OVERRIDE_KEYS = {"passes": "rewrite.passes", "granularity": "rewrite.granularity",
                 "result_cache": "rewrite.result-cache"}


@contextlib.contextmanager
def overrides(kwargs: dict):
    """Per-call overrides of the rewrite config, taken out of ``compute(**kwargs)``."""
    settings = {OVERRIDE_KEYS[k]: kwargs.pop(k) for k in list(kwargs) if k in OVERRIDE_KEYS}
    with config.overriding(settings):
        yield kwargs


@dataclass
class Lowered:
    graph: HighLevelGraph
    plan: nx.DiGraph
    report: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # node key -> output task key


def plan(outputs: list[Node]) -> nx.DiGraph:
    """The IR graph of everything ``outputs`` need, with the configured passes applied."""
    graph = nx.DiGraph(outputs=list(outputs), report={})
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in graph and graph.nodes[node].get("visited"):
            continue
        graph.add_node(node, visited=True)
        for producer in node.inputs.values():
            graph.add_edge(producer, node)
            stack.append(producer)
    _check_acyclic(graph)
    passes = list(config.get("rewrite.passes"))
    if not config.get("rewrite.result-cache"):
        passes = [p for p in passes if p != "cache"]
    graph = PassManager(passes).run(graph)
    _check_acyclic(graph)  # a user pass may have added edges
    return graph


def _check_acyclic(graph: nx.DiGraph) -> None:
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise ValueError(f"the graph has a cycle through {cycle[0][0].label}")


_cache_lock = threading.Lock()
_lowered_cache: dict = {}


def lowered(outputs: list[Node]) -> Lowered:
    """Plan and lower ``outputs`` together (memoized per outputs and configuration)."""
    cache_key = (tuple(o.key for o in outputs), config.snapshot(), RESULTS.version)
    with _cache_lock:
        if cache_key in _lowered_cache:
            return _lowered_cache[cache_key]
    result = _Lowering(plan(outputs)).run()
    with _cache_lock:
        if len(_lowered_cache) > 64:
            _lowered_cache.clear()
        _lowered_cache[cache_key] = result
    return result


# Which engine kind serves each op's model.
_ENGINE_KINDS = {"generate": "llm", "prefill": "llm", "embed": "embed", "rerank": "rerank"}


def models_needed(result: Lowered) -> set[tuple[str, str]]:
    """``(engine kind, model)`` of every task in a plan."""
    return {(_ENGINE_KINDS[n.op], n.params["model"]) for n in result.plan if n.op in _ENGINE_KINDS}


def submitted(outputs: list[Node]) -> Lowered:
    """:func:`lowered`, for submission: a model no worker holds fails here, naming it."""
    result = lowered(outputs)
    check_served(models_needed(result))
    return result


def optimize(dsk, keys):
    """Dask's collection optimizer hook: the graphs are lowered already, so this only counts
    their plans for :func:`daskllm.usage`.

    Dask 2026 calls this where the graph is materialized, which with a distributed client is
    the scheduler, whose node registry is another process's: planning several outputs jointly
    here would work only by accident. ``daskllm.compute`` and ``node.compute`` plan their nodes
    jointly on the client instead (:class:`~daskllm.graph.nodes.Joint`).
    """
    if not isinstance(dsk, HighLevelGraph):
        return dsk
    from daskllm.metering import note_lowering

    for name, layer in dsk.layers.items():
        if name.startswith("daskllm-output-"):
            for key in layer:
                node = _registry.get(key.rsplit("-", 1)[0])  # output key = node key + plan token
                if node is not None:
                    note_lowering(lowered([node]))
    return dsk


class _Lowering:
    def __init__(self, graph: nx.DiGraph):
        self.g = graph
        self.layers: dict[str, dict] = defaultdict(dict)
        self.annotations: dict[str, dict] = {}
        self.pinned: dict[str, list[str]] = {}
        self.loc: dict[Node, list] = {}  # node -> per item: ("const", value) | (task key, pos)
        self.dedupe = bool(graph.graph.get("cse"))
        self.physical: dict[str, tuple[str, int]] = {}  # item hash -> (task key, pos) across the graph
        self.granularity = config.get("rewrite.granularity")
        self.report = dict(graph.graph["report"])
        self.counts: dict[str, int] = defaultdict(int)
        self.requested: dict[str, int] = defaultdict(int)
        self.extra_graphs: list[HighLevelGraph] = []
        self.static_prompts: set[tuple[str, tuple[int, ...]]] = set()
        self.outputs: dict[str, str] = {}  # node key -> the key of the task holding its value
        self.replicas: dict[str, int] = {}
        self._settings_token: str | None = None
        self.replica_tokens = 0

    def run(self) -> Lowered:
        for node in nx.topological_sort(self.g):
            getattr(self, f"_lower_{node.op}")(node)
        for out in self.g.graph["outputs"]:
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
            if op == "search":
                annotations.update(workers=self.pinned.get, allow_other_workers=False)
            layers[names[op]] = MaterializedLayer(mapping, annotations)
            deps[names[op]] = {layer_of[d] for task in mapping.values() for d in task.dependencies} - {names[op]}
        self.report.update(tasks=dict(self.counts), requested=dict(self.requested),
                           applied=list(self.g.graph.get("applied", [])),
                           prefill_lower_bound=prefill_lower_bound(self.static_prompts),
                           prefill_replica_tokens=self.replica_tokens)
        return Lowered(HighLevelGraph(layers, deps), self.g, self.report, self.outputs)

    def _add(self, op: str, key: str, task, annotation: dict | None = None) -> None:
        self.layers[op][key] = task
        if annotation is not None:
            self.annotations[key] = annotation
        self.counts[op] += 1

    # --- item references ------------------------------------------------------------------

    def _deps_for(self, parts_lists: list[list]) -> tuple[list, list]:
        """Replace Dyn parts by Refs into the task's dependency list."""
        dep_index: dict[str, int] = {}
        deps: list = []
        out = []
        for parts in parts_lists:
            resolved = []
            for part in parts:
                if isinstance(part, Dyn):
                    where = self.loc[part.node][part.index]
                    if where[0] == "const":
                        resolved.append(where[1])
                        continue
                    key, pos = where
                    if key not in dep_index:
                        dep_index[key] = len(deps)
                        deps.append(TaskRef(key))
                    resolved.append(tasks.Ref(dep_index[key], pos))
                else:
                    resolved.append(part)
            out.append(resolved)
        return out, deps

    def _shards(self, node: Node, todo: list[int]) -> list[list[int]]:
        if self.granularity == "query":
            size = 1
        else:
            size = self.g.nodes[node].get("shard_size") or max(1, len(todo))
        return [todo[i:i + size] for i in range(0, len(todo), size)]

    def _plan_items(self, node: Node) -> tuple[list[int], list]:
        """Which calls must run (first occurrences), and fill ``loc`` for the rest."""
        item_hashes = hashes(self.g, node)
        cached = self.g.nodes[node].get("cached") or [None] * node.n
        self.loc[node] = [None] * node.n
        self.requested[node.op] += node.n
        todo, seen = [], {}
        for i, h in enumerate(item_hashes):
            if cached[i] is not None:
                self.loc[node][i] = ("const", cached[i])
            elif self.dedupe and h in self.physical:
                self.loc[node][i] = self.physical[h]
            elif self.dedupe and h in seen:
                continue
            else:
                seen[h] = i
                todo.append(i)
        return todo, item_hashes

    def _shard_token(self, node: Node, item_hashes: list[str], shard: list[int], *extra) -> str:
        """A task key token: the calls it makes; without CSE also where they are, so repeats stay apart."""
        where = None if self.dedupe else (node.hash, shard)
        return stable_hash([item_hashes[i] for i in shard], where, *extra)

    def _place(self, node: Node, item_hashes: list[str], shard: list[int], key: str) -> None:
        for pos, i in enumerate(shard):
            self.loc[node][i] = (key, pos)
            if self.dedupe:
                self.physical[item_hashes[i]] = (key, pos)

    def _fill_duplicates(self, node: Node, item_hashes: list[str]) -> None:
        for i, where in enumerate(self.loc[node]):
            if where is None:
                self.loc[node][i] = self.physical[item_hashes[i]]

    # --- one method per op ----------------------------------------------------------------

    def _lower_const(self, node: Node) -> None:
        values = node.value if node.batched else [node.value]
        self.loc[node] = [("const", v) for v in values]

    def _lower_delayed(self, node: Node) -> None:
        self.extra_graphs = [*self.extra_graphs, node.value.__dask_graph__()]
        self.loc[node] = [(node.value.key, None)]

    def _lower_persisted(self, node: Node) -> None:
        dsk, key = node.value
        self.extra_graphs = [*self.extra_graphs, HighLevelGraph.from_collections(f"persisted-{key}", dsk, ())]
        self.loc[node] = [(key, i if node.batched else None) for i in range(node.n)]

    def _lower_gather(self, node: Node) -> None:
        source = node.inputs["items"]
        key = f"gather-{node.hash}"
        spec, deps = self._deps_for([[Dyn(source, i)] for i in range(source.n)])
        self._add("gather", key, Task(key, tasks.assemble, [p[0] for p in spec], *deps))
        self.loc[node] = [(key, None)]

    def _lower_prefill(self, node: Node) -> None:
        if "tokens" in node.params:  # made by the prefix pass: its replicas are made as consumers ask
            self.loc[node] = [None]
            return
        model = node.params["model"]
        self.loc[node] = []
        for i, call in enumerate(items(self.g, node)):
            key = f"prefill-{hashes(self.g, node)[i]}"
            resolved, deps = self._deps_for([call.parts])
            self._add("prefill", key, Task(key, tasks.run_prefill, key, model, (call.special, resolved[0]), *deps),
                      self._llm_annotation("prefill", model, [static_prefix(call)], 0, 1))
            self.loc[node].append((key, None))

    def _prefill_replica(self, pre: Node, shard_number: int) -> str:
        """The key of the prefill copy that decode shard ``shard_number`` waits for."""
        model, tokens = pre.params["model"], pre.params["tokens"]
        replica = shard_number % self._replicas(model)
        key = f"prefill-{stable_hash(model, tokens)}-r{replica}"
        if key not in self.layers["prefill"]:
            self._add("prefill", key, Task(key, tasks.run_prefill, key, model, (True, [tokens])),
                      self._llm_annotation("prefill", model, [tokens], 0, 1))
            if replica:  # a copy on another worker: prefill work above the single-engine bound
                self.replica_tokens += len(tokens)
        return key

    def _partial_prefills(self, model: str, prefills: list[Node]) -> str:
        """One task prefilling what a decode shard's waiting calls already know: it is placed
        (and its blocks cached) where the shard will run, and costs one task, not one per call."""
        tokens = sorted({p.params["tokens"] for p in prefills})
        key = f"prefill-{stable_hash(model, tokens)}"
        if key not in self.layers["prefill"]:
            self._add("prefill", key, Task(key, tasks.run_prefill_many, key, model, tokens),
                      self._llm_annotation("prefill", model, tokens, 0, len(tokens)))
        return key

    def _replicas(self, model: str) -> int:
        if model not in self.replicas:
            setting = config.get("rewrite.prefill-replicas")
            self.replicas[model] = (max(1, int(setting)) if setting != "auto"
                                    else workers_holding(model, memo=self.g.graph.setdefault("holding", {})))
        return self.replicas[model]

    def _lower_generate(self, node: Node) -> None:
        model, sampling, split = node.params["model"], node.params["sampling"], node.params.get("split")
        todo, item_hashes = self._plan_items(node)
        all_items = items(self.g, node)
        consumers = self._stream_consumers(node, item_hashes) if split is not None else {}
        self.static_prompts.update((model, call.known) for call in all_items if call.static)
        prefills = self.g.nodes[node].get("prefill") or [None] * node.n
        for number, shard in enumerate(self._shards(node, todo)):
            key = f"decode-{self._shard_token(node, item_hashes, shard)}"
            resolved, deps = self._deps_for([all_items[i].parts for i in shard])
            resolved = [(all_items[i].special, parts) for i, parts in zip(shard, resolved)]
            partial = [prefills[i] for i in shard if prefills[i] is not None and prefills[i].params.get("partial")]
            pre_keys = {self._prefill_replica(prefills[i], number) if self.loc[prefills[i]] == [None]
                        else self.loc[prefills[i]][0][0] for i in shard
                        if prefills[i] is not None and not prefills[i].params.get("partial")}
            if partial:
                pre_keys.add(self._partial_prefills(model, partial))
            deps += [TaskRef(k) for k in sorted(pre_keys)]
            prefixes = [static_prefix(all_items[i]) for i in shard]
            if split is None:
                task = Task(key, tasks.run_decode, key, model, sampling, resolved, *deps)
            else:
                channels = [[self._pmap_key(c, j, key) for c, j in consumers.get(item_hashes[i], [])] for i in shard]
                task = Task(key, tasks.run_decode_split, key, model, sampling, split, channels, resolved, *deps)
            self._add("decode", key, task,
                      self._llm_annotation("decode", model, prefixes, sampling.max_tokens, len(shard)))
            self._place(node, item_hashes, shard, key)
        self._fill_duplicates(node, item_hashes)

    def _stream_consumers(self, node: Node, item_hashes: list[str]) -> dict[str, list[tuple[Node, int]]]:
        """Per call (by hash, so duplicates of a call share its decode): its streamed consumers."""
        consumers: dict[str, list[tuple[Node, int]]] = defaultdict(list)
        for consumer in self.g.successors(node):
            if consumer.op == "pmap" and self.g.nodes[consumer].get("streamed") and self._pmap_source(consumer) is node:
                for i in range(consumer.n):
                    consumers[item_hashes[item_of(node, i)]].append((consumer, i))
        return consumers

    def _pmap_source(self, node: Node) -> Node:
        return self.g.nodes[node].get("source", node.inputs["stream"])

    def _pmap_key(self, node: Node, i: int, *inputs: str) -> str:
        # What the task reads (a stream from its decode, or its inputs' task keys) and the
        # rewrite settings its nested work is planned with are part of the key: the same pmap
        # planned otherwise is another task, never one key with two specs.
        if self._settings_token is None:
            self._settings_token = stable_hash(dict(config.get("rewrite")))
        return f"pmap-{stable_hash(node.hash, i, self._settings_token, *inputs)}"

    def _lower_pmap(self, node: Node) -> None:
        """One consumer task per call of the source; streamed, it reads the decode's queue and
        a join task (waiting for both) stands for its value, so the decode always runs."""
        source = self._pmap_source(node)
        spec, args = self.g.nodes[node].get("fused") or (node.value, pmap_args(node))
        spec = dataclasses.replace(spec, rewrite=dict(config.get("rewrite")))
        streamed = self.g.nodes[node].get("streamed")
        self.requested["pmap"] += node.n
        self.loc[node] = []
        for i in range(node.n):
            arg_parts = [Dyn(a, item_of(a, i)) for a in args]
            where = self.loc[source][item_of(source, i)]
            if streamed and where[0] != "const":  # a cached decode has nothing to stream
                producer_key, pos = where
                key = self._pmap_key(node, i, producer_key)
                stream = streaming.Source(producer_key, pos, source.params["sampling"].deterministic)
                resolved, deps = self._deps_for([arg_parts])
                self._add("pmap", key, Task(key, tasks.run_pmap, key, spec, stream, None, resolved[0], *deps))
                join = f"stream-{key}"
                self._add("pmap", join, Task(join, tasks.first, TaskRef(key), TaskRef(producer_key)))
                self.loc[node].append((join, None))
            else:
                resolved, deps = self._deps_for([[Dyn(source, item_of(source, i)), *arg_parts]])
                key = self._pmap_key(node, i, "unstreamed", *sorted(str(d.key) for d in deps))
                self._add("pmap", key, Task(key, tasks.run_pmap, key, spec, streaming.Source(), resolved[0][0],
                                            resolved[0][1:], *deps))
                self.loc[node].append((key, None))

    def _lower_collect(self, node: Node) -> None:
        self.loc[node] = self.loc[node.inputs["stream"]]

    def _llm_annotation(self, op: str, model: str, prefixes: list[tuple[int, ...]], max_tokens: int,
                        shard: int) -> dict:
        common = tuple(os.path.commonprefix(prefixes)) if prefixes else ()
        return {"op": op, "model": model, "prefix": list(_hex_block_hashes(common, int(config.get("engine.block-size")))),
                "prompt_tokens": sum(len(p) for p in prefixes), "max_tokens": max_tokens * shard, "shard": shard}

    def _lower_simple(self, node: Node, op: str, fn, *params) -> None:
        todo, item_hashes = self._plan_items(node)
        all_items = items(self.g, node)
        for shard in self._shards(node, todo):
            key = f"{op}-{self._shard_token(node, item_hashes, shard)}"
            resolved, deps = self._deps_for([all_items[i] for i in shard])
            args = [r[0] if len(r) == 1 else tuple(r) for r in resolved]
            self._add(op, key, Task(key, fn, key, *params, args, *deps),
                      {"op": op, "model": params[0], "shard": len(shard)})
            self._place(node, item_hashes, shard, key)
        self._fill_duplicates(node, item_hashes)

    def _lower_embed(self, node: Node) -> None:
        self._lower_simple(node, "embed", tasks.run_embed, node.params["model"])

    def _lower_rerank(self, node: Node) -> None:
        self._lower_simple(node, "rerank", tasks.run_rerank, node.params["model"], node.params["k"])

    def _lower_search(self, node: Node) -> None:
        index, k = node.params["index"], node.params["k"]
        todo, item_hashes = self._plan_items(node)
        all_items = items(self.g, node)
        for shard in self._shards(node, todo):
            token = self._shard_token(node, item_hashes, shard, index.fingerprint, k)
            resolved, deps = self._deps_for([all_items[i] for i in shard])
            args = [r[0] for r in resolved]
            shard_keys = []
            for s, worker in enumerate(index.workers):
                key = f"search-{token}-shard{s}"
                self._add("search", key, Task(key, tasks.run_search, key, index.name, s, k, args, *deps),
                          {"op": "search", "index": index.name, "shard": len(shard), "index_shard": s})
                self.pinned[key] = [worker]
                shard_keys.append(key)
            key = f"search-{token}"
            self._add("merge", key, Task(key, tasks.merge_search, k, *[TaskRef(sk) for sk in shard_keys]))
            self._place(node, item_hashes, shard, key)
        self._fill_duplicates(node, item_hashes)

    def _output(self, node: Node) -> None:
        """The task holding a node's value. Its key is the node's key plus a token of what it
        depends on: the same node planned differently (other passes, a result-cache hit) is a
        different task, so Dask never sees one key with two specs (which it may deadlock on)."""
        spec, deps = self._deps_for([[Dyn(node, i)] for i in range(node.n)])
        parts = [p[0] for p in spec] if node.batched else (spec[0][0],)
        plan = stable_hash(sorted(str(d.key) for d in deps), None if deps else hashes(self.g, node))
        key = f"{node.key}-{plan[:10]}"
        self._add("output", key, Task(key, tasks.assemble, parts, *deps))
        self.outputs[node.key] = key
        if cacheable(node):
            _pending_results[node.key] = (hashes(self.g, node), node.batched)


@functools.lru_cache(maxsize=65536)
def _hex_block_hashes(tokens: tuple[int, ...], block: int) -> tuple[str, ...]:
    return tuple(format(h, "x") for h in block_hashes(tokens, block))


def prefill_lower_bound(prompts) -> int:
    """Distinct tokens in the prefix tree of all prompts (per model): no run can prefill fewer."""
    total, previous = 0, None
    for model, tokens in sorted(prompts):
        if previous is not None and previous[0] == model:
            shared = len(os.path.commonprefix([previous[1], tokens]))
        else:
            shared = 0
        total += len(tokens) - shared
        previous = (model, tokens)
    return total


class _Pending(dict):
    """Output key -> item hashes, so results can be remembered when they come back (bounded)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > 10_000:
            del self[next(iter(self))]


_pending_results: dict[str, tuple[list[str], bool]] = _Pending()


def remember(key: str, value) -> None:
    if not config.get("rewrite.result-cache"):
        return
    pending = _pending_results.pop(key, None)
    if pending is None:
        return
    item_hashes, batched = pending
    values = value if batched else [value]
    for h, v in zip(item_hashes, values):
        RESULTS.put(h, v)


__all__ = ["BATCHABLE_OPS", "Lowered", "lowered", "optimize", "overrides", "plan", "remember", "tokenizer_for"]
