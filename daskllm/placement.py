"""The scheduler plugin: places LLM tasks with model, cache and load locality.

In ``update_graph`` (which runs before Dask places anything) :class:`PlacementPlugin` reads
each task's ``daskllm`` annotation and decides its worker:

* **model**: only workers holding the model (advertised in their heartbeat metrics and
  ``daskllm`` events) are candidates; with none, the task fails with an error naming the
  model instead of waiting forever.
* **cache**: a shadow of each worker's prefix cache (block hash chains: what the workers
  report, plus what this plugin has already sent there) gives the tokens a worker would
  serve from cache; a decode goes where its prefill went.
* **load**: a call follows the cache while the worker it would join is within
  ``balance-tokens`` (or ``balance-ratio`` x the mean) of the least loaded one; past that,
  each candidate scores ``cached tokens saved - load_weight x queued tokens`` (SGLang-router
  style): prefix affinity alone would pile one system prompt's calls onto one engine. Prefills of a popular prefix are replicated at lowering and land on
  different workers here, and their consumers spread with them (Halo's replication).
* **order**: priorities run deeper tasks first and calls sharing a prefix back to back
  (Teola's topology-aware batching), so a cached prefix is used before it is evicted.

The chosen worker becomes a hard restriction, which also keeps work stealing from moving
a task away from its cache; when a worker leaves, its tasks are re-placed (so no task is
ever stranded). Policies for ablations: ``cache_aware`` (default), ``round_robin``,
``least_loaded``, ``prefix_affinity`` and ``off`` (plain Dask). A fault in the plugin is
logged to the ``daskllm-placement`` event topic and leaves those tasks to plain Dask.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter, defaultdict, deque
from typing import NamedTuple

from dask._task_spec import Task
from distributed import SchedulerPlugin

from daskllm import config
from daskllm.annotations import DECODE_TASK, PREFILL_TASK, TaskAnnotation
from daskllm.models import model_name

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskllm-placement"
POLICIES = ("cache_aware", "round_robin", "least_loaded", "prefix_affinity", "off")
EVENT_TOPIC = "daskllm-placement"


class NoWorkerForModel(RuntimeError):
    pass


class Placed(NamedTuple):
    """A task this plugin placed and that has not finished."""

    worker: str
    tokens: int  # the work it adds to the worker's queue
    model: str
    prefix: list[str]
    op: str  # its annotation's op: a decode follows its dependency whose op is prefill


def _raise(message: str):
    raise NoWorkerForModel(message)


class PlacementPlugin(SchedulerPlugin):
    name = PLUGIN_NAME

    def __init__(self, policy: str | None = None, load_weight: float | None = None, block_size: int | None = None):
        self.policy = policy or config.get("placement.policy")
        if self.policy not in POLICIES:
            raise ValueError(f"placement policy must be one of {POLICIES}, got {self.policy!r}")
        self.load_weight = float(load_weight if load_weight is not None else config.get("placement.load-weight"))
        self.block_size = int(block_size or config.get("engine.block-size"))
        self.balance_tokens = int(config.get("placement.balance-tokens"))
        self.balance_ratio = float(config.get("placement.balance-ratio"))
        # The shadow of each worker's prefix cache: what it last reported, plus the prefixes of
        # tasks placed there that have not finished (so not yet in a report).
        self.reported: dict[str, dict[str, set[str]]] = defaultdict(dict)  # worker -> model -> hashes
        self.inflight: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
        self.queued: Counter[str] = Counter()  # worker -> tokens placed there and not finished
        self.placed: dict[object, Placed] = {}  # key -> where it went
        self.advertised: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # worker->kind->models
        self.decisions: Counter[str] = Counter()  # why tasks went where they went (for the dashboard)
        self.recent: deque = deque(maxlen=1000)  # the last decisions in detail
        self._round_robin = itertools.count()
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    # --- what workers hold ----------------------------------------------------------------

    def log_event(self, topic, msg) -> None:
        if topic == "daskllm" and isinstance(msg, dict) and msg.get("action") == "engines-loaded":
            for kind, names in (msg.get("models") or {}).items():
                self.advertised[msg["worker"]][kind] = set(names)

    def _holders(self, scheduler, kind: str, model: str) -> list[str]:
        model = model_name(model)  # a task may name a model by path; workers by name
        out = []
        for address, ws in scheduler.workers.items():
            metrics = (ws.metrics or {}).get("daskllm") or {}
            held = set((metrics.get("models") or {}).get(kind, ())) | self.advertised[address][kind]
            if model in held:
                out.append(address)
        return sorted(out)

    def _refresh_shadow(self, scheduler) -> None:
        """Take in what workers report as resident (their last heartbeats): evictions included."""
        for address, ws in scheduler.workers.items():
            cache = ((ws.metrics or {}).get("daskllm") or {}).get("cache") or {}
            self.reported[address] = {model: set(hashes) for model, hashes in cache.items()}

    # --- the hook ------------------------------------------------------------------------------

    def update_graph(self, scheduler, *, tasks=(), annotations=None, stimulus_id=None, **kwargs) -> None:
        if self.policy == "off":
            return
        ours = (annotations or {}).get("daskllm") or {}
        if not ours:
            return
        try:
            self._refresh_shadow(scheduler)
            self._place(scheduler, ours)
        except Exception as exc:  # noqa: BLE001 - never take the scheduler down: plain Dask places these
            logger.exception("daskllm placement failed")
            scheduler.log_event(EVENT_TOPIC, {"action": "error", "error": repr(exc), "tasks": len(ours)})

    def _place(self, scheduler, raw: dict) -> None:
        tasks, parsed = {}, {}
        for key, ann in raw.items():
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state not in ("released", "waiting"):
                continue
            try:
                parsed[key] = TaskAnnotation.from_dict(ann)
            except (TypeError, ValueError) as exc:
                scheduler.log_event(EVENT_TOPIC, {"action": "malformed-annotation", "key": str(key),
                                                  "annotation": repr(ann)[:200], "error": str(exc)})
                self.decisions["fallback"] += 1
                continue
            tasks[key] = ts
        ours = parsed
        depth = _depths(tasks)
        order = sorted(tasks, key=lambda k: (depth[k], tasks[k].priority))  # dependencies before dependents
        self._plan = self._plan_prefix_groups(scheduler, [k for k in order if k in tasks], tasks, ours) \
            if self.policy == "cache_aware" else {}
        for key in order:
            self._unpin_departed(scheduler, key, tasks[key])
            if ours[key].engine is not None:
                self._place_one(scheduler, key, tasks[key], ours[key])
        self._plan = {}
        self._prioritize(tasks, ours, depth)

    def _plan_prefix_groups(self, scheduler, order: list, tasks: dict, ours: dict) -> dict:
        """Place decodes that share a first block as groups (Halo-style consolidation).

        Placing calls one by one, a greedy rule sees the other workers idle while it places
        the first prefix's calls and spills them everywhere. Here each group goes, largest
        first, to the worker already holding its prefix or else the least loaded, up to a
        fair share of the update's work; a group bigger than that is split over workers.
        """
        groups: dict[tuple[str, str], list] = defaultdict(list)
        for key in order:
            ann = ours[key]
            prefix = ann.prefix
            fed_by_prefill = any(d.key in ours and ours[d.key].op == PREFILL_TASK for d in tasks[key].dependencies)
            if ann.op == DECODE_TASK and prefix and not fed_by_prefill:
                groups[(ann.model, prefix[0])].append(key)
        plan: dict = {}
        by_model: dict[str, list] = defaultdict(list)
        for (model, _), keys in groups.items():
            by_model[model].append(keys)
        for model, model_groups in by_model.items():
            candidates = self._holders(scheduler, "llm", model)
            if len(candidates) < 2:
                continue
            load = {w: float(self.queued[w]) for w in candidates}
            holds: dict[str, set[str]] = {w: set() for w in candidates}
            # What a group's calls really share: the common part of their prefix chains.
            shared = {keys[0]: len(os.path.commonprefix([ours[k].prefix for k in keys])) * self.block_size
                      for keys in model_groups}
            group_of = {k: keys[0] for keys in model_groups for k in keys}

            def cost(key, w):
                ann = ours[key]
                cached = self._cached_tokens(w, model, ann.prefix)
                if ann.prefix[0] in holds[w]:
                    cached = max(cached, shared[group_of[key]])
                return max(ann.shard, ann.prompt_tokens + ann.max_tokens - ann.shard * cached)

            def reused(key):  # a call's work once its worker holds the group's prefix
                ann = ours[key]
                return max(ann.shard, ann.prompt_tokens + ann.max_tokens - ann.shard * shared[group_of[key]])

            total = sum(cost(keys[0], candidates[0]) + sum(reused(k) for k in keys[1:]) for keys in model_groups)
            cap = (sum(load.values()) + total) / len(candidates) * (1 + self.balance_ratio)
            for keys in sorted(model_groups, key=len, reverse=True):
                prefix = ours[keys[0]].prefix
                pending = list(keys)
                while pending:
                    # The worker holding the prefix while it has room, else the least loaded;
                    # every round places at least one call, so this always ends.
                    holder = max(candidates, key=lambda w: (prefix[0] in holds[w] or
                                                            self._cached_tokens(w, model, prefix) > 0, -load[w]))
                    w = holder if load[holder] + cost(pending[0], holder) <= cap else \
                        min(candidates, key=lambda x: load[x])
                    while True:
                        key = pending.pop(0)
                        load[w] += cost(key, w)
                        holds[w].add(prefix[0])
                        plan[key] = w
                        if not pending or load[w] + cost(pending[0], w) > cap:
                            break
        return plan

    def _unpin_departed(self, scheduler, key, ts) -> None:
        """A task pinned only to workers that have left (planned before they died: an index
        shard's holder, a sticky pmap's worker) would wait forever: it runs elsewhere instead,
        and data it needs there fails at once naming what is missing (e.g. the shard)."""
        if ts.worker_restrictions and not ts.loose_restrictions \
                and not any(w in scheduler.workers for w in ts.worker_restrictions):
            scheduler.log_event(EVENT_TOPIC, {"action": "unpinned", "key": str(key),
                                              "departed": sorted(ts.worker_restrictions)})
            ts.worker_restrictions = None
            self.decisions["unpinned"] += 1

    def _place_one(self, scheduler, key, ts, ann: TaskAnnotation) -> None:
        kind, model = ann.engine, ann.model
        candidates = self._holders(scheduler, kind, model)
        if not candidates:
            message = f"no worker holds the {kind} model {model!r} (task {key})"
            ts.run_spec = Task(key, _raise, message)
            scheduler.log_event(EVENT_TOPIC, {"action": "no-worker-for-model", "key": str(key), "model": model})
            self.decisions["no_model"] += 1
            return
        if ts.worker_restrictions:  # the user's (e.g. a sticky pmap): choose among those
            allowed = [w for w in candidates if w in ts.worker_restrictions]
            if not allowed:
                self.decisions["user"] += 1
                return
            candidates = allowed
        prefix = list(ann.prefix)
        calls = ann.shard
        # An embed's or rerank's inputs are known only when it runs: its calls are its work, so
        # two such tasks fed by one worker's output still go to different engines.
        tokens = max(calls, ann.prompt_tokens + ann.max_tokens)
        worker, reason = self._choose(candidates, ann.op, model, prefix, tokens, ts, calls)
        if ann.op == DECODE_TASK:  # the work it adds there: what the cache does not serve
            tokens = max(calls, tokens - calls * self._cached_tokens(worker, model, prefix))
        ts.worker_restrictions = {worker}
        ts.loose_restrictions = False  # hard: stealing must not move it away; remove_worker re-places
        self._record(key, Placed(worker, tokens, model, prefix, ann.op))
        self.decisions[reason] += 1
        self.recent.append({"key": str(key), "op": ann.op, "worker": worker, "reason": reason,
                            "cached": {w: self._cached_tokens(w, model, prefix) for w in candidates},
                            "queued": {w: self.queued[w] for w in candidates}})

    def _choose(self, candidates: list[str], op: str, model: str, prefix: list[str], tokens: int, ts, calls: int):
        if len(candidates) == 1:
            return candidates[0], "model"
        planned = getattr(self, "_plan", {}).get(ts.key)
        if planned in candidates:
            return planned, "cache" if self._cached_tokens(planned, model, prefix) else "balance"
        if self.policy == "round_robin":
            return candidates[next(self._round_robin) % len(candidates)], "balance"
        if self.policy == "least_loaded":
            return min(candidates, key=lambda w: (self.queued[w], w)), "balance"
        cached = {w: self._cached_tokens(w, model, prefix) for w in candidates}
        if op == PREFILL_TASK:
            # Copies of one prefix go to different workers (their consumers spread with them);
            # among the rest, where the prefix may already be (then it is nearly free), then load.
            coming = {w: bool(prefix) and all(self.inflight[w][model][h] for h in prefix) for w in candidates}
            reported = {w: self._reported_tokens(w, model, prefix) for w in candidates}
            return min(candidates, key=lambda w: (coming[w], -reported[w], self.queued[w], w)), "balance"
        # Every call of the shard reuses the prefix. Its own prefill's worker is credited with
        # the whole prefix: elsewhere that prefill would be wasted, whatever a (possibly stale)
        # report says.
        saved = {w: calls * cached[w] for w in candidates}
        prefill_workers = {self.placed[d.key].worker for d in ts.dependencies
                           if d.key in self.placed and self.placed[d.key].op == PREFILL_TASK}
        whole = calls * len(prefix) * self.block_size
        for w in prefill_workers & set(candidates):
            saved[w] = max(saved[w], whole) + whole  # the prefix it will hold, and the prefill not wasted
        deps = {w for d in ts.dependencies for w in (d.worker_restrictions or ())}
        affine = max(candidates, key=lambda w: (saved[w], w in deps, -self.queued[w]))
        if self.policy == "prefix_affinity":
            return affine, "cache" if saved[affine] else "balance"
        # SGLang-router style: follow the cache while the load stays balanced; past the
        # threshold, the score (tokens saved - queued tokens) decides, which sends work to
        # idle engines even if they must compute the prefix again.
        least = min(candidates, key=lambda w: (self.queued[w], w))
        mean = sum(self.queued[w] for w in candidates) / len(candidates)
        slack = max(self.balance_tokens, self.balance_ratio * mean)
        if saved[affine] and self.queued[affine] - self.queued[least] <= slack:
            return affine, "cache"
        chosen = max(candidates, key=lambda w: (saved[w] - self.load_weight * self.queued[w], w in deps,
                                                -self.queued[w]))
        return chosen, "cache" if saved[chosen] else "balance"

    def _reported_tokens(self, worker: str, model: str, prefix: list[str]) -> int:
        reported = self.reported.get(worker, {}).get(model, ())
        return next((i for i, h in enumerate(prefix) if h not in reported), len(prefix)) * self.block_size

    def _cached_tokens(self, worker: str, model: str, prefix: list[str]) -> int:
        reported = self.reported.get(worker, {}).get(model, ())
        coming = self.inflight[worker][model]
        n = 0
        for h in prefix:
            if h not in reported and not coming[h]:
                break
            n += 1
        return n * self.block_size

    def _prioritize(self, tasks: dict, ours: dict, depth: dict) -> None:
        """Deeper tasks first; among equals, calls sharing a prefix back to back."""
        if not tasks:
            return
        ranked = sorted(tasks, key=lambda k: (-depth[k], (ours[k].prefix or ("",))[0], tasks[k].priority))
        for rank, key in enumerate(ranked):
            ts = tasks[key]
            ts.priority = (*ts.priority[:-1], rank) if ts.priority else (0, 0, rank)

    # --- bookkeeping --------------------------------------------------------------------------

    def _record(self, key, placed: Placed) -> None:
        self.placed[key] = placed
        self.queued[placed.worker] += placed.tokens
        self.inflight[placed.worker][placed.model].update(placed.prefix)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish in ("memory", "erred", "forgotten") and key in self.placed:
            worker, tokens, model, prefix, _ = self.placed.pop(key)
            self.queued[worker] -= tokens
            if self.queued[worker] <= 0:
                del self.queued[worker]
            coming = self.inflight[worker][model]
            coming.subtract(prefix)
            for h in prefix:
                if coming[h] <= 0:
                    del coming[h]

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        """Take the worker that left out of every task's restrictions: no task is stranded.

        A task restricted to it alone, in any state (a released task may run again later),
        is re-placed on the least loaded worker holding its model, or left to plain Dask
        where none does; a task restricted to several workers keeps the others.
        """
        try:
            self.reported.pop(worker, None)
            self.inflight.pop(worker, None)
            self.advertised.pop(worker, None)
            self.queued.pop(worker, None)
            moved, runnable = 0, {}
            for ts in list(scheduler.tasks.values()):
                if not ts.worker_restrictions or worker not in ts.worker_restrictions:
                    continue
                remaining = ts.worker_restrictions - {worker}
                placed = self.placed.get(ts.key)
                if placed is not None and placed.worker == worker:
                    del self.placed[ts.key]  # its load there went with the worker
                else:
                    placed = None
                if not remaining:
                    target = self._replacement(scheduler, ts, worker)
                    remaining = {target} if target else set()
                    if target and placed is not None:  # its work is queued there now
                        self._record(ts.key, placed._replace(worker=target))
                ts.worker_restrictions = remaining or None
                moved += 1
                if ts.state == "no-worker":
                    runnable[ts.key] = "processing"  # stays no-worker if nothing can run it yet
            if runnable:
                scheduler.transitions(runnable, stimulus_id=kwargs.get("stimulus_id", "daskllm-replace"))
            if moved:
                scheduler.log_event(EVENT_TOPIC, {"action": "re-placed", "worker": worker, "tasks": moved})
        except Exception as exc:  # noqa: BLE001
            logger.exception("daskllm placement: remove_worker failed")
            scheduler.log_event(EVENT_TOPIC, {"action": "error", "error": repr(exc)})

    def _replacement(self, scheduler, ts, gone: str) -> str | None:
        """The least loaded worker holding the task's model; None for a task naming none."""
        try:
            ann = TaskAnnotation.from_dict((ts.annotations or {}).get("daskllm"))
        except (TypeError, ValueError):
            return None
        if ann.engine is None:
            return None
        holders = [w for w in self._holders(scheduler, ann.engine, ann.model) if w != gone]
        return min(holders, key=lambda w: (self.queued[w], w), default=None)


def _depths(tasks: dict) -> dict:
    """Longest chain of dependencies within this update, per task."""
    depth: dict = {}

    def visit(key) -> int:
        if key not in depth:
            depth[key] = 0  # guards cycles
            ts = tasks[key]
            depth[key] = 1 + max((visit(d.key) for d in ts.dependencies if d.key in tasks), default=-1)
        return depth[key]

    for key in tasks:
        visit(key)
    return depth


def set_policy(client, policy: str) -> None:
    """Switch the running placement plugin of ``client``'s scheduler to ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"placement policy must be one of {POLICIES}, got {policy!r}")

    def apply(dask_scheduler, policy):
        plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
        if plugin is None:
            raise LookupError("the scheduler runs no daskllm placement plugin")
        plugin.policy = policy

    client.run_on_scheduler(apply, policy=policy)
