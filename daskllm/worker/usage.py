"""What each task really executed, recorded on the worker that ran it, under its task key.

The records are what :func:`daskllm.usage` adds up: executed calls and the engines' own
counts of prompt tokens computed and served from cache, per task; a pmap or dataframe
operator also records the calls its nested plans asked for and the keys of the tasks it
started, so their records are found too.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field


DATAFRAME = "dataframe"  # the op of a ddf.llm operator's records (not a task type)
# The scheduler's event topic of every record: the scheduler keeps them (daskllm.ledger), so a
# record outlives the worker that made it.
USAGE_TOPIC = "daskllm-usage"
# A table job partition's record (``extra``): its calls' distinct-prefix bound in tokens, past
# the full KV blocks they all share, and those blocks ([hash, tokens] each; usage counts each once).
JOB_BOUND = "prefix_bound"
JOB_HEAD = "prefix_head"


@dataclass(frozen=True, slots=True)
class TaskUsage:
    """One task's record. ``op``: decode, prefill, embed, search, rerank, pmap or dataframe."""

    op: str
    time: float = field(default_factory=time.time)  # when it finished
    calls: int = 0
    model: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    decode_tokens: int = 0
    # With daskllm.metering.prompt-blocks, per decoded prompt: (full blocks' chained hashes,
    # hash of the partial last block, its length).
    prompt_blocks: tuple = ()
    streamed: bool = False  # a decode that sent its items to consumers as they were cut
    pairs: int = 0  # rerank: (query, document) pairs scored
    from_cache: int = 0  # calls answered from the persistent result store (not in ``calls``: not executed)
    # Those calls by the start time of the task that computed them: (started, calls, prompt tokens,
    # of which cached, decode tokens). One whose task started inside a usage block was computed
    # by that run (by a worker that died before its own record reached the scheduler).
    from_store: tuple[tuple[float, int, int, int, int], ...] = ()
    # pmap and dataframe operators: the work they started.
    requested: dict[str, int] = field(default_factory=dict)
    children: tuple[str, ...] = ()
    items: int = 0
    first_item_started: float | None = None
    # dataframe operators (ddf.llm.*)
    operator: str | None = None
    rows: int = 0
    distinct: int = 0
    executed: int = 0
    failed: int = 0
    started: float | None = None
    extra: dict = field(default_factory=dict)  # an operator's own figures (a cascade's rows per model)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed (not served from its cache)."""
        return self.prompt_tokens - self.cached_tokens

    def stored_since(self, since: float) -> StoredWork:
        """The calls it took from the result store that a task started at or after ``since``
        computed (this run's own work, done by an earlier try of this task), and their tokens."""
        groups = [g for g in self.from_store if g[0] >= since]
        return StoredWork(*(sum(g[i] for g in groups) for i in range(1, 5)))

    @classmethod
    def from_event(cls, usage: dict) -> TaskUsage:
        """A record as it travelled in a scheduler event (msgpack turned its tuples into lists)."""
        return cls(**{**usage, "children": tuple(usage.get("children", ())),
                      "prompt_blocks": tuple(tuple(b) for b in usage.get("prompt_blocks", ())),
                      "from_store": tuple(tuple(g) for g in usage.get("from_store", ()))})


@dataclass(frozen=True, slots=True)
class StoredWork:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class UsageLog(OrderedDict):
    """Task key -> :class:`TaskUsage`; the oldest entries go first past a bound."""

    def __init__(self, limit: int = 200_000):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)  # a task run again (same key) is the newest entry: the log stays in time order
        while len(self) > self.limit:
            self.popitem(last=False)
