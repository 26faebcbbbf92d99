"""The reference pipelines on vLLM alone, without Dask: what a competent user writes instead of daskllm.

Two more ways to run the pipelines of :mod:`pipelines.ops`, each on one vLLM engine per
model, resident for the whole benchmark and driven from this process:

- :class:`VLLMOpwise` (the harness's ``vllm-opwise``, Helium's OpWise): the opwise program
  (:class:`~pipelines.ops.Eager`, one operator at a time over the whole batch, a barrier
  after each), its calls sent with vLLM's offline ``LLM.generate``. An operator's calls go
  in one ``LLM.generate``; per-query functions (``each``, ``map``) run for every item at
  once in threads, in lockstep (:class:`Lockstep`): the calls those threads make while the
  others get to theirs go in one ``LLM.generate`` too.
- :class:`VLLMBatch` (``vllm-batch``, LangGraph's batch): every query's pipeline runs as
  its own coroutines on one event loop with vLLM's ``AsyncLLM``; each operation is a task
  that starts its call the moment its inputs are ready (no barrier anywhere). A split
  generation is used whole once it ends (a LangGraph node gets its model's whole answer).

Prompts are the token ids daskllm sends: the template filled with each slot's text
(``daskllm.prompts.render_value``: a list one item per line, a hit by its text), in the
model's chat template where it has one (``tokenizer.apply_chat_template``), tokenized whole;
sampling is greedy, as daskllm's; ``choose`` limits the one generated token to the options'
first tokens (:func:`pipelines.ops.first_tokens`). Search and rerank run in this process as
a user without Dask runs them: the same MiniLM embedder and reranker daskllm's workers load
(:class:`~daskllm.engines.embedder.EmbedEngine`, whose vectors do not depend on the batch)
and a flat faiss index over the same passages (:class:`LocalRetrieval`).

The engines (:func:`engine_arguments`) are what daskllm's vLLM workers run, so only
orchestration differs: float32, KV blocks of ``daskllm.engine.block-size`` tokens (32 on
CPU), eager, automatic prefix caching on; the whole machine's cores as vLLM's OpenMP
threads (``VLLM_CPU_OMP_THREADS_BIND``: with vLLM's own default binding it computes on one
core and keeps the other for its scheduler), and the KV cache of all of daskllm's workers
together. Scheduling limits are vLLM's defaults for each entry point, as users run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipelines.ops import Eager, Items, first_tokens, plain

SYSTEMS = ("vllm-opwise", "vllm-batch")
_request_ids = itertools.count()


def unavailable_reason() -> str | None:
    """Why the vLLM-alone systems cannot run here, or None."""
    from daskllm.engines.vllm import on_cpu, unavailable_reason as vllm_reason

    if (reason := vllm_reason()) is not None:
        return reason
    if not on_cpu():
        return ("they are set up for a CPU machine (vLLM's CPU build): on a GPU the cluster's engines hold the "
                "device's memory (daskllm.engine.gpu-memory-utilization)")
    return None


# --- calls: what daskllm would send ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One generation: the model, its prompt's token ids and greedy sampling's settings."""

    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    allowed_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Output:
    text: str
    tokens: int  # generated


def per_call(slots: dict) -> tuple[list[dict], bool]:
    """The slot values of each call, and whether it is a batch: a list (or tuple) fills one
    call per item, all of one length; any other value (text, ``Items``, a pending value)
    fills every call, as daskllm's builders read their inputs."""
    widths = {len(v) for v in slots.values() if isinstance(v, (list, tuple))}
    if len(widths) > 1:
        raise ValueError(f"batched slots of different sizes: {sorted(widths)}")
    if not widths:
        return [dict(slots)], False
    n = widths.pop()
    if n == 0:
        raise ValueError("a batch must not be empty")
    return [{k: v[i] if isinstance(v, (list, tuple)) else v for k, v in slots.items()} for i in range(n)], True


def prompt_ids(model: str, template: str, values: dict, chat: bool | None = None) -> tuple[int, ...]:
    """The ids of ``template`` filled with ``values``: in the model's chat template as the one
    user message (where it has one, unless ``chat`` says otherwise), tokenized whole."""
    from daskllm.prompts import render_value, tokenizer_for

    tok = tokenizer_for(model)  # the model's own tokenizer files, loaded once per process
    text = template.format_map({k: render_value(v) for k, v in values.items()})
    if chat if chat is not None else tok.has_chat_template:
        text = tok.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return tuple(tok.tokenizer(text, add_special_tokens=False).input_ids)
    return tuple(tok.tokenizer(text).input_ids)  # with BOS and the like, as tokenizer(text) adds them


def sampling_params(call: Call, **extra):
    """vLLM's greedy sampling for ``call`` (the text without special tokens, as daskllm's engines)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=call.max_tokens, temperature=0.0, ignore_eos=call.ignore_eos,
                          allowed_token_ids=list(call.allowed_token_ids) or None, skip_special_tokens=True, **extra)


def value_of(output: Output, split) -> object:
    """A call's value: its text, or for a split generation the items it splits into."""
    if split is None:
        return output.text
    from daskllm.streaming.split import splitter

    return Items(splitter(split).items(output.text, True))


class RunUsage:
    """What one run asked of the engines, per model: calls, decode tokens, and the distinct
    tokens in the prefix tree of every prompt (whole blocks of ``daskllm.engine.block-size``,
    and each partial last block): the harness's lower bound, counted as daskllm's metering
    counts it (``daskllm.worker.execute.prompt_blocks``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._models: dict[str, dict] = {}
        self._blocks: set = set()
        self._tails: dict = {}

    def add(self, call: Call, output: Output) -> None:
        from daskllm.worker.execute import prompt_blocks

        full, tail_hash, tail_len = prompt_blocks(call.prompt_ids)
        with self._lock:
            m = self._models.setdefault(call.model, {"calls": 0, "decode_tokens": 0})
            m["calls"] += 1
            m["decode_tokens"] += output.tokens
            self._blocks.update((call.model, h) for h in full)
            if tail_len:
                self._tails[(call.model, tail_hash)] = tail_len

    @property
    def calls(self) -> int:
        return sum(m["calls"] for m in self._models.values())

    def models(self) -> dict[str, dict]:
        from daskllm import config

        bs = config.get("engine.block-size")
        with self._lock:
            return {model: {**m, "distinct_prompt_tokens": sum(bs for mm, _ in self._blocks if mm == model)
                            + sum(n for (mm, _), n in self._tails.items() if mm == model)}
                    for model, m in self._models.items()}

    @property
    def distinct_prompt_tokens(self) -> int:
        return sum(m["distinct_prompt_tokens"] for m in self.models().values())


# --- vllm-opwise: an operator at a time, LLM.generate ------------------------------------


class Lockstep:
    """Threads running one batch's per-item functions, whose calls go to the engine together.

    A call waits until every other running thread has made its own call or finished; then
    every call made goes to ``run`` at once (one ``LLM.generate``) and they all go on: the
    operator-at-a-time order of OpWise, with a barrier after each operator, kept inside
    per-query functions too. A thread that starts threads (:meth:`fork`) hands its turn to
    them and gets it back from the last one to finish.
    """

    def __init__(self, run: Callable[[list[Call]], list[Output]]):
        self._run = run
        self._cond = threading.Condition()
        self._running = 1  # the thread that runs the pipeline
        self._waiting: list[_Box] = []
        self.batches: list[int] = []  # calls per engine batch (what the tests check)

    def call(self, calls: list[Call]) -> list[Output]:
        box = _Box(calls)
        with self._cond:
            self._waiting.append(box)
            self._running -= 1
            batch = self._take()
        if batch:
            self._answer(batch)
        with self._cond:
            while not box.done:
                self._cond.wait()
        if box.error is not None:
            raise box.error
        return box.outputs

    def fork(self, fn, arguments: list[tuple]) -> list:
        """``fn(*a)`` for every ``a`` at once, in threads that take part in the lockstep."""
        left = [len(arguments)]
        with self._cond:
            self._running += len(arguments) - 1  # the caller's turn passes to its threads

        def one(a):
            try:
                return fn(*a)
            finally:
                with self._cond:
                    left[0] -= 1
                    batch = None
                    if left[0]:  # the last one's turn goes back to the caller
                        self._running -= 1
                        batch = self._take()
                if batch:
                    self._answer(batch)

        with ThreadPoolExecutor(len(arguments)) as pool:
            return list(pool.map(one, arguments))

    def _take(self) -> list[_Box] | None:
        if self._running or not self._waiting:
            return None
        batch, self._waiting = self._waiting, []
        self._running += len(batch)  # they go on once answered
        return batch

    def _answer(self, batch: list[_Box]) -> None:
        calls = [c for box in batch for c in box.calls]
        self.batches.append(len(calls))
        try:
            outputs, error = self._run(calls), None
        except BaseException as exc:  # noqa: BLE001 - every waiting call fails with it
            outputs, error = [], exc
        with self._cond:
            at = 0
            for box in batch:
                box.outputs, box.error, box.done = outputs[at:at + len(box.calls)], error, True
                at += len(box.calls)
            self._cond.notify_all()


@dataclass(slots=True)
class _Box:
    calls: list[Call]
    outputs: list[Output] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False


@dataclass(frozen=True)
class VLLMOpwise(Eager):
    """The opwise program (:class:`~pipelines.ops.Eager` over the whole batch), its LLM calls
    sent to vLLM's offline ``LLM`` (``lockstep``), search and rerank in this process."""

    lockstep: Lockstep | None = None
    retrieval: object = None  # LocalRetrieval, or anything with its search and rerank

    def _apply(self, fn, arguments: list[tuple]) -> list:
        if len(arguments) < 2:
            return [fn(*a) for a in arguments]
        return self.lockstep.fork(fn, arguments)

    def _model(self, model: str | None) -> str:
        import daskllm

        return model or self.model or daskllm.config.get("model")

    def _calls(self, template: str, model: str | None, slots: dict, max_tokens: int, ignore_eos: bool,
               allowed: tuple[int, ...] = ()) -> tuple[list[Call], bool]:
        model = self._model(model)
        values, batched = per_call(slots)
        return [Call(model, prompt_ids(model, template, v, self.chat), max_tokens, ignore_eos, allowed)
                for v in values], batched

    def generate(self, template: str, *, model: str | None = None, max_tokens: int = 16, split=None, **slots):
        calls, batched = self._calls(template, model, slots, max_tokens, self.ignore_eos)
        values = [value_of(o, split) for o in self.lockstep.call(calls)]
        return values if batched else values[0]

    def choose(self, template: str, options: tuple[str, ...], *, model: str | None = None, **slots):
        allowed = first_tokens(self._model(model), tuple(options))
        calls, batched = self._calls(template, model, slots, 1, False, allowed)
        values = [o.text for o in self.lockstep.call(calls)]
        return values if batched else values[0]

    def search(self, index, queries, k: int = 3):
        from daskllm.prompts import render_value

        batched = isinstance(queries, (list, tuple))
        hits = self.retrieval.search([render_value(q) for q in (queries if batched else [queries])], k)
        return [Items(h) for h in hits] if batched else Items(hits[0])

    def rerank(self, query, docs, k: int | None = None):
        return Items(self.retrieval.rerank(query, list(docs), k))


# --- vllm-batch: every call as soon as its inputs are ready, AsyncLLM ---------------------


async def resolve(value):
    """``value`` with every pending operation in it (tasks, lists and Items of them) awaited."""
    if isinstance(value, asyncio.Future):
        return await resolve(await value)
    if isinstance(value, list):
        return [await resolve(v) for v in value]
    if isinstance(value, Items):
        return Items([await resolve(v) for v in value])
    return value


class VLLMBatch:
    """The operations as tasks on one event loop: each returns at once (a task, or a list of
    them for a batch) and starts its work when its inputs are ready; ``generate`` awaits
    vLLM's ``AsyncLLM``. Per-query functions run once their inputs are ready and build more
    tasks, so every query goes at its own pace. Runs on the loop's thread only."""

    eager = False

    def __init__(self, model: str | None, generate: Callable, retrieval, *, usage: RunUsage | None = None,
                 ignore_eos: bool = False, chat: bool | None = None, executor=None):
        self.model, self.ignore_eos, self.chat = model, ignore_eos, chat
        self._generate_call = generate  # async fn(Call) -> Output
        self.retrieval = retrieval
        self.usage = usage
        self._executor = executor  # search and rerank compute here, off the loop

    def run(self, fn, inputs, config: dict):
        """The pipeline's outputs (coroutine: run it on the loop)."""
        async def main():
            return plain(await resolve(fn(inputs, self, **config)))

        return main()

    def _model(self, model: str | None) -> str:
        import daskllm

        return model or self.model or daskllm.config.get("model")

    @staticmethod
    def _task(coro) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(coro)

    def _calls(self, template: str, model: str | None, slots: dict, max_tokens: int, ignore_eos: bool,
               split=None, allowed: tuple[int, ...] = ()):
        model = self._model(model)
        values, batched = per_call(slots)
        tasks = [self._task(self._one(template, model, v, max_tokens, ignore_eos, split, allowed)) for v in values]
        return tasks if batched else tasks[0]

    async def _one(self, template, model, values, max_tokens, ignore_eos, split, allowed):
        values = {k: await resolve(v) for k, v in values.items()}
        call = Call(model, prompt_ids(model, template, values, self.chat), max_tokens, ignore_eos, allowed)
        output = await self._generate_call(call)
        if self.usage is not None:
            self.usage.add(call, output)
        return value_of(output, split)

    def generate(self, template: str, *, model: str | None = None, max_tokens: int = 16, split=None, **slots):
        return self._calls(template, model, slots, max_tokens, self.ignore_eos, split)

    def choose(self, template: str, options: tuple[str, ...], *, model: str | None = None, **slots):
        allowed = first_tokens(self._model(model), tuple(options))
        return self._calls(template, model, slots, 1, False, None, allowed)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def search(self, index, queries, k: int = 3):
        from daskllm.prompts import render_value

        async def one(query):
            return Items((await self._off_loop(self.retrieval.search, [render_value(await resolve(query))], k))[0])

        if isinstance(queries, (list, tuple)):
            return [self._task(one(q)) for q in queries]
        return self._task(one(queries))

    def rerank(self, query, docs, k: int | None = None):
        async def one():
            query_, docs_ = await resolve(query), await resolve(docs)
            return Items(await self._off_loop(self.retrieval.rerank, query_, list(docs_), k))

        return self._task(one())

    def map(self, stream, fn, *args):
        async def row(items):
            items, args_ = await resolve(items), [await resolve(a) for a in args]
            return Items(await resolve([fn(item, self, *args_) for item in items]))

        if isinstance(stream, list):
            return [self._task(row(r)) for r in stream]
        return self._task(row(stream))

    def each(self, fn, *args):
        widths = {len(a) for a in args if isinstance(a, list)}
        if len(widths) > 1:
            raise ValueError(f"each(): batch arguments of different sizes {sorted(widths)}")

        async def one(values):
            values = [await resolve(v) for v in values]
            return Items([await resolve(fn(self, *values))])

        if not widths:
            return self._task(one(args))
        return [self._task(one([a[i] if isinstance(a, list) else a for a in args])) for i in range(widths.pop())]

    def collect(self, stream):
        return stream

    def gather(self, batch):
        async def whole():
            return Items(await resolve(list(batch)))

        return self._task(whole())


# --- retrieval in this process -----------------------------------------------------------


class LocalRetrieval:
    """The harness's search index and reranker without Dask: ``texts`` embedded by the MiniLM
    embedder in this process into one flat faiss index (ids 0, 1, ... as the sharded index
    numbers them; hits ranked by score, then id, as its merged shards are), and the
    bi-encoder reranker on the same embedder."""

    def __init__(self, texts: Sequence[str], *, embedder: str | None = None, index_config: dict | None = None,
                 reranker: str | None = None):
        import numpy as np

        from daskllm.engines.embedder import EmbedEngine
        from daskllm.engines.reranker import load_reranker
        from daskllm.index import VectorIndex
        from daskllm.models import DEFAULT_EMBEDDING_MODEL

        embedder, reranker = embedder or DEFAULT_EMBEDDING_MODEL, reranker or DEFAULT_EMBEDDING_MODEL
        self.embedder = EmbedEngine(embedder)
        # The bi-encoder on the embedder's model shares it, as on daskllm's workers.
        self.reranker = load_reranker(reranker, embedder=self.embedder if reranker == embedder else None)
        config = {"dim": self.embedder.dim, **(index_config or {})}
        self.index = VectorIndex(**{k: v for k, v in config.items() if k != "name"}, name="local")
        texts = list(texts)
        self.index.add(self.embedder.embed(texts), np.arange(len(texts)), texts)

    def search(self, queries: list[str], k: int) -> list[list]:
        return self.index.search(self.embedder.embed(list(queries)), k)

    def rerank(self, query, docs: list, k: int | None) -> list[str]:
        from daskllm.prompts import render_value

        docs = [render_value(d) for d in docs]
        return [docs[i] for i, _ in self.reranker.rerank(render_value(query), docs, k)]

    def close(self) -> None:
        self.reranker.close()
        self.embedder.close()


# --- the engines ---------------------------------------------------------------------------


def engine_arguments(model: str, *, kv_cache_tokens: int) -> dict:
    """vLLM engine arguments: what daskllm's vLLM workers run (see the module's docstring)."""
    from transformers import AutoConfig

    from daskllm import config
    from daskllm.engines.vllm import is_dummy, kv_bytes_per_token
    from daskllm.models import resolve

    path = resolve(model)
    return dict(model=str(path), tokenizer=str(path), dtype="float32", block_size=config.get("engine.block-size"),
                enforce_eager=True, enable_prefix_caching=True, seed=0,
                kv_cache_memory_bytes=kv_cache_tokens * kv_bytes_per_token(AutoConfig.from_pretrained(path), "float32"),
                load_format="dummy" if is_dummy(path) else "auto", disable_log_stats=False)


def omp_binding() -> dict[str, str]:
    """vLLM's CPU threads on every core this process may use (vLLM's default binding keeps
    one for its scheduler, which on 2 cores halves the compute)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


@dataclass
class EngineCounters:
    """An engine's work from its stat logger: the numbers daskllm's vLLM engine reports
    (``daskllm/engines/vllm.py``, ``_record``), counted the same way."""

    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    decode_tokens: int = 0
    steps: int = 0
    batched_sequences: int = 0
    busy_seconds: float = 0.0
    _last: float = 0.0
    _was_running: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
        now = time.perf_counter()
        with self._lock:
            if scheduler_stats is not None:
                cache = scheduler_stats.prefix_cache_stats
                if cache is not None:
                    self.prefill_tokens_cached += cache.hits
                    self.prefill_tokens_computed += cache.queries - cache.hits
                running = scheduler_stats.num_running_reqs
                if running:
                    self.steps += 1
                    self.batched_sequences += running
                if self._was_running:  # computing since the last record
                    self.busy_seconds += now - self._last
                self._was_running = bool(running)
            if iteration_stats is not None:
                self.decode_tokens += iteration_stats.num_generation_tokens
            self._last = now

    # the rest of vLLM's stat-logger interface
    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args, **kwargs) -> None:
        pass

    def record_admission_rejection(self, *args, **kwargs) -> None:
        pass

    def totals(self) -> dict:
        with self._lock:
            return {"prefill_tokens_computed": self.prefill_tokens_computed,
                    "prefill_tokens_cached": self.prefill_tokens_cached, "decode_tokens": self.decode_tokens,
                    "steps": self.steps, "batched_sequences": self.batched_sequences,
                    "busy_seconds": self.busy_seconds}


def _count_with(engine, counters: EngineCounters) -> None:
    """The engine's stats go to ``counters`` only (no periodic log lines, no Prometheus)."""
    manager = getattr(engine, "logger_manager", None)
    if manager is None:
        raise RuntimeError("vLLM's engine has no stat loggers (disable_log_stats must be False)")
    manager.stat_loggers[:] = [counters]


class OfflineEngine:
    """vLLM's offline ``LLM`` on one model; ``generate`` from one thread at a time."""

    def __init__(self, model: str, *, kv_cache_tokens: int):
        from vllm import LLM

        from daskllm.engines.vllm import environment

        self.model = model
        self.counters = EngineCounters()
        with environment(omp_binding()):  # the engine's processes start with it
            self.llm = LLM(**engine_arguments(model, kv_cache_tokens=kv_cache_tokens))
        _count_with(self.llm.llm_engine, self.counters)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"vllm-opwise-{model}")

    def generate(self, calls: list[Call]) -> list[Output]:
        return self._thread.submit(self._generate, calls).result()

    def _generate(self, calls: list[Call]) -> list[Output]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(c.prompt_ids)) for c in calls],
                                 [sampling_params(c) for c in calls], use_tqdm=False)
        return [Output(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]

    def reset_prefix_cache(self) -> bool:
        return self._thread.submit(self.llm.reset_prefix_cache).result()

    def close(self) -> None:
        self._thread.shutdown()
        self.llm.llm_engine.engine_core.shutdown()


class EventLoopThread:
    """An asyncio event loop running in a thread of its own."""

    def __init__(self, name: str = "vllm-batch"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


class AsyncEngine:
    """vLLM's ``AsyncLLM`` on one model, on ``loop``."""

    def __init__(self, model: str, loop: EventLoopThread, *, kv_cache_tokens: int):
        self.model, self.loop = model, loop
        self.counters = EngineCounters()
        self.engine = loop.run(self._start(engine_arguments(model, kv_cache_tokens=kv_cache_tokens)))
        _count_with(self.engine, self.counters)

    async def _start(self, arguments: dict):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from daskllm.engines.vllm import environment

        with environment(omp_binding()):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments))

    async def generate(self, call: Call) -> Output:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        final = None
        # The final output only, as vLLM's server answers a request that does not stream.
        params = sampling_params(call, output_kind=RequestOutputKind.FINAL_ONLY)
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(call.prompt_ids)), params,
                                              f"vllm-batch-{next(_request_ids)}"):
            final = out
        return Output(final.outputs[0].text, len(final.outputs[0].token_ids))

    def reset_prefix_cache(self) -> bool:
        return self.loop.run(self.engine.reset_prefix_cache())

    def close(self) -> None:
        from daskllm.engines.vllm import _cancel

        # The output handler first: stopped after the engine core, it logs the core's death as a failure.
        self.loop.run(_cancel(getattr(self.engine, "output_handler", None)), timeout=10)
        self.engine.shutdown()


# --- the systems, as the harness runs them --------------------------------------------------


class VLLMAlone:
    """The vLLM-alone systems of one benchmark: per system, one engine per model, started once
    and kept across runs; search and rerank in this process (``retrieval``)."""

    def __init__(self, systems: Sequence[str], models: Sequence[str], retrieval, *, kv_cache_tokens: int, log=print):
        self.retrieval = retrieval
        self.engines: dict[str, dict[str, object]] = {}
        self.loop = None
        self._executor = ThreadPoolExecutor(16, thread_name_prefix="vllm-alone-retrieval")
        try:
            for system in systems:
                if system not in SYSTEMS:
                    raise ValueError(f"unknown vLLM-alone system {system!r}; choose from {SYSTEMS}")
                for model in dict.fromkeys(models):
                    start = time.perf_counter()
                    if system == "vllm-opwise":
                        engine = OfflineEngine(model, kv_cache_tokens=kv_cache_tokens)
                    else:
                        self.loop = self.loop or EventLoopThread()
                        engine = AsyncEngine(model, self.loop, kv_cache_tokens=kv_cache_tokens)
                    self.engines.setdefault(system, {})[model] = engine
                    log(f"{system}: vLLM engine for {model!r} started in {time.perf_counter() - start:.1f} s")
                    self._warm_up(system, model)
        except BaseException:
            self.close()
            raise

    def _warm_up(self, system: str, model: str) -> None:
        """A batch through the new engine (its first steps' one-time costs), then an empty cache."""
        engine = self.engines[system][model]
        calls = [Call(model, tuple(range(10, 10 + 40 + i)), 8, True) for i in range(32)]
        if system == "vllm-opwise":
            engine.generate(calls)
        else:
            async def all_of():
                return await asyncio.gather(*[engine.generate(c) for c in calls])

            self.loop.run(all_of())
        engine.reset_prefix_cache()

    def run(self, system: str, fn, inputs, config: dict, *, ignore_eos: bool = True) -> tuple[list, RunUsage]:
        """The pipeline's outputs on ``system`` (and what it asked of the engines)."""
        usage = RunUsage()
        engines = self.engines[system]

        if system == "vllm-opwise":
            def complete(calls: list[Call]) -> list[Output]:
                outputs: list[Output | None] = [None] * len(calls)
                for model in dict.fromkeys(c.model for c in calls):  # a batch per model
                    at = [i for i, c in enumerate(calls) if c.model == model]
                    for i, o in zip(at, engines[model].generate([calls[i] for i in at])):
                        outputs[i] = o
                        usage.add(calls[i], o)
                return outputs

            ops = VLLMOpwise(config["model"], ignore_eos=ignore_eos, lockstep=Lockstep(complete),
                             retrieval=self.retrieval)
            return plain(fn(inputs, ops, **config)), usage

        async def generate(call: Call) -> Output:
            return await engines[call.model].generate(call)

        ops = VLLMBatch(config["model"], generate, self.retrieval, usage=usage, ignore_eos=ignore_eos,
                        executor=self._executor)
        return self.loop.run(ops.run(fn, inputs, config)), usage

    def reset_prefix_caches(self, system: str) -> None:
        for engine in self.engines[system].values():
            if not engine.reset_prefix_cache():
                raise RuntimeError(f"{system}: vLLM did not empty {engine.model!r}'s prefix cache")

    def totals(self, system: str) -> dict:
        """The system's engines' counters, summed."""
        out: dict = {}
        for engine in self.engines[system].values():
            for k, v in engine.counters.totals().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for per_model in self.engines.values():
            for engine in per_model.values():
                with contextlib.suppress(Exception):
                    engine.close()
        self.engines.clear()
        if self.loop is not None:
            self.loop.close()
        self._executor.shutdown(wait=False)
