"""Engines resident on Dask workers.

:class:`EngineHost` is a ``WorkerPlugin``: it loads the configured engines once per worker
process at setup and closes them at teardown. A task running on that worker finds its
engine with :func:`get_engine`; many tasks running at once on one worker all feed the same
engine (one copy of the weights, requests batched together).

A worker advertises the models it holds in its heartbeat metrics (``ws.metrics["daskllm"]``
on the scheduler) and with a ``daskllm`` event when its engines come up.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping

from distributed import WorkerPlugin, get_worker

from daskllm.engines import Completion, Engine, EngineSpec, PrefillHandle, SamplingParams

logger = logging.getLogger(__name__)

PLUGIN_NAME = "daskllm-engines"


class EngineLoadError(RuntimeError):
    """A configured model could not be loaded; the worker keeps no engine at all."""


class EngineHost(WorkerPlugin):
    """Keeps one engine per configured model resident in a worker process."""

    name = PLUGIN_NAME

    def __init__(self, models: Iterable[str | Mapping | EngineSpec], **engine_defaults):
        self.specs = [EngineSpec.parse(m) for m in models]
        if not self.specs:
            raise ValueError("EngineHost needs at least one model")
        names = [s.engine_name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"two engines would share a name: {names}")
        self.engine_defaults = engine_defaults
        self.engines: dict[str, Engine] = {}

    def __getstate__(self):
        return {"specs": self.specs, "engine_defaults": self.engine_defaults, "engines": {}, "_announced": True}

    async def setup(self, worker) -> None:
        # Loading takes seconds: keep the worker's event loop (heartbeats) responsive.
        self.engines = await asyncio.to_thread(load_engines, self.specs, self.engine_defaults)
        self._announced = False
        worker.metrics["daskllm"] = self.metrics

    def teardown(self, worker) -> None:
        worker.metrics.pop("daskllm", None)
        engines, self.engines = self.engines, {}
        for engine in engines.values():
            engine.close()

    def metrics(self, worker=None) -> dict:
        """Small and msgpack-friendly: sent to the scheduler with every heartbeat."""
        if worker is not None and not getattr(self, "_announced", True) and _connected(worker):
            # Announced from a heartbeat: at setup (and at registration) the worker is not yet
            # connected to the scheduler, and Dask drops events logged before it is.
            self._announced = True
            worker.log_event("daskllm", {"action": "engines-loaded", "worker": worker.address,
                                         "models": sorted(self.engines)})
        return {
            "models": sorted(self.engines),
            "engines": {name: e.stats().as_dict() for name, e in self.engines.items()},
        }


def _connected(worker) -> bool:
    stream = getattr(worker, "batched_stream", None)
    return bool(stream and stream.comm and not stream.comm.closed())


def load_engines(specs: Iterable[EngineSpec], defaults: Mapping | None = None) -> dict[str, Engine]:
    """Load every spec, or none: on any failure the loaded ones are closed and the error names the model."""
    engines: dict[str, Engine] = {}
    try:
        for spec in specs:
            try:
                engines[spec.engine_name] = spec.load(**(defaults or {}))
            except Exception as exc:
                raise EngineLoadError(f"could not load model {spec.model!r} ({spec.backend} backend): {exc}") from exc
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return engines


def get_engine(model: str) -> Engine:
    """The engine for ``model`` on the worker running the current task."""
    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError(f"get_engine({model!r}) must run inside a task on a daskllm worker") from None
    host = worker.plugins.get(PLUGIN_NAME)
    if host is None or not host.engines:
        raise LookupError(f"worker {worker.address} holds no daskllm engines; start workers with "
                          f"LocalLLMCluster(models=...) or `dask worker --preload daskllm.preload --model ...`")
    engine = host.engines.get(model)
    if engine is None:
        from daskllm.models import model_name

        engine = host.engines.get(model_name(model))
    if engine is None:
        raise LookupError(f"model {model!r} is not resident on worker {worker.address}; "
                          f"it holds {sorted(host.engines)}")
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


def engine_stats(dask_worker=None) -> dict[str, dict]:
    """Counters of every engine on a worker; use with ``client.run(engine_stats)``."""
    host = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return {name: e.stats().as_dict() for name, e in host.engines.items()} if host is not None else {}


def resident_models(client) -> dict[str, list[str]]:
    """Which models each worker of ``client``'s cluster holds right now."""

    def models(dask_worker) -> list[str]:
        host = dask_worker.plugins.get(PLUGIN_NAME)
        return sorted(host.engines) if host is not None else []

    return client.run(models)


def default_num_threads(workers_on_this_machine: int) -> int:
    """torch threads per engine: the machine's cores shared among its workers."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_on_this_machine))
