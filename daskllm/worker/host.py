"""Engines and index shards resident on Dask workers.

:class:`EngineHost` is a ``WorkerPlugin``: it loads the configured engines once per worker
process at setup and closes them at teardown. Engines are of three kinds: ``llm``
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
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping

from distributed import WorkerPlugin, get_worker
from distributed.diagnostics import nvml

from daskllm.engines import KINDS, Engine, EngineSpec
from daskllm.models import is_cross_encoder, model_name, resolve
from daskllm.worker.usage import UsageLog

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskllm-engines"


class EngineLoadError(RuntimeError):
    """A configured model could not be loaded; the worker keeps no engine at all."""


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
        self.engines: dict[str, dict[str, Engine]] = {kind: {} for kind in KINDS}
        self.indexes: dict[str, dict[int, object]] = {}  # index name -> shard number -> VectorIndex
        self.usage = UsageLog()

    def __getstate__(self):
        return {"specs": self.specs, "engine_defaults": self.engine_defaults,
                "engines": {kind: {} for kind in KINDS}, "indexes": {}, "usage": UsageLog(), "_announced": True}

    async def setup(self, worker) -> None:
        # Loading takes seconds: keep the worker's event loop (heartbeats) responsive.
        self.engines = await asyncio.to_thread(load_engines, self.specs, self.engine_defaults)
        self._announced = False
        worker.metrics["daskllm"] = self.metrics

    def teardown(self, worker) -> None:
        worker.metrics.pop("daskllm", None)
        engines, self.engines = self.engines, {kind: {} for kind in KINDS}
        self.indexes = {}
        close_engines(engines)

    def models(self) -> dict[str, list[str]]:
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
    engines: dict[str, dict[str, Engine]] = {kind: {} for kind in KINDS}
    try:
        for spec in sorted(specs, key=lambda s: KINDS.index(s.kind)):
            try:
                options = dict(defaults or {})
                if spec.kind == "rerank" and not is_cross_encoder(resolve(spec.model)):
                    path = resolve(spec.model)
                    shared = next((e for e in engines["embed"].values() if e.path == path), None)
                    if shared is not None:
                        options["embedder"] = shared
                engines[spec.kind][spec.engine_name] = spec.load(**options)
            except Exception as exc:
                raise EngineLoadError(f"could not load {spec.kind} model {spec.model!r} ({spec.backend or 'configured'} backend): "
                                      f"{exc}") from exc
    except BaseException:
        close_engines(engines)
        raise
    return engines


def close_engines(engines: dict[str, dict[str, Engine]]) -> None:
    for kind in reversed(KINDS):  # rerankers first: they may share an embed engine
        for engine in engines.get(kind, {}).values():
            engine.close()


class LocalHost(EngineHost):
    """Engines in this process, loaded on first use: for computing without a cluster."""

    def __init__(self):
        self.specs, self.engine_defaults = [], {}
        self.engines = {kind: {} for kind in KINDS}
        self.indexes, self.usage = {}, UsageLog()
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
    engines = plugin.engines.get(kind, {})
    engine = engines.get(model)
    if engine is None:
        engine = engines.get(model_name(model))
    if engine is None and isinstance(plugin, LocalHost):
        return plugin.load(model, kind)
    if engine is None:
        raise LookupError(f"{kind} model {model!r} is not resident on worker {get_worker().address}; "
                          f"it holds {sorted(engines)}")
    return engine


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
