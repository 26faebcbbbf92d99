"""The persistent result store: deterministic engine calls' results on disk, by content.

Every worker task that calls an engine (decode, embed) looks each call up here before
submitting it and writes each result right after computing it, so graphs and table jobs
share it, a second run of a job executes nothing, and a run that died resumes from what
its finished tasks wrote. A call's key is its content, never its place in a plan:

    key = sha256(model identity and engine numerics, exact prompt token ids (or text), every SamplingParams field)

The model identity is a digest of the model directory's files (weights, config, tokenizer),
computed once per process and remembered in the store by (path, size, mtime) of each file,
so a changed model never answers from an old one's results, plus the engine's numerics
(backend, dtype, device), so a GPU bf16 engine never answers for a CPU fp32 one. Only deterministic calls
(greedy, or sampled with a seed) are stored.

Values live in a ``diskcache.Cache`` (SQLite index plus files; safe across the processes of
one machine) at ``daskllm.result-store.path`` (default: ``<daskllm cache dir>/results``),
bounded by ``daskllm.result-store.size-limit`` bytes (least recently stored go first).
Each machine has its own store unless the path points at storage its workers share; diskcache
relies on SQLite locking, which network filesystems (NFS) may not honour, so a shared path
should be a local or cluster filesystem with working POSIX locks.

API (client and worker alike):

- :func:`open_store` -> :class:`ResultStore` or None (switched off)
- :func:`decode_key` / :func:`embed_key`, and ``store.get(key)`` / ``store.put(key, value)``
- :func:`is_stored` (model, prompt token ids, sampling) -> bool, without loading the value:
  what a cost preview asks
- :data:`STORED`: what the planner asks (``PlanOptions.stored``): which calls the store answers,
  so that a plan prefills no prefix for calls that will not run
- ``store.info()`` / ``store.clear()``: what ``daskllm cache info`` / ``clear`` print and do
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import diskcache

from daskllm import config
from daskllm.engines import SamplingParams
from daskllm.models import cache_dir, resolve

logger = logging.getLogger(__name__)

_MODEL_DIGESTS = "model-digest"  # entries remembering a model directory's digest, not results
_NUMERICS = "numerics"  # per model digest: the engines' numerics (backend, dtype, device) that stored results
_META = (_MODEL_DIGESTS, _NUMERICS)
_FORMAT = 2  # bump when a stored value's layout changes: old entries are then never read


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    """What a decode call's entry holds: enough to answer it and to count its tokens."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    # Per token, when the sampling params asked for them: its logprob, the likeliest tokens'.
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # What computing it cost, and when the task that computed it started: a later task of the
    # same run (its worker died) reads it from here, and the run still counts it as executed.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    task_started: float = 0.0


def default_path() -> pathlib.Path:
    return cache_dir() / "results"


def store_path() -> pathlib.Path:
    configured = config.get("result-store.path")
    return pathlib.Path(configured).expanduser() if configured else default_path()


class ResultStore:
    """A diskcache at ``path``: content key -> result."""

    def __init__(self, path: pathlib.Path, size_limit: int):
        self.path = pathlib.Path(path)
        self.size_limit = int(size_limit)
        self._cache = diskcache.Cache(str(self.path), size_limit=self.size_limit)
        self._digests: dict[tuple, str] = {}
        self._loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its files' digest
        self._lock = threading.Lock()

    def get(self, key: str):
        return self._cache.get(key)

    def get_many(self, keys: Sequence[str | None]) -> list:
        """The stored value of each key (None: not stored, or no key)."""
        return [None if k is None else self._cache.get(k) for k in keys]

    def put(self, key: str, value) -> None:
        self._cache.set(key, value)

    def __len__(self) -> int:
        """Entries (results and bookkeeping): changes whenever a result is written or removed."""
        return len(self._cache)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored, without reading its value."""
        return key in self._cache

    def model_identity(self, model_dir: str | os.PathLike) -> str:
        """A digest of every file under ``model_dir`` (names and bytes), remembered here by the
        files' (path, size, mtime), so only a new or changed model is read again."""
        root = pathlib.Path(model_dir).resolve()
        files = sorted(p for p in root.rglob("*") if p.is_file())
        stamp = tuple((str(p.relative_to(root)), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()])
        remembered_key = (_MODEL_DIGESTS, str(root), hashlib.sha256(repr(stamp).encode()).hexdigest())
        with self._lock:
            if remembered_key in self._digests:
                return self._digests[remembered_key]
        digest = self._cache.get(remembered_key)
        if digest is None:
            h = hashlib.sha256()
            for p in files:
                h.update(str(p.relative_to(root)).encode() + b"\0")
                with p.open("rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            digest = h.hexdigest()
            self._cache.set(remembered_key, digest)
        with self._lock:
            self._digests[remembered_key] = digest
        return digest

    def engine_identity(self, engine) -> str:
        """What decides an engine's tokens: its model files and its numerics (backend, dtype,
        device). A torch fp32 CPU worker and a vLLM bf16 GPU worker sharing one store path
        never answer for each other. The numerics are remembered per model for :func:`is_stored`."""
        digest, kind = self.loaded_identity(engine), numerics(engine)
        # Read from the store each time, not from memory: after a clear() (``daskllm cache clear``
        # while workers run) the record must be written again, or is_stored never finds results.
        if kind not in self._cache.get((_NUMERICS, digest), ()):
            with self._cache.transact():
                seen = tuple(self._cache.get((_NUMERICS, digest), ()))
                if kind not in seen:
                    seen = (*seen, kind)
                    self._cache.set((_NUMERICS, digest), seen)
        return f"{digest}|{kind}"

    def loaded_identity(self, engine) -> str:
        """:meth:`model_identity` of the files ``engine`` loaded, taken once per engine: its
        weights do not change after loading, and every decode task asks."""
        digest = self._loaded.get(engine)
        if digest is None:
            digest = self._loaded[engine] = self.model_identity(engine.path)
        return digest

    def identities(self, model_dir: str | os.PathLike) -> list[str]:
        """Every engine identity of this model that has stored results (any backend, dtype, device)."""
        digest = self.model_identity(model_dir)
        return [f"{digest}|{kind}" for kind in self._cache.get((_NUMERICS, digest), ())]

    def info(self) -> dict:
        """Location, entries (results), bytes on disk and the size limit."""
        entries = sum(1 for k in self._cache.iterkeys() if not (isinstance(k, tuple) and k[:1] and k[0] in _META))
        return {"path": str(self.path), "entries": entries, "size_bytes": self._cache.volume(),
                "size_limit": self.size_limit, "enabled": bool(config.get("result-store.enabled"))}

    def clear(self) -> int:
        """Remove every entry; how many there were."""
        return self._cache.clear()

    def close(self) -> None:
        self._cache.close()


_stores: dict[tuple[str, int], ResultStore] = {}
_stores_lock = threading.Lock()


def open_store(*, enabled: bool | None = None) -> ResultStore | None:
    """This process's store at the configured path, or None when the store is switched off
    (``daskllm.result-store.enabled: false``; ``enabled=True`` opens it regardless, e.g. for
    ``daskllm cache info``)."""
    if not (config.get("result-store.enabled") if enabled is None else enabled):
        return None
    key = (str(store_path()), int(config.get("result-store.size-limit")))
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ResultStore(pathlib.Path(key[0]), key[1])
        return store


def _sampling_fields(sampling: SamplingParams) -> list:
    # Every field, by name: a field added later (a grammar, ...) is part of the key without a change here.
    return [[f.name, repr(getattr(sampling, f.name))] for f in dataclasses.fields(sampling)]


def numerics(engine) -> str:
    """An engine's backend, dtype and device: the same weights give other tokens under others."""
    model = getattr(engine, "model", None)
    dtype = getattr(model, "dtype", None) or getattr(engine, "dtype", None) or getattr(engine, "options", {}).get("dtype")
    device = getattr(model, "device", None) or getattr(engine, "device", None)
    return f"{type(engine).__name__}:{dtype or 'default'}:{device or 'default'}"


def decode_key(identity: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> str | None:
    """A generation's content key; None for a call that is not deterministic (never stored)."""
    if not sampling.deterministic:
        return None
    payload = json.dumps(["decode", _FORMAT, identity, list(map(int, prompt_ids)), _sampling_fields(sampling)])
    return hashlib.sha256(payload.encode()).hexdigest()


def embed_key(identity: str, text: str) -> str:
    return hashlib.sha256(json.dumps(["embed", _FORMAT, identity, text]).encode()).hexdigest()


def is_stored(model: str, prompt_ids: Sequence[int], sampling: SamplingParams,
              store: ResultStore | None = None) -> bool:
    """Whether a generation's result is in the store (of this machine's configured path),
    without loading it: for cost previews. False when the store is off."""
    return are_stored(model, [prompt_ids], sampling, store)[0]


def are_stored(model: str, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
               store: ResultStore | None = None) -> list[bool]:
    """:func:`is_stored` for many prompts: the model's identities are looked up once, not per prompt."""
    store = store if store is not None else open_store()
    if store is None:
        return [False] * len(prompts)
    return list(_stored(store, model, prompts, sampling))


def _stored(store: ResultStore, model: str, prompts: Iterable[Sequence[int]], sampling: SamplingParams) -> Iterator[bool]:
    """Lazily, per prompt: whether any engine identity of ``model`` has its result stored."""
    identities = store.identities(resolve(model))
    for ids in prompts:
        yield any(key is not None and store.contains(key)
                  for key in (decode_key(identity, ids, sampling) for identity in identities))


class StoredCalls:
    """The planner's view of this machine's store (:class:`daskllm.plan.context.StoredLookup`).

    ``version`` changes as results are written or removed (the store's entry count), so a plan
    made before a run's results were stored is not reused after. Lookups never raise: a
    broken or missing store, or a model this process cannot resolve, answers "not stored"
    (the cache is never a correctness dependency: the plan then only prefills more)."""

    @property
    def version(self) -> int:
        try:
            store = open_store()
            return -1 if store is None else len(store)
        except Exception:  # noqa: BLE001
            return -1

    def stored(self, model: str, sampling: SamplingParams, prompts: Sequence[Sequence[int]]) -> Iterator[bool]:
        """Lazily (the planner stops at the first call it must run), per prompt: stored or not."""
        answers = self._answers(model, sampling, prompts)
        for _ in prompts:
            yield next(answers, False)

    def _answers(self, model: str, sampling: SamplingParams, prompts: Sequence[Sequence[int]]) -> Iterator[bool]:
        try:
            store = open_store()
            if store is not None and sampling.deterministic:
                yield from _stored(store, model, prompts, sampling)
        except Exception as exc:  # noqa: BLE001
            logger.debug("result store lookup for planning failed: %s", exc)

    def __reduce__(self):  # one per process: a plan's options travel without it
        return (_stored_calls, ())


def _stored_calls() -> StoredCalls:
    return STORED


STORED = StoredCalls()
