"""What a worker runs for each planned task: prefill, decode, embed, search, rerank, pmap.

Each runs on a worker against its resident engines (or, outside a cluster, against
engines loaded in this process), takes a shard of items, and records what it really
executed under its own task key, for :func:`daskllm.usage`.

An item is a list of parts. A static part is a tuple of token ids, text, or a literal
value; a :class:`Ref` points at an item of an upstream task's output, which arrives as one
of the task's dependencies. An LLM call's item is ``(special, parts)``: its parts are
joined and tokenized whole, with the tokenizer's special tokens when ``special``.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_mod
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from daskllm import config
from daskllm.annotations import DECODE_TASK, EMBED_TASK, PREFILL_TASK, RERANK_TASK, SEARCH_TASK
from distributed import get_worker, secede
from distributed.worker import thread_state

from daskllm.engines import Completion, PrefillHandle, SamplingParams
from daskllm.engines.kv_cache import ROOT_HASH, block_hashes, hash_block
from daskllm.prompts import check_text, encode_parts, render_value
from daskllm.streaming.split import Splitter
from daskllm.streaming.stages import PmapSpec
from daskllm.streaming.wire import Source
from daskllm.worker import calls
from daskllm.worker.consumer import Consumer
from daskllm.worker.failures import NullInput, Origins, attempt, failed, merge, ok, raise_others
from daskllm.worker.host import get_engine, host, in_worker, task_priority, wait_requests
from daskllm.worker.indexes import merge_shards, search_shard
from daskllm.worker.store import ResultStore, StoredCompletion, decode_key, embed_key, open_store
from daskllm.worker.streams import StreamWriter, stream_decode
from daskllm.worker.usage import TaskUsage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ref:
    dep: int  # which dependency (position among the task's dependency arguments)
    pos: int | None  # item within that dependency's output list; None: the whole value


def _value(part, deps):
    if isinstance(part, Ref):
        value = deps[part.dep]
        return value if part.pos is None else value[part.pos]
    return part


def _input(part, deps):
    """A call's input value; a null one from upstream (a call that failed under
    ``on_error="null"``) fails this call too."""
    value = _value(part, deps)
    if value is None and isinstance(part, Ref):
        raise NullInput()
    return value


def _tokens(call, deps, engine) -> list[int]:
    """A prompt's ids: its upstream values rendered into its text, tokenized whole (as the
    client tokenized static prompts); ``call`` is ``(special, parts)``."""
    special, parts = call
    if len(parts) == 1 and isinstance(parts[0], tuple):  # tokenized on the client
        return list(parts[0])
    text = [render_value(_input(p, deps)) if isinstance(p, Ref) else p for p in parts]
    return list(encode_parts(text, special, lambda t, s: engine.tokenize(t, add_special_tokens=s)))


def off_thread(fn, *args, store: bool = True):
    """Run the task ``fn(*args)``, which mostly waits on its engine, without holding a slot of
    the worker's thread pool (Dask's ``secede``): the worker starts other tasks meanwhile and
    their requests join the same engine steps, so the engine's batch limit, not the thread
    count, bounds a batch. The scheduler counts the task as long-running. ``store=False``:
    this computation asked for no result caching (``result_cache=False``). A task computed in
    place (:func:`in_place`) keeps the slot of the task running it."""
    if getattr(thread_state, "key", None) is not None and not getattr(_task, "in_place", False):
        secede()  # a task thread on a worker
    return on_thread(fn, *args, store=store)


@contextlib.contextmanager
def in_place():
    """Tasks computed in this thread, inside the task that runs it (a table partition's calls),
    keep that task's slot: the scheduler sees one busy thread per partition, so it balances
    partitions over the workers (and their engines) as it balances any task."""
    _task.in_place = True
    try:
        yield
    finally:
        _task.in_place = False


_task = threading.local()


def on_thread(fn, *args, store: bool = True):
    """Run the task ``fn(*args)``; with ``store=False`` its calls neither read nor write the
    persistent result store."""
    _task.store_off = not store
    try:
        return fn(*args)
    finally:
        _task.store_off = False


def task_store() -> ResultStore | None:
    """The persistent result store for the running task's calls, or None (switched off)."""
    if getattr(_task, "store_off", False):
        return None
    try:
        return open_store()
    except Exception as exc:  # noqa: BLE001 - the store is never a correctness dependency
        logger.warning("result store unavailable, computing without it: %s", exc)
        return None


def _lookup_decodes(store: ResultStore | None, engine, prompts: list, sampling: SamplingParams):
    """Each prompt's content key (None: not stored) and stored result (None: not found)."""
    path = getattr(engine, "path", None)
    if store is None or path is None or not sampling.deterministic:
        return [None] * len(prompts), [None] * len(prompts)
    try:
        identity = store.engine_identity(engine)
        keys = [decode_key(identity, p, sampling) for p in prompts]
        return keys, store.get_many(keys)
    except Exception as exc:  # noqa: BLE001 - a broken store costs recomputation, never the call
        logger.warning("result store lookup failed, computing: %s", exc)
        return [None] * len(prompts), [None] * len(prompts)


def _store_when_done(store: ResultStore, key: str | None, future, task_started: float) -> None:
    """Write a call's result the moment it finishes, so a run killed later keeps it."""
    if key is None:
        return

    def put(f):
        if f.cancelled() or f.exception() is not None:
            return
        c = f.result()
        _put(store, key, StoredCompletion(c.text, tuple(c.token_ids), c.finish_reason, c.logprobs,
                                          c.top_logprobs, c.num_prompt_tokens, c.num_cached_tokens, task_started))

    future.add_done_callback(put)


def _stored_work(stored: list) -> tuple[tuple[float, int, int, int, int], ...]:
    """The calls found in the store, grouped by when the task that computed them started
    (:attr:`TaskUsage.from_store`): a few groups, however many calls."""
    groups: dict[float, list[int]] = {}
    for s in stored:
        if s is not None:
            g = groups.setdefault(s.task_started, [0, 0, 0, 0])
            g[0] += 1
            g[1] += s.prompt_tokens
            g[2] += s.cached_tokens
            g[3] += len(s.token_ids)
    return tuple((started, *g) for started, g in sorted(groups.items()))


def _record(task_key: str, op: str, **counters) -> None:
    host().record(task_key, TaskUsage(op, **counters))


def _record_decode(task_key: str, model: str, completions, **extra) -> None:
    if config.get("metering.prompt-blocks"):
        extra["prompt_blocks"] = tuple(prompt_blocks(c.prompt_token_ids) for c in completions)
    _record(task_key, DECODE_TASK, model=model, calls=len(completions),
            prompt_tokens=sum(c.num_prompt_tokens for c in completions),
            cached_tokens=sum(c.num_cached_tokens for c in completions),
            decode_tokens=sum(len(c.token_ids) for c in completions), **extra)


def prompt_blocks(token_ids) -> tuple[list[int], int, int]:
    """A prompt's shape in the prefix tree: its full blocks' chained hashes, and the hash and
    length of its partial last block (what a benchmark needs for the distinct-prefix bound)."""
    bs = config.get("engine.block-size")
    full = block_hashes(token_ids, bs)
    tail = list(token_ids[len(full) * bs:])
    return full, hash_block(full[-1] if full else ROOT_HASH, tail) if tail else 0, len(tail)


def run_decode(task_key: str, model: str, sampling: SamplingParams, origins: Origins, items: list,
               *deps) -> list[str | None]:
    """Generate for a shard of prompts together: they join the engine's batch in one step. A
    prompt that cannot run fails alone, as ``origins`` says."""
    started = time.time()
    engine = get_engine(model)
    prompts = attempt(lambda call: _tokens(call, deps, engine), items)
    runnable = ok(prompts)
    store = task_store()
    keys, stored = _lookup_decodes(store, engine, runnable, sampling)
    todo = [j for j, s in enumerate(stored) if s is None]
    futures = engine.submit_many([runnable[j] for j in todo], sampling, priority=task_priority(task_key)) if todo else []
    if store is not None:
        for j, f in zip(todo, futures):
            _store_when_done(store, keys[j], f, started)
    completions = raise_others(wait_requests(task_key, futures, return_exceptions=True) if todo else [])
    _record_decode(task_key, model, ok(completions), from_cache=len(runnable) - len(todo),
                   from_store=_stored_work(stored))
    values = [value(s, sampling) if s is not None else None for s in stored]
    for j, c in zip(todo, completions):
        values[j] = c if failed(c) else value(c, sampling)
    return origins.settle(merge(prompts, values))


def value(completion: Completion | StoredCompletion, sampling: SamplingParams):
    """A call's value: its text, or with ``sampling.logprobs`` a small record of the text, each
    generated token's log-probability, the tokens and why it ended (what a server's response needs)."""
    if sampling.logprobs is not None:
        return {"text": completion.text, "logprobs": list(completion.logprobs or ()),
                "top_logprobs": [dict(top) for top in completion.top_logprobs or ()],
                "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason}
    return completion.text


def run_decode_split(task_key: str, model: str, sampling: SamplingParams, split: Splitter, channels: list, items: list,
                     *deps) -> list[list]:
    """Generate and split each completion into items; with ``channels`` (the streamed
    consumers of each call), send every item to them the moment it is complete."""
    engine = get_engine(model)
    prompts = [_tokens(call, deps, engine) for call in items]
    writer = StreamWriter(task_key, channels) if any(channels) and in_worker() else None
    try:
        completions = stream_decode(task_key, engine, prompts, sampling, split, writer)
    finally:
        if writer is not None:
            writer.close()
    _record_decode(task_key, model, completions, streamed=writer is not None)  # its "time" is when the decode ended
    out = []
    for i, c in enumerate(completions):
        try:
            out.append(split.items(c.text, True))
        except ValueError as exc:
            raise ValueError(f"call {i} of {task_key}: {exc}") from None
    return out


def run_pmap(task_key: str, spec: PmapSpec, source: Source, calls: list, *deps) -> list[list]:
    """A pmap task: each item of each of its calls through the spec's stages; per call, its
    results in order. A call is ``(its number in the pmap, its items part, its stage argument
    parts, the ancestry frames of the item it was built for)``; streamed, the items parts are
    None: they come by queue."""
    resolved = []
    for number, source_part, arg_parts, ancestry in calls:
        items = None if source.producer_key else _value(source_part, deps)
        if items is not None and not isinstance(items, (list, tuple)):
            raise TypeError(f"{task_key}: pmap needs a list of items per call, got {type(items).__name__} "
                            f"(call {number})")
        resolved.append((number, None if items is None else list(items), [_value(p, deps) for p in arg_parts], ancestry))
    consumer = Consumer(task_key, spec, source, resolved)
    return consumer.run_distributed() if in_worker() else consumer.run_local()


def first(value, *_):
    """The first argument; the others are dependencies that must finish too."""
    return value


def run_prefill(task_key: str, model: str, call, *deps) -> PrefillHandle:
    """Put a prefix in this worker's cache; returns a small handle, never KV tensors."""
    engine = get_engine(model)
    handle = engine.prefill(_tokens(call, deps, engine))
    _record(task_key, PREFILL_TASK, model=model, calls=1, prompt_tokens=handle.num_tokens,
            cached_tokens=handle.num_cached_tokens)
    return handle


def run_prefill_many(task_key: str, model: str, prefixes: list, record_key: str | None = None) -> list[PrefillHandle]:
    """Put several known prefixes (a decode shard's partial prompts) in this worker's cache at
    once (in one engine step, where they fit its token budget). ``record_key``: where a task
    prefills several times, each time's usage record (default: the task's)."""
    engine = get_engine(model)
    handles = wait_requests(task_key, [engine.submit_prefill(list(p)) for p in prefixes])
    _record(record_key or task_key, PREFILL_TASK, model=model, calls=len(handles),
            prompt_tokens=sum(h.num_tokens for h in handles), cached_tokens=sum(h.num_cached_tokens for h in handles))
    return handles


def run_embed(task_key: str, model: str, origins: Origins, items: list, *deps) -> list[np.ndarray | None]:
    texts = attempt(lambda part: check_text(render_value(_input(part, deps))), items)
    runnable = ok(texts)
    store = task_store()
    keys, vectors = _lookup_embeds(store, model, runnable)
    todo = [j for j, v in enumerate(vectors) if v is None]
    computed = calls.embed(model, [runnable[j] for j in todo]) if todo else []
    for j, vector in zip(todo, computed):
        vectors[j] = vector
        if keys[j] is not None:
            _put(store, keys[j], vector)
    _record(task_key, EMBED_TASK, calls=len(todo), from_cache=len(runnable) - len(todo))
    return origins.settle(merge(texts, vectors))


def _lookup_embeds(store: ResultStore | None, model: str, texts: list[str]):
    """Each text's content key (None: not stored) and stored vector (None: not found)."""
    engine = get_engine(model, "embed") if store is not None else None
    if getattr(engine, "path", None) is None:
        return [None] * len(texts), [None] * len(texts)
    try:
        identity = store.engine_identity(engine)
        keys = [embed_key(identity, t) for t in texts]
        return keys, store.get_many(keys)
    except Exception as exc:  # noqa: BLE001 - a broken store costs recomputation, never the call
        logger.warning("result store lookup failed, computing: %s", exc)
        return [None] * len(texts), [None] * len(texts)


def _put(store: ResultStore, key: str, value) -> None:
    try:
        store.put(key, value)
    except Exception as exc:  # noqa: BLE001
        logger.warning("result store write failed: %s", exc)


def run_search(task_key: str, index_name: str, shard: int, k: int, items: list, *deps) -> list:
    """One index shard's hits per query; a query that cannot be searched keeps its failure
    in its slot, for :func:`merge_search` to settle."""
    vectors = attempt(lambda part: np.asarray(_input(part, deps), dtype=np.float32), items)
    runnable = ok(vectors)
    hits = search_shard(index_name, shard, np.stack(runnable), k) if runnable else []
    _record(task_key, SEARCH_TASK, calls=len(runnable))
    return merge(vectors, hits)


def merge_search(origins: Origins, k: int, *per_shard: list) -> list:
    """Each query's top ``k`` over every shard's hits (the shards saw the same queries, and
    the same ones failed)."""
    first = per_shard[0]
    runnable = [j for j, hits in enumerate(first) if not failed(hits)]
    merged = merge_shards(k, *[[shard[j] for j in runnable] for shard in per_shard])
    return origins.settle(merge(first, merged))


def run_rerank(task_key: str, model: str, k: int | None, origins: Origins, items: list,
               *deps) -> list[list[str] | None]:
    engine = get_engine(model, "rerank")

    def one(item) -> tuple[list[str], int]:
        query_part, docs_part = item
        query = check_text(render_value(_input(query_part, deps)))
        docs = [check_text(render_value(d)) for d in _input(docs_part, deps)]
        return [docs[i] for i, _ in engine.rerank(query, docs, k)], len(docs)

    outcomes = attempt(one, items)
    _record(task_key, RERANK_TASK, calls=len(ok(outcomes)), pairs=sum(n for _, n in ok(outcomes)))
    return origins.settle([o if failed(o) else o[0] for o in outcomes])


def assemble(spec: list, *deps):
    """A node's value from its shards: ``spec`` is one part per item (or one part for a scalar)."""
    if isinstance(spec, tuple):  # scalar
        return _value(spec[0], deps)
    return [_value(part, deps) for part in spec]


def run_streamed_call(model: str, prompt_ids: list[int], sampling: SamplingParams, topic: str,
                      request_id: str) -> dict:
    """One request whose client reads its text as it is decoded (a server's streamed response):
    every engine step's new text goes out as a Dask event on ``topic`` (``Worker.log_event``:
    pushed to the subscribed client, no polling), ``{"id", "run", "at", "delta"}`` where ``at``
    is the delta's offset in the text, so a run restarted on another worker (this one died)
    repeats nothing the client already has. Returns the whole completion as a record."""
    worker = get_worker()
    task_key = worker.get_current_task()
    engine = get_engine(model)
    if getattr(thread_state, "key", None) is not None:
        secede()  # it waits on its engine: other tasks take the thread meanwhile
    deltas: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    run, sent = uuid.uuid4().hex[:8], 0
    future = engine.submit(prompt_ids, sampling, on_text=deltas.put, priority=task_priority(task_key))
    future.add_done_callback(lambda _: deltas.put(None))
    with host().abortable(task_key, future.cancel):
        while True:
            pieces = [deltas.get()]
            while True:  # whatever else this engine step gave: one event
                try:
                    pieces.append(deltas.get_nowait())
                except queue_mod.Empty:
                    break
            text = "".join(p for p in pieces if p)
            if text:
                worker.log_event(topic, {"id": request_id, "run": run, "at": sent, "delta": text})
                sent += len(text)
            if None in pieces:
                break
        completion = future.result()
    _record_decode(task_key, model, [completion], streamed=True)
    return {"text": completion.text, "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason, "prompt_token_ids": list(completion.prompt_token_ids),
            "cached_tokens": completion.num_cached_tokens, "logprobs": completion.logprobs,
            "top_logprobs": [dict(t) for t in completion.top_logprobs] if completion.top_logprobs else None}
