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
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from distributed import WorkerPlugin, get_worker

from daskllm.engines import KINDS, Completion, Engine, EngineSpec, PrefillHandle, SamplingParams

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
        self.specs = ([EngineSpec.parse(m, "llm") for m in models] + [EngineSpec.parse(m, "embed") for m in embedders]
                      + [EngineSpec.parse(m, "rerank") for m in rerankers])
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
        from distributed.diagnostics import nvml

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
    from daskllm.engines.reranker import is_cross_encoder
    from daskllm.models import resolve

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


class UsageLog(OrderedDict):
    """What each task really executed, by task key; the oldest entries go first past a bound."""

    def __init__(self, limit: int = 200_000):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


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
        from daskllm.models import model_name

        engine = engines.get(model_name(model))
    if engine is None and isinstance(plugin, LocalHost):
        return plugin.load(model, kind)
    if engine is None:
        raise LookupError(f"{kind} model {model!r} is not resident on worker {get_worker().address}; "
                          f"it holds {sorted(engines)}")
    return engine


def generate(model: str, prompts: str | list, params: SamplingParams | None = None) -> Completion | list[Completion]:
    """Task function: generate on this worker's resident engine (one prompt, or a list together)."""
    engine = get_engine(model)
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        return engine.generate(prompts, params)
    return engine.submit(prompts, params).result()


def prefill(model: str, prefix) -> PrefillHandle:
    """Task function: put ``prefix`` in this worker's prefix cache."""
    return get_engine(model).prefill(prefix)


def engine_stats(dask_worker=None, kind: str = "llm") -> dict[str, dict]:
    """Counters of a worker's engines of one kind; use with ``client.run(engine_stats)``."""
    plugin = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    if plugin is None:
        return {}
    return {name: e.stats().as_dict() for name, e in plugin.engines.get(kind, {}).items()}


def reset_prefix_caches(dask_worker=None) -> int:
    """Drop every cached prefix no running request uses; ``client.run(reset_prefix_caches)``."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else host()
    return sum(bool(e.reset_prefix_cache()) for e in plugin.engines.get("llm", {}).values()) if plugin else 0


def cold_start(client, timeout: float = 30) -> None:
    """Empty every cache a computation could reuse, for measurements from cold: the result
    caches of the client and of every worker (nested plans run there) and the workers' prefix
    caches, once the previous computation's tasks are forgotten (results still held by the
    scheduler would be reused by an identical graph), until the scheduler's view of the
    caches is empty too."""
    from daskllm.rewrite.cache import RESULTS

    def leftovers(dask_scheduler):
        return sum(1 for ts in dask_scheduler.tasks.values() if not ts.who_wants)

    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)
    RESULTS.clear()
    client.run(_clear_results)

    def reported(dask_scheduler):
        return sum(len(h) for ws in dask_scheduler.workers.values()
                   for h in ((ws.metrics or {}).get("daskllm") or {}).get("cache", {}).values())

    deadline = time.monotonic() + timeout
    while True:
        client.run(reset_prefix_caches)  # again: a request still running (e.g. cancelled) keeps its blocks
        if client.run_on_scheduler(reported) == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefix caches still reported non-empty after {timeout} s")
        time.sleep(0.5)


def _clear_results() -> None:
    from daskllm.rewrite.cache import RESULTS

    RESULTS.clear()


def resident_models(client, kind: str = "llm") -> dict[str, list[str]]:
    """Which models of one kind each worker of ``client``'s cluster holds right now."""

    def models(dask_worker) -> list[str]:
        plugin = dask_worker.plugins.get(PLUGIN_NAME)
        return sorted(plugin.engines.get(kind, {})) if plugin is not None else []

    return client.run(models)


class ModelNotServedError(LookupError):
    """Work names a model that no worker of the cluster holds."""


def _submitting_client():
    """The default client of a script submitting work, or None (no client, an asynchronous
    one, or code running inside a task, whose plans were checked when the job was submitted)."""
    try:
        get_worker()
        return None
    except ValueError:
        pass
    try:
        from distributed import default_client

        client = default_client()
    except ValueError:
        return None
    return None if client.asynchronous else client


def _workers_info(client) -> list[dict]:
    try:
        return list(client.scheduler_info(n_workers=-1)["workers"].values())
    except TypeError:  # older distributed: every worker without asking
        return list(client.scheduler_info()["workers"].values())


def check_served(needed: Iterable[tuple[str, str]]) -> None:
    """Raise :class:`ModelNotServedError` if a ``(kind, model)`` in ``needed`` is held by no
    worker of the current cluster, naming what the workers hold. Asks the scheduler once; does
    nothing without a client, inside a task, or while no worker reports daskllm engines."""
    from daskllm.models import model_name

    needed = set(needed)
    client = _submitting_client() if needed else None
    if client is None:
        return
    held: dict[str, dict[str, int]] = {}
    reporting = 0
    for info in _workers_info(client):
        daskllm_metrics = (info.get("metrics") or {}).get("daskllm")
        if not daskllm_metrics:
            continue
        reporting += 1
        for kind, names in (daskllm_metrics.get("models") or {}).items():
            for name in names:
                held.setdefault(kind, {})[name] = held.get(kind, {}).get(name, 0) + 1
    if not reporting:
        return
    missing = sorted((kind, model) for kind, model in needed if model_name(model) not in held.get(kind, {}))
    if not missing:
        return
    holdings = "; ".join(f"{kind}: " + ", ".join(f"{name} ({count} worker{'s' * (count > 1)})"
                                                for name, count in sorted(models.items()))
                         for kind, models in sorted(held.items()) if models) or "nothing"
    wanted = ", ".join(f"{kind} model {model!r}" for kind, model in missing)
    names = [model for kind, model in missing if kind == "llm"]
    hint = (f"; start workers with it (LocalLLMCluster(models={names!r}), or `dask worker ... --preload "
            f"daskllm.preload --daskllm-model {names[0]}`) or name a model they hold (model=...)" if names
            else "; start workers with it (LocalLLMCluster(embedders=..., rerankers=...)) or name one they hold")
    raise ModelNotServedError(f"no worker serves the {wanted}; the cluster's {reporting} worker"
                              f"{'s hold' if reporting > 1 else ' holds'} {holdings}{hint}")


def workers_holding(model: str, kind: str = "llm", memo: dict | None = None) -> int:
    """How many workers of the current cluster hold ``model`` (1 without a cluster), from the
    scheduler's view of their heartbeats. With ``memo`` (e.g. one per plan), asked once."""
    if memo is not None:
        if (model, kind) not in memo:
            memo[model, kind] = workers_holding(model, kind)
        return memo[model, kind]
    try:
        from distributed import default_client

        client = default_client()
    except ValueError:
        return 1
    if client.asynchronous:
        return 1
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
    except TypeError:
        workers = client.scheduler_info()["workers"].values()
    holding = sum(model in ((w.get("metrics") or {}).get("daskllm") or {}).get("models", {}).get(kind, ())
                  for w in workers)
    return max(1, holding)


def default_num_threads(workers_on_this_machine: int) -> int:
    """torch threads per engine: the machine's cores shared among its workers."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_this_machine))
