"""The planner's typed inputs and the decisions passes record.

Planning is a pure function of the requested nodes, a :class:`PlanOptions` and a
:class:`ClusterView`. The runtime takes both once per submission (from dask config and one
question to the scheduler) and they are part of the plan-cache key, so a plan never
outlives the settings or the workers it was made for. Passes record what they decide about
a node in its :class:`NodePlan` (one frozen record per node, replaced, never mutated) and
what they did in the plan's report, which :func:`daskllm.explain` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import networkx as nx

from daskllm.models import model_name
from daskllm.plan.ir import Node


class ResultLookup(Protocol):
    """Remembered results by call hash (:class:`daskllm.worker.results.ResultStore`)."""

    version: int

    def get(self, key: str) -> Any: ...

    def __len__(self) -> int: ...


class StoredLookup(Protocol):
    """Which deterministic generations the persistent result store answers
    (:data:`daskllm.worker.store.STORED`): their tasks will not run them, so no prefill is
    needed for them. ``version`` changes with the store's contents."""

    version: int

    def stored(self, model: str, sampling: Any, prompts: Sequence[Sequence[int]]) -> Iterator[bool]: ...


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the planner may know about the cluster, frozen at submission: which workers hold
    which models. Resident prefixes and load change by the millisecond and are the placement
    plugin's business, on the scheduler; none of it is a planning input.

    ``holders``: ``((engine kind, model name), number of workers holding it)``, sorted.
    ``on_cluster``: work runs on a distributed cluster (streams need one; the local
    schedulers compute pmaps over finished lists). ``step_seconds``: ``(model name, seconds
    per decode step)``, sorted: its holders' fastest so far (a decode's time per token on an
    engine with nothing else to do), rounded to a power of two so that the view, part of
    every plan's cache key, seldom changes.
    """

    on_cluster: bool = False
    holders: tuple[tuple[tuple[str, str], int], ...] = ()
    reporting: int = 0  # workers that report daskllm engines at all
    step_seconds: tuple[tuple[str, float], ...] = ()
    contexts: tuple[tuple[str, int], ...] = ()  # (model name, the smallest context length of its holders)

    def decode_seconds(self, model: str, tokens: int) -> float | None:
        """About how long decoding ``tokens`` tokens of ``model`` takes at best on its holders;
        None: not measured yet."""
        step = dict(self.step_seconds).get(model_name(model))
        return None if step is None else step * tokens

    def context(self, model: str) -> int | None:
        """The most tokens (prompt and output) every holder of ``model`` takes; None: not reported."""
        return dict(self.contexts).get(model_name(model))

    def holding(self, model: str, kind: str = "llm") -> int:
        """Workers holding ``model`` (by recipe name or path); at least 1, so shard sizes stay defined."""
        return max(1, dict(self.holders).get((kind, model_name(model)), 0))

    def held(self) -> dict[str, dict[str, int]]:
        """engine kind -> model -> workers holding it."""
        out: dict[str, dict[str, int]] = {}
        for (kind, model), count in self.holders:
            out.setdefault(kind, {})[model] = count
        return out


LOCAL = ClusterView()


@dataclass(frozen=True)
class PlanOptions:
    """The rewrite settings of one computation (``daskllm.rewrite.*`` and the block size).

    ``results`` is where the ``cache`` pass looks calls up (compared by its ``version``);
    ``stored`` is where the ``prefix`` pass asks which calls the result store answers (its
    ``version`` is part of the cache key only where that pass runs);
    ``submit_nested`` is the runtime's function a pmap task uses on its worker to plan and
    submit the work its items return (handed down, so the planner imports no runtime).
    """

    passes: tuple = ("cse", "cache", "prune", "parts", "prefix", "pipeline", "stage")
    granularity: str = "shard"
    stage_size: tuple[tuple[str, int], ...] = ()
    prefix_min_tokens: int = 16
    prefill_replicas: int | str = "auto"
    parts_calls_per_worker: int = 32
    stream_min_seconds: float = 0.5
    block_size: int = 16
    release_threads: bool = True  # tasks waiting on engines secede (``daskllm.rewrite.release-threads``)
    settings: tuple = ()  # every rewrite setting, as sorted items: travels with pmaps for their nested plans
    results: ResultLookup | None = field(default=None, compare=False)
    stored: StoredLookup | None = field(default=None, compare=False)
    submit_nested: Callable | None = field(default=None, compare=False)

    @property
    def cache_key(self) -> tuple:
        return (self.passes, self.granularity, self.stage_size, self.prefix_min_tokens, self.prefill_replicas,
                self.parts_calls_per_worker, self.stream_min_seconds, self.block_size, self.release_threads,
                self.settings, self.results.version if self.results is not None else None,
                self.stored.version if self.stored is not None and "prefix" in self.passes else None)

    @classmethod
    def from_settings(cls, rewrite: Mapping, block_size: int, **extra) -> PlanOptions:
        """From the ``daskllm.rewrite`` config section (a mapping of its keys)."""
        passes = tuple(rewrite.get("passes", cls.passes))
        if not rewrite.get("result-cache", True):
            passes = tuple(p for p in passes if p != "cache")
        return cls(passes=passes, granularity=rewrite.get("granularity", "shard"),
                   stage_size=tuple(sorted((op, int(n)) for op, n in (rewrite.get("stage-size") or {}).items() if n)),
                   prefix_min_tokens=int(rewrite.get("prefix-min-tokens", 16)),
                   prefill_replicas=rewrite.get("prefill-replicas", "auto"),
                   parts_calls_per_worker=int(rewrite.get("parts-calls-per-worker", 32)),
                   stream_min_seconds=float(rewrite.get("stream-min-seconds", 0.5)), block_size=int(block_size),
                   release_threads=bool(rewrite.get("release-threads", True)),
                   settings=tuple(sorted((k, _frozen(v)) for k, v in rewrite.items())), **extra)

    def stage_sizes(self) -> dict[str, int]:
        return dict(self.stage_size)


def _frozen(value):
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What the passes decided about one node.

    ``cached``: per call, its remembered result or None (cache pass). ``prefills``: per call,
    the prefill node its decode waits for, or None (prefix pass). ``replicas``: a shared
    prefill's copies, one per worker its calls need (prefix pass). ``shard_size``: calls per
    task (stage pass). ``fused``: (group, calls per task) when the stage pass consolidates this
    node's calls with other nodes' identical-kind calls into shared tasks. ``source``/``spec``/``args``: a pmap's source after fusing the pmaps
    feeding it, its fused spec and stage arguments; ``streamed``: it reads its source's
    stream (pipeline pass).
    """

    cached: tuple | None = None
    prefills: tuple | None = None
    replicas: int | None = None
    shard_size: int | None = None
    fused: tuple[int, int] | None = None
    source: Node | None = None
    spec: Any = None
    args: tuple = ()
    streamed: bool = False


@dataclass
class PlanState:
    """The plan being made: its outputs and inputs, the passes applied, and their report."""

    outputs: list[Node]
    options: PlanOptions
    view: ClusterView
    report: dict = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    dedupe: bool = False  # identical calls are one physical call (the cse pass)
    as_parts: bool = False  # the plan runs as parts, each in one worker task (the parts pass)


def state(graph: nx.DiGraph) -> PlanState:
    return graph.graph["state"]


def decision(graph: nx.DiGraph, node: Node) -> NodePlan:
    return graph.nodes[node].get("plan") or NodePlan()


def depths(graph: nx.DiGraph) -> dict[Node, int]:
    """Each node's depth, the longest path to it from a source, in topological order: a node
    never needs another of its depth, so nodes of one depth may share tasks."""
    depth: dict[Node, int] = {}
    for node in nx.topological_sort(graph):
        depth[node] = max((depth[p] + 1 for p in graph.predecessors(node)), default=0)
    return depth


def decide(graph: nx.DiGraph, node: Node, **changes) -> NodePlan:
    """Record a pass's decision about ``node``."""
    plan = dataclasses.replace(decision(graph, node), **changes)
    graph.nodes[node]["plan"] = plan
    return plan
