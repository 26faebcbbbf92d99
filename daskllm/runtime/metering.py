"""What a computation really did: calls requested vs executed, prefill tokens computed vs cached.

    with daskllm.usage() as u:
        results = dask.compute(*nodes)
    print(u)            # per op: calls requested / executed, tokens

Requested calls are counted at lowering (every call the graph asks for); executed calls
and tokens are what the tasks recorded on the workers that ran them (the engines' own
counts of cached prompt tokens), collected for exactly the task keys lowered inside the
block. The virtual vs physical cost LOTUS users asked for.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from distributed import default_client

from daskllm import config
from daskllm.annotations import DECODE_TASK, PMAP_TASK, PREFILL_TASK
from daskllm.ledger import ledger_records
from daskllm.ops.generate import GENERATE
from daskllm.ops.prefill import PREFILL
from daskllm.worker.host import PLUGIN_NAME, local_host
from daskllm.worker.usage import DATAFRAME, JOB_BOUND, JOB_HEAD, USAGE_TOPIC, TaskUsage

# Process-wide, not per context: Dask may lower a graph on another thread than the caller's.
_active: list[Usage] = []
_lock = threading.Lock()


@dataclass
class Usage:
    requested: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    executed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Calls answered from the persistent result store instead of executed, per op.
    from_cache: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    decode_tokens: int = 0
    tasks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Dataframe operators (ddf.llm.*): per operator, rows, distinct inputs, executed calls, failed ones.
    operators: dict[str, dict] = field(default_factory=dict)
    # Per LLM: prefill tokens computed and decode tokens (what the work cost, model by model).
    models: dict[str, dict] = field(default_factory=dict)
    # With daskllm.metering.prompt-blocks: the distinct tokens in the prefix tree of every
    # prompt decoded (block-granular), the least prefill any plan could do; else None.
    distinct_prompt_tokens: int | None = None
    # Table jobs (ddf.llm operators computed together): the least prefill their calls could
    # take, each shuffle partition's distinct full KV blocks plus each distinct prompt's partial
    # last block (a shared prefix's calls share a partition); None where none ran.
    prefix_bound: int | None = None
    # Where the block's wall time went: planning on this client (every plan made here, a
    # cached plan costing ~0), and per engine ("llm:tiny", ...) how many engines ran and the
    # seconds they spent in steps (the engines' own busy_seconds counters, summed).
    wall_seconds: float = 0.0
    planning_seconds: float = 0.0
    engines: dict[str, dict] = field(default_factory=dict)
    # The busiest single engine's busy seconds: the least time the engines needed, had nothing
    # else cost any (work spread over several engines overlaps, so it is not their sum).
    engine_seconds: float = 0.0
    task_keys: set = field(default_factory=set, repr=False)

    def time_split(self) -> dict[str, float]:
        """The block's wall time as planning on this client, engine time (the busiest engine
        computing) and the rest: submission, scheduling, task hops, results coming back and
        engines waiting for work. The rest is what orchestration cost beyond the model."""
        other = max(0.0, self.wall_seconds - self.planning_seconds - self.engine_seconds)
        return {"wall": self.wall_seconds, "planning": self.planning_seconds, "engines": self.engine_seconds,
                "other": other}

    def engine_busy(self) -> dict[str, float]:
        """Per engine, the fraction of the block's wall time its engines were computing."""
        return {name: e["busy_seconds"] / (e["count"] * self.wall_seconds) if self.wall_seconds else 0.0
                for name, e in self.engines.items()}

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_tokens_computed + self.prefill_tokens_cached

    def as_dict(self) -> dict:
        return {"requested": dict(self.requested), "executed": dict(self.executed), "from_cache": dict(self.from_cache),
                "prefill_tokens_computed": self.prefill_tokens_computed,
                "prefill_tokens_cached": self.prefill_tokens_cached, "decode_tokens": self.decode_tokens,
                "tasks": dict(self.tasks), "operators": dict(self.operators), "models": dict(self.models),
                "distinct_prompt_tokens": self.distinct_prompt_tokens, "prefix_bound": self.prefix_bound,
                "wall_seconds": self.wall_seconds,
                "planning_seconds": self.planning_seconds, "engines": dict(self.engines),
                "engine_seconds": self.engine_seconds, "time_split": self.time_split()}

    def __str__(self) -> str:
        ops = sorted(set(self.requested) | set(self.executed) | set(self.from_cache))
        lines = [f"{'op':<10}{'requested':>11}{'executed':>10}{'from cache':>12}"]
        lines += [f"{op:<10}{self.requested.get(op, 0):>11}{self.executed.get(op, 0):>10}"
                  f"{self.from_cache.get(op, 0):>12}" for op in ops]
        bound = "" if self.prefix_bound is None else f" (table jobs' distinct-prefix bound: {self.prefix_bound})"
        lines.append(f"prefill tokens: {self.prefill_tokens_computed} computed{bound}, {self.prefill_tokens_cached} "
                     f"from cache; decode tokens: {self.decode_tokens}")
        for name, stats in self.operators.items():
            lines.append(f"ddf.llm.{name}: {stats['rows']} rows, {stats['distinct']} distinct inputs, "
                         f"{stats['executed']} executed, {stats['from_cache']} from cache, {stats['failed']} failed")
        busy = ", ".join(f"{name} {e['count']} x {self.engine_busy()[name]:.0%}" for name, e in sorted(self.engines.items())
                         if e["busy_seconds"])
        split = self.time_split()
        lines.append(f"time: {split['wall']:.2f} s wall = {split['planning']:.2f} planning here + "
                     f"{split['engines']:.2f} engine (busiest) + {split['other']:.2f} other; "
                     f"engines busy: {busy or 'none'}")
        return "\n".join(lines)

    def _add_records(self, records: dict[str, TaskUsage], since: float) -> None:
        """Add up the records of tasks run since ``since`` (when the block started). A call a
        task took from the result store counts as executed when the task that computed it
        started inside the block: this run's own work, done by a try of the task whose worker died."""
        blocks: set = set()
        tails: dict = {}
        heads: dict = {}  # the table jobs' shared blocks: hash -> tokens
        for record in records.values():
            op = record.op
            redone = record.stored_since(since)
            if op in (DECODE_TASK, PREFILL_TASK) and record.model is not None:
                per_model = self.models.setdefault(record.model, {"prefill_tokens_computed": 0, "decode_tokens": 0,
                                                                  "distinct_prompt_tokens": None})
                per_model["prefill_tokens_computed"] += record.computed_tokens + redone.computed_tokens
                per_model["decode_tokens"] += record.decode_tokens + redone.decode_tokens
            for full, tail_hash, tail_len in record.prompt_blocks:
                blocks.update((record.model, h) for h in full)
                if tail_len:
                    tails[(record.model, tail_hash)] = tail_len
            if op == DECODE_TASK:
                self.executed[GENERATE.name] += record.calls + redone.calls
                self.from_cache[GENERATE.name] += record.from_cache - redone.calls
                self.prefill_tokens_computed += record.computed_tokens + redone.computed_tokens
                self.prefill_tokens_cached += record.cached_tokens + redone.cached_tokens
                self.decode_tokens += record.decode_tokens + redone.decode_tokens
            elif op == PREFILL_TASK:
                self.executed[PREFILL.name] += record.calls
                self.prefill_tokens_computed += record.computed_tokens
            elif op != DATAFRAME:
                self.executed[op] += record.calls
                self.from_cache[op] += record.from_cache
            if op in (PMAP_TASK, DATAFRAME):  # what the work it started asked for, lowered on a worker
                for child_op, n in record.requested.items():
                    self.requested[child_op] += n
            if op == DATAFRAME:
                stats = self.operators.setdefault(record.operator, {"rows": 0, "distinct": 0, "executed": 0,
                                                                    "from_cache": 0, "failed": 0})
                for k in ("rows", "distinct", "executed", "failed"):
                    stats[k] += getattr(record, k)
                # Distinct inputs its nested calls took from the result store (they are not executed),
                # less those this run computed (a task tried again after its worker died).
                cached = sum(records[c].from_cache - records[c].stored_since(since).calls
                             for c in record.children if c in records)
                stats["from_cache"] += cached
                if JOB_BOUND in record.extra:
                    self.prefix_bound = (self.prefix_bound or 0) + record.extra[JOB_BOUND]
                    heads.update((h, n) for h, n in record.extra.get(JOB_HEAD, ()))
                # Operator-specific figures (a cascade's): counts add up, the rest (thresholds) is kept.
                for k, v in record.extra.items():
                    if k in (JOB_BOUND, JOB_HEAD):
                        continue
                    stats[k] = stats.get(k, 0) + v if isinstance(v, int) else v
                stats["executed"] -= cached
        if self.prefix_bound is not None:
            self.prefix_bound += sum(heads.values())
        if blocks or tails:
            bs = config.get("engine.block-size")
            for model, per_model in self.models.items():
                per_model["distinct_prompt_tokens"] = (sum(bs for m, _ in blocks if m == model)
                                                       + sum(n for (m, _), n in tails.items() if m == model))
            self.distinct_prompt_tokens = len(blocks) * bs + sum(tails.values())


class usage:  # noqa: N801 - used like a function: ``with daskllm.usage() as u``
    def __enter__(self) -> Usage:
        self.result = Usage()
        self.busy_before = _engine_busy()
        self.started = time.time()
        with _lock:
            _active.append(self.result)
        return self.result

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self.result)
        records = _records(self.result.task_keys)
        # Dataframe operators run outside our lowering: their records are found by time.
        records.update(_records_since(self.started))
        self.result._add_records(_with_children(records), self.started)
        self.result.wall_seconds = time.time() - self.started
        before = self.busy_before
        for (where, name), seconds in _engine_busy().items():
            e = self.result.engines.setdefault(name, {"count": 0, "busy_seconds": 0.0})
            e["count"] += 1
            busy = seconds - before.get((where, name), 0.0)
            e["busy_seconds"] += busy
            self.result.engine_seconds = max(self.result.engine_seconds, busy)


def usage_since(started: float) -> Usage:
    """What the table jobs run since ``started`` did: their operators' records and the work they
    started, however many workers died meanwhile (what a progress bar ends on)."""
    used = Usage()
    used._add_records(_with_children(_records_since(started)), started)
    return used


def _engine_busy() -> dict[tuple[str, str], float]:
    """(worker, "kind:model") -> the engine's busy seconds so far: on every worker of the
    default client's cluster, or, without one, of the engines loaded in this process."""
    try:
        client = default_client()
    except ValueError:
        return {("local", name): s for name, s in _host_busy(local_host()).items()}
    return {(worker, name): s for worker, busy in client.run(_worker_engine_busy).items() for name, s in busy.items()}


def _host_busy(plugin) -> dict[str, float]:
    return {f"{kind}:{name}": getattr(engine.stats(), "busy_seconds", 0.0)
            for kind, engines in plugin.engines.items() for name, engine in engines.items()}


def _worker_engine_busy(dask_worker=None) -> dict[str, float]:
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    return _host_busy(plugin) if plugin is not None else {}


def _records_since(started: float, op: str = DATAFRAME) -> dict[str, TaskUsage]:
    """The records of ``op`` (dataframe operators) made since ``started``: in this process,
    and by tasks on workers, from the scheduler (a lost worker's records are there too)."""
    found = {k: v for k, v in list(local_host().usage.items()) if v.op == op and v.time >= started}
    try:
        client = default_client()
    except ValueError:
        return found
    kept = client.run_on_scheduler(ledger_records, since=started, op=op)
    if kept is None:  # a scheduler without daskllm's plugins: Dask's event log (its last 1,000 events)
        kept = {e["key"]: e["usage"] for _, e in client.get_events(USAGE_TOPIC)
                if e["usage"]["op"] == op and e["usage"]["time"] >= started}
    return _newest(found, kept)


def _newest(found: dict[str, TaskUsage], kept: dict[str, dict]) -> dict[str, TaskUsage]:
    """``found`` with ``kept``'s records (as they travelled) added: a key run more than once (the
    same work computed again, placed elsewhere) counts its newest record."""
    for key, usage in kept.items():
        record = TaskUsage.from_event(usage)
        if key not in found or record.time >= found[key].time:
            found[key] = record
    return found


def _with_children(records: dict[str, TaskUsage]) -> dict[str, TaskUsage]:
    """Add the records of work that pmap tasks and dataframe operators started (nested too)."""
    expanded: set = set()
    for _ in range(32):  # nesting depth
        parents = [k for k, r in records.items() if r.children and k not in expanded]
        expanded |= set(parents)
        new = {c for k in parents for c in records[k].children} - set(records)
        if not new:
            break
        records.update(_records(new))
    return records


def note_planning(seconds: float) -> None:
    """Called by the runtime: time spent planning (on this client) during the active blocks."""
    with _lock:
        for u in _active:
            u.planning_seconds += seconds


def note_lowering(lowered) -> None:
    """Called by the optimizer: count the calls a lowered graph asks for."""
    with _lock:
        active = list(_active)
    for u in active:
        for op, n in lowered.report.get("requested", {}).items():
            u.requested[op] += n
        for op, n in lowered.report.get("tasks", {}).items():
            u.tasks[op] += n
        u.task_keys |= set(lowered.task_keys())


def _records(keys: set) -> dict[str, TaskUsage]:
    """The records of the tasks ``keys``: in this process, and from the scheduler, which keeps
    every worker's (a scheduler without daskllm's plugins: from the workers still there)."""
    found = {k: v for k, v in local_host().usage.items() if k in keys}
    try:
        client = default_client()
    except ValueError:
        return found
    found = _newest(found, client.run_on_scheduler(ledger_records, keys=list(keys)) or {})
    # Keys the scheduler has no record of (it runs no ledger, a record could not travel, or the
    # task records nothing): asked of the workers still there.
    missing = [k for k in keys if k not in found]
    if missing:
        for records in client.run(_worker_records, keys=missing).values():
            found = _newest(found, records)
    return found


def _worker_records(keys, dask_worker=None) -> dict:
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    if plugin is None:
        return {}
    return {k: dataclasses.asdict(plugin.usage[k]) for k in keys if k in plugin.usage}
