"""Engines and index shards resident on Dask workers.

:class:`EngineHost` is a ``WorkerPlugin``: it loads the configured engines once per worker
process and closes them at teardown. At worker start-up the worker joins the cluster first
and the engines load in the background (a restarted worker is back in about a second, not
after its weights load); a task that needs an engine waits for it. Engines are of three kinds: ``llm``
(generate, prefill), ``embed`` and ``rerank``. A task running on that worker finds its
engine with :func:`get_engine`; many tasks running at once on one worker all feed the same
engine (one copy of the weights, requests batched together). Vector-index shards built or
loaded on a worker live in the same plugin (see :mod:`daskllm.retrieval`).

A worker advertises what it holds in its heartbeat metrics (``ws.metrics["daskllm"]`` on
the scheduler) and with a ``daskllm`` event when its engines come up.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

from distributed import WorkerPlugin, get_worker
from distributed.core import Status
from distributed.diagnostics import nvml
from distributed.worker import thread_state

from daskllm.engines import KINDS, Engine, EngineSpec, sizing
from daskllm.engines.protocol import gather_requests
from daskllm.models import is_cross_encoder, model_name, resolve
from daskllm.prompts import import_transformers
from daskllm.worker.usage import USAGE_TOPIC, TaskUsage, UsageLog

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskllm-engines"


class EngineLoadError(RuntimeError):
    """A configured model could not be loaded; the worker keeps no engine at all."""


# The worker task whose work a thread outside Dask's pool does (daskllm.runtime.here's threads).
WORK_OF: contextvars.ContextVar[str | None] = contextvars.ContextVar("daskllm_work_of", default=None)
UNWANTED = ("cancelled", "released", "forgotten")  # worker task states: nobody will read the result


def sequence_room(engine) -> int:
    """The most tokens (prompt and output) one sequence of ``engine`` can hold: its model's
    context, or its KV cache where that is smaller (an engine given a small cache refuses a
    longer sequence). An engine whose cache is not its own (a remote server's) reports none."""
    try:
        state = engine.cache_state() if hasattr(engine, "cache_state") else None
        capacity = state.num_blocks * state.block_size if state is not None else 0
    except Exception:  # noqa: BLE001 - a heartbeat's metric: an engine's fault is reported elsewhere
        capacity = 0
    return min(engine.max_model_len, capacity) if capacity > 0 else engine.max_model_len


class EngineHost(WorkerPlugin):
    """Keeps the configured engines, and any index shards, resident in a worker process."""

    name = PLUGIN_NAME

    def __init__(self, models: Iterable[str | Mapping | EngineSpec] = (), *,
                 embedders: Iterable[str | Mapping | EngineSpec] = (),
                 rerankers: Iterable[str | Mapping | EngineSpec] = (), **engine_defaults):
        self.specs = EngineSpec.expand(models, embedders, rerankers)
        if not self.specs:
            raise ValueError("EngineHost needs at least one model, embedder or reranker")
        keys = [(s.kind, s.engine_name) for s in self.specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two engines of one kind would share a name: {keys}")
        self.engine_defaults = engine_defaults
        self._unloaded()

    def _unloaded(self) -> None:
        self.engines: dict[str, dict[str, Engine]] = {kind: {} for kind in KINDS}
        self.indexes: dict[str, dict[int, object]] = {}  # index name -> shard number -> VectorIndex
        self.usage = UsageLog()
        self.worker = None  # the worker this plugin runs in (set up); None in a LocalHost
        self._loaded = threading.Event()  # set when the load finished, or failed
        self._load_error: BaseException | None = None
        self._closed = False
        self._announced = True
        self._aborts: dict[str, list[Callable[[], object]]] = {}  # task key -> how to stop its work

    def __getstate__(self):  # what travels to workers: the configuration, never engines
        return {"specs": self.specs, "engine_defaults": self.engine_defaults}

    def __setstate__(self, state):
        self.specs, self.engine_defaults = state["specs"], state["engine_defaults"]
        self._unloaded()

    async def setup(self, worker) -> None:
        for spec in self.specs:  # a model that does not exist fails here: the worker never joins
            try:
                resolve(spec.model)
            except Exception as exc:
                self._load_error = _load_error(spec, exc)
                self._loaded.set()
                raise self._load_error from exc
        self.worker = worker
        worker.metrics["daskllm"] = self.metrics
        import_transformers()  # before engine loading and tasks use it from other threads
        if worker.status == Status.running:
            # Registered on a running worker: the caller waits for the engines, and sees a failure.
            await self._load()
            return
        # At start-up the worker joins first (a restarted worker is back at once, and a kill
        # during a long load cannot strand its nanny); tasks wait for their engines.
        worker.loop.add_callback(self._load_or_leave, worker)

    async def _load(self) -> None:
        try:
            # Loading takes seconds: keep the worker's event loop (heartbeats) responsive.
            engines = await asyncio.to_thread(load_engines, self.specs, self.engine_defaults)
        except BaseException as exc:
            self._load_error = exc
            raise
        finally:
            self._loaded.set()
        if self._closed:  # torn down while loading
            close_engines(engines)
            return
        self.engines = engines
        self._announced = False

    async def _load_or_leave(self, worker) -> None:
        try:
            await self._load()
        except Exception as exc:  # noqa: BLE001 - logged, and the worker leaves: it must not serve without engines
            logger.error("daskllm: %s; worker %s leaves the cluster", exc, worker.address)
            # For whoever waits for the model (`daskllm serve`): the reason, not a silent departure.
            worker.log_event("daskllm", {"action": "engines-failed", "worker": worker.address, "error": str(exc)})
            await worker.close(reason=f"daskllm engines failed to load: {exc}", nanny=True)

    def record(self, key: str, usage: TaskUsage) -> None:
        """Keep a task's usage record under its key and, on a worker, send it to the scheduler
        (:class:`daskllm.ledger.UsageLedger` keeps it there): it outlives this worker. A task
        run again replaces its record."""
        self.usage[key] = usage
        if self.worker is not None:
            try:  # thread-safe: Worker.log_event hands the message to its event loop
                self.worker.log_event(USAGE_TOPIC, {"key": key, "usage": dataclasses.asdict(usage)})
            except Exception as exc:  # noqa: BLE001 - a record that cannot travel costs the count, never the task
                logger.warning("usage record %s not sent to the scheduler: %s", key, exc)

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until the engines are loaded; raise the load's error if it failed."""
        if not self._loaded.wait(timeout):
            raise TimeoutError(f"daskllm engines still loading after {timeout} s")
        if self._load_error is not None:
            raise EngineLoadError(f"this worker's engines failed to load: {self._load_error}") from self._load_error

    async def loaded(self) -> None:
        """Wait (on the event loop) until the engines are loaded or failed."""
        if not self._loaded.is_set():
            await asyncio.to_thread(self._loaded.wait)

    # --- work nobody wants any more ---------------------------------------------------------

    @contextlib.contextmanager
    def abortable(self, task_key: str, abort: Callable[[], object]):
        """While the task ``task_key`` waits on work it started (engine requests, nested
        futures), ``abort`` stops that work if the task is cancelled or released: Dask cannot
        interrupt the task's thread, so without this the engines would finish work nobody reads.

        Work a task runs in its own thread (a plan computed in place, as a table partition
        does) is registered under that running task's key: cancelling it aborts the work."""
        task_key = getattr(thread_state, "key", None) or WORK_OF.get() or task_key
        self._aborts.setdefault(task_key, []).append(abort)
        if not _wanted(task_key):  # cancelled before its work was registered here
            self.transition(task_key, None, "cancelled")
        try:
            yield
        finally:
            aborts = self._aborts.get(task_key)
            if aborts is not None and abort in aborts:
                aborts.remove(abort)
                if not aborts:
                    del self._aborts[task_key]

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish in UNWANTED and key in self._aborts:
            for abort in self._aborts.pop(key):
                try:
                    abort()
                except Exception:  # noqa: BLE001 - a hook must never break the worker's state machine
                    logger.exception("daskllm: could not abort the work of task %s", key)

    def teardown(self, worker) -> None:
        self._closed = True
        worker.metrics.pop("daskllm", None)
        engines, self.engines = self.engines, {kind: {} for kind in KINDS}
        self.indexes = {}
        close_engines(engines)

    def resident(self, model: str, kind: str = "llm") -> Engine | None:
        """This worker's loaded ``kind`` engine for ``model`` (by the name it was given or its
        recipe name), or None."""
        engines = self.engines.get(kind, {})
        engine = engines.get(model)
        return engine if engine is not None else engines.get(model_name(model))

    def models(self) -> dict[str, list[str]]:
        """What this worker serves: while its engines load, what it was configured with (tasks
        placed here wait for them); after a failed load, nothing."""
        if not self._loaded.is_set():
            return {kind: sorted(s.engine_name for s in self.specs if s.kind == kind) for kind in KINDS}
        return {kind: sorted(engines) for kind, engines in self.engines.items()}

    def metrics(self, worker=None) -> dict:
        """Small and msgpack-friendly: sent to the scheduler with every heartbeat."""
        if worker is not None and not getattr(self, "_announced", True) and _connected(worker):
            # Announced from a heartbeat: at setup (and at registration) the worker is not yet
            # connected to the scheduler, and Dask drops events logged before it is.
            self._announced = True
            worker.log_event("daskllm", {"action": "engines-loaded", "worker": worker.address,
                                         "models": self.models()})
        return {
            "models": self.models(),
            "engines": {kind: {name: e.stats().as_dict() for name, e in engines.items()}
                        for kind, engines in self.engines.items()},
            # Each LLM's room for one sequence: a server refuses a prompt longer than it before
            # submitting it, and gives a request that sets no output limit what it leaves.
            "contexts": {name: sequence_room(e) for name, e in self.engines.get("llm", {}).items()
                         if getattr(e, "max_model_len", None)},
            "indexes": {name: {str(shard): index.ntotal for shard, index in shards.items()}
                        for name, shards in self.indexes.items()},
            # Resident prefix blocks, as the hex hashes task annotations use: the placement
            # plugin's shadow of this worker's caches.
            "cache": {name: [format(h, "x") for h in itertools.islice(e.cache_state().resident_hashes, 16384)]
                      for name, e in self.engines.get("llm", {}).items() if hasattr(e, "cache_state")},
            **({"gpu": gpu} if (gpu := gpu_metrics()) else {}),
        }


def gpu_metrics() -> dict | None:
    """Utilization and memory of this worker's GPU (the first visible one), from NVML; None on
    a CPU worker or without NVML, never an error."""
    try:
        if nvml.device_get_count() < 1:
            return None
        now, once = nvml.real_time(), nvml.one_time()
        return {"name": once.get("name"), "utilization": now.get("utilization"),
                "memory_used": now.get("memory-used"), "memory_total": once.get("memory-total")}
    except Exception:  # noqa: BLE001 - no driver, no library, a MIG quirk: no GPU metrics
        return None


def _connected(worker) -> bool:
    stream = getattr(worker, "batched_stream", None)
    return bool(stream and stream.comm and not stream.comm.closed())


def load_engines(specs: Iterable[EngineSpec], defaults: Mapping | None = None) -> dict[str, dict[str, Engine]]:
    """Load every spec, or none: on any failure the loaded ones are closed and the error names the model.

    A bi-encoder reranker on the same model as an embed engine shares that engine's weights.
    """
    with _loading:
        return _load_all(specs, defaults)


# One load at a time per process: a plugin replaced while its engines still load must not load
# beside its successor (transformers' lazy imports are not safe from two threads at once).
_loading = threading.Lock()


def _load_all(specs: Iterable[EngineSpec], defaults: Mapping | None) -> dict[str, dict[str, Engine]]:
    engines: dict[str, dict[str, Engine]] = {kind: {} for kind in KINDS}
    specs = list(specs)
    # LLM engines on a GPU split the worker's share of its memory (vLLM's and the torch
    # engine's gpu_memory_utilization); embedders and rerankers are small beside them.
    on_gpu = [s for s in specs if s.kind == "llm" and s.resolved_backend() in ("torch", "vllm")]
    share = sizing.gpu_memory_utilization() / max(1, len(on_gpu))
    try:
        for spec in sorted(specs, key=lambda s: KINDS.index(s.kind)):
            try:
                options = dict(defaults or {})
                if len(on_gpu) > 1 and any(spec is s for s in on_gpu):
                    options.setdefault("gpu_memory_utilization", share)
                if spec.kind == "rerank" and not is_cross_encoder(resolve(spec.model)):
                    path = resolve(spec.model)
                    shared = next((e for e in engines["embed"].values() if e.path == path), None)
                    if shared is not None:
                        options["embedder"] = shared
                engines[spec.kind][spec.engine_name] = spec.load(**options)
            except Exception as exc:
                raise _load_error(spec, exc) from exc
    except BaseException:
        close_engines(engines)
        raise
    return engines


def _load_error(spec: EngineSpec, exc: BaseException) -> EngineLoadError:
    return EngineLoadError(f"could not load {spec.kind} model {spec.model!r} ({spec.backend or 'configured'} backend): {exc}")


def close_engines(engines: dict[str, dict[str, Engine]]) -> None:
    for kind in reversed(KINDS):  # rerankers first: they may share an embed engine
        for engine in engines.get(kind, {}).values():
            engine.close()


class LocalHost(EngineHost):
    """Engines in this process, loaded on first use: for computing without a cluster."""

    def __init__(self):
        self.specs, self.engine_defaults = [], {}
        self._unloaded()
        self._loaded.set()  # loads each engine on first use instead
        self._lock = threading.Lock()

    def load(self, model: str, kind: str) -> Engine:
        with self._lock:
            engines = self.engines[kind]
            if model not in engines:
                engines[model] = EngineSpec(model=model, kind=kind).load()
            return engines[model]

    def close(self) -> None:
        close_engines(self.engines)
        self.engines = {kind: {} for kind in KINDS}


_local_host: LocalHost | None = None


def local_host() -> LocalHost:
    global _local_host
    if _local_host is None:
        _local_host = LocalHost()
        # Engine threads must be done before the interpreter finalizes: a torch step on a daemon
        # thread during finalization can abort the process ("terminate called ...").
        atexit.register(_local_host.close)
    return _local_host


def host() -> EngineHost:
    """The engine host of the worker running the current task (this process's, outside a cluster)."""
    try:
        worker = get_worker()
    except ValueError:
        return local_host()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise LookupError(f"worker {worker.address} holds no daskllm engines; start workers with "
                          f"LocalLLMCluster(models=...) or `dask worker --preload daskllm.preload --daskllm-model ...`")
    return plugin


def get_engine(model: str, kind: str = "llm") -> Engine:
    """The ``kind`` engine (llm, embed, rerank) for ``model`` on the worker running the current task.

    Outside a cluster (e.g. ``node.compute()`` with the threaded scheduler) engines are
    loaded into this process on first use.
    """
    plugin = host()
    plugin.wait_loaded()
    engine = plugin.resident(model, kind)
    if engine is None and isinstance(plugin, LocalHost):
        return plugin.load(model, kind)
    if engine is None:
        raise LookupError(f"{kind} model {model!r} is not resident on worker {get_worker().address}; "
                          f"it holds {sorted(plugin.engines.get(kind, {}))}")
    return engine


def _wanted(task_key: str) -> bool:
    """Whether the task's result is still wanted (True outside a worker: nobody can cancel it)."""
    try:
        ts = get_worker().state.tasks.get(task_key)
    except ValueError:
        return True
    return ts is None or ts.state not in UNWANTED  # None: not a task of this worker's (nothing to cancel)


def wait_requests(task_key: str, futures: list[Future], *, return_exceptions: bool = False) -> list:
    """The results of engine requests the task ``task_key`` started, in order; a failed one
    holds its exception with ``return_exceptions``, else the first is raised once all are done.
    If the task is cancelled meanwhile, the requests are cancelled: the engine drops them at its
    next step."""
    def cancel():
        for f in futures:
            f.cancel()

    with host().abortable(task_key, cancel):
        return gather_requests(futures, return_exceptions=return_exceptions)


def default_num_threads(workers_on_this_machine: int) -> int:
    """torch threads per engine: the machine's cores shared among its workers."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_this_machine))


def in_worker() -> bool:
    """Whether this code runs in a task on a Dask worker."""
    try:
        get_worker()
        return True
    except ValueError:
        return False


# The priority of the worker task a thread computes for (a server's part runs its calls on
# helper threads, whose inner task keys Dask never saw): a context variable, copied with the context.
_inherited_priority: contextvars.ContextVar[int | None] = contextvars.ContextVar("daskllm_priority", default=None)


def task_priority(task_key: str) -> int:
    """The engine priority of the running task ``task_key``: the first element of its Dask
    priority (the submission's ``priority=`` negated, so lower runs first, as engines order),
    which makes a request's deadline order the engine's waiting queue too. Inside
    :func:`priority_of`, that task's. 0 outside a worker."""
    inherited = _inherited_priority.get()
    if inherited is not None:
        return inherited
    try:
        ts = get_worker().state.tasks.get(task_key)
    except ValueError:
        return 0
    return int(ts.priority[0]) if ts is not None and ts.priority else 0


@contextlib.contextmanager
def priority_of(task_key: str):
    """Calls made in this context (and in contexts copied from it) carry ``task_key``'s priority."""
    token = _inherited_priority.set(task_priority(task_key))
    try:
        yield
    finally:
        _inherited_priority.reset(token)
