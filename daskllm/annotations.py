"""The contract between the graph side and the scheduler side: what placement knows about a task.

Every lowered task placement should see carries one ``daskllm`` annotation, a
:class:`TaskAnnotation` serialized as a plain dict (it travels with the graph, msgpack).
Nothing else couples the planner to the placement plugin: it never reads key names.
"""

from __future__ import annotations

from dataclasses import dataclass

# The lowered task types, as annotations and usage records name them (the ops modules lower to them).
PREFILL_TASK = "prefill"  # warms an engine's prefix cache; its decodes should run where it ran
DECODE_TASK = "decode"  # generates from prompts whose prefix may be cached
EMBED_TASK = "embed"
SEARCH_TASK = "search"  # one per index shard, pinned to the worker holding it
RERANK_TASK = "rerank"
PMAP_TASK = "pmap"  # runs an item's stages and submits their work from the worker


@dataclass(frozen=True, slots=True)
class TaskAnnotation:
    """What placement knows about one lowered task.

    ``op``: the lowered task type (prefill, decode, embed, search, rerank); ``engine``: the
    engine kind that runs it (llm, embed, rerank), or None for a task pinned by data (an
    index shard); ``prefix``: the hex block-hash chain of the prompt prefix the task's calls
    share; ``prompt_tokens``/``max_tokens``: its work estimate; ``shard``: calls in the task.
    It travels as a plain dict (msgpack) in the graph's ``daskllm`` annotation. Only ``op`` is
    required (and ``model`` with an ``engine``): a field left out takes its default, so a task
    without an estimate is placed as no work, not read as malformed.
    """

    op: str
    engine: str | None = None
    model: str | None = None
    prefix: tuple[str, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0
    shard: int = 1
    index: str | None = None
    index_shard: int | None = None

    def as_dict(self) -> dict:
        # Field by field (its slots), not dataclasses.asdict: every value is a str, an int or
        # None but the prefix, which asdict would deep-copy only for it to become a list here.
        out = {k: v for k in self.__slots__ if (v := getattr(self, k)) is not None}
        out["prefix"] = list(self.prefix)
        return out

    @classmethod
    def from_dict(cls, value) -> TaskAnnotation:
        """Parse an annotation from the wire; ValueError naming the field if it is malformed."""
        if not isinstance(value, dict):
            raise ValueError(f"an annotation is a dict, got {type(value).__name__}")
        unknown = set(value) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"unknown annotation fields {sorted(unknown)}")
        if not isinstance(value.get("op"), str):
            raise ValueError(f"annotation field 'op' must be a str, got {value.get('op')!r}")
        for name in ("engine", "model", "index"):
            if value.get(name) is not None and not isinstance(value[name], str):
                raise ValueError(f"annotation field {name!r} must be a str, got {value[name]!r}")
        if value.get("engine") is not None and not isinstance(value.get("model"), str):
            raise ValueError("an annotation with an engine must name its model")
        for name in ("prompt_tokens", "max_tokens", "shard"):
            if not isinstance(value.get(name, 0), int) or isinstance(value.get(name), bool):
                raise ValueError(f"annotation field {name!r} must be an int, got {value.get(name)!r}")
        prefix = value.get("prefix", [])
        if not isinstance(prefix, (list, tuple)) or not all(isinstance(h, str) for h in prefix):
            raise ValueError(f"annotation field 'prefix' must be a list of str, got {prefix!r:.80}")
        return cls(**{**value, "prefix": tuple(prefix)})
