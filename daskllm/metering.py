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

import threading
from collections import defaultdict
from dataclasses import dataclass, field

# Process-wide, not per context: Dask may lower a graph on another thread than the caller's.
_active: list[Usage] = []
_lock = threading.Lock()


@dataclass
class Usage:
    requested: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    executed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    decode_tokens: int = 0
    tasks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    task_keys: set = field(default_factory=set, repr=False)

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_tokens_computed + self.prefill_tokens_cached

    def as_dict(self) -> dict:
        return {"requested": dict(self.requested), "executed": dict(self.executed),
                "prefill_tokens_computed": self.prefill_tokens_computed,
                "prefill_tokens_cached": self.prefill_tokens_cached, "decode_tokens": self.decode_tokens,
                "tasks": dict(self.tasks)}

    def __str__(self) -> str:
        ops = sorted(set(self.requested) | set(self.executed))
        lines = [f"{'op':<10}{'requested':>11}{'executed':>10}"]
        lines += [f"{op:<10}{self.requested.get(op, 0):>11}{self.executed.get(op, 0):>10}" for op in ops]
        lines.append(f"prefill tokens: {self.prefill_tokens_computed} computed, {self.prefill_tokens_cached} "
                     f"from cache; decode tokens: {self.decode_tokens}")
        return "\n".join(lines)

    def _add_records(self, records: dict[str, dict]) -> None:
        for record in records.values():
            op = record["op"]
            if op != "prefill":
                self.executed["generate" if op == "decode" else op] += record.get("calls", 0)
            if op == "decode":
                self.prefill_tokens_computed += record["prompt_tokens"] - record["cached_tokens"]
                self.prefill_tokens_cached += record["cached_tokens"]
                self.decode_tokens += record["decode_tokens"]
            elif op == "prefill":
                self.executed["prefill"] += 1
                self.prefill_tokens_computed += record["computed_tokens"]
            elif op == "pmap":  # what its items' sub-pipelines asked for, lowered on a worker
                for child_op, n in record.get("requested", {}).items():
                    self.requested[child_op] += n


class usage:  # noqa: N801 - used like a function: ``with daskllm.usage() as u``
    def __enter__(self) -> Usage:
        self.result = Usage()
        with _lock:
            _active.append(self.result)
        return self.result

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self.result)
        self.result._add_records(_with_children(_records(self.result.task_keys)))


def _with_children(records: dict[str, dict]) -> dict[str, dict]:
    """Add the records of work that pmap tasks started (nested pmaps included)."""
    expanded: set = set()
    for _ in range(32):  # nesting depth
        parents = [k for k, r in records.items() if r.get("op") == "pmap" and k not in expanded]
        expanded |= set(parents)
        new = {c for k in parents for c in records[k].get("children", ())} - set(records)
        if not new:
            break
        records.update(_records(new))
    return records


def note_lowering(lowered) -> None:
    """Called by the optimizer: count the calls a lowered graph asks for."""
    with _lock:
        active = list(_active)
    for u in active:
        for op, n in lowered.report.get("requested", {}).items():
            u.requested[op] += n
        for op, n in lowered.report.get("tasks", {}).items():
            u.tasks[op] += n
        u.task_keys |= set(task_keys(lowered.graph))


def task_keys(graph) -> list:
    return [k for layer in graph.layers.values() for k in layer]


def _records(keys: set) -> dict[str, dict]:
    from daskllm.worker import local_host

    found = {k: v for k, v in local_host().usage.items() if k in keys}
    try:
        from distributed import default_client

        client = default_client()
    except ValueError:
        return found
    for records in client.run(_worker_records, keys=list(keys)).values():
        found.update(records)
    return found


def _worker_records(keys, dask_worker=None) -> dict:
    plugin = dask_worker.plugins.get("daskllm-engines") if dask_worker is not None else None
    if plugin is None:
        return {}
    return {k: plugin.usage[k] for k in keys if k in plugin.usage}
