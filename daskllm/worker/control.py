"""Functions a client runs on every worker (``client.run``): counters, cache resets, holdings."""

from __future__ import annotations

import time
from collections.abc import Iterable

from distributed import get_worker

from daskllm.worker.host import PLUGIN_NAME, EngineLoadError, host
from daskllm.worker.results import RESULTS


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


def resident_models(client, kind: str = "llm") -> dict[str, list[str]]:
    """Which models of one kind each worker of ``client``'s cluster holds (once its engines,
    still loading on a worker that just started, are loaded)."""

    async def models(dask_worker) -> list[str]:
        plugin = dask_worker.plugins.get(PLUGIN_NAME)
        if plugin is None:
            return []
        await plugin.loaded()
        return sorted(plugin.engines.get(kind, {}))

    return client.run(models)


def wait_held(client, models: Iterable[str], poll: float = 0.1) -> None:
    """Block until some worker holds each LLM of ``models`` (its engines loaded, as it announces),
    or raise :class:`EngineLoadError` with a worker's error once one failed to load them while
    none holds them: the workers of one cluster load the same models, and would fail alike
    (their nannies restarting them to fail again). Loading has no deadline here: a first start
    may build a model."""
    wanted = set(models)
    while True:
        events = [event for _, event in client.get_events("daskllm") if isinstance(event, dict)]
        held = {name for e in events if e.get("action") == "engines-loaded"
                for name in (e.get("models") or {}).get("llm", ())}
        if wanted <= held:
            return
        failed = [e["error"] for e in events if e.get("action") == "engines-failed"]
        if failed:
            raise EngineLoadError(failed[0])
        time.sleep(poll)


def clear_results() -> None:
    """Forget this process's remembered results (nested plans run on workers use them)."""
    RESULTS.clear()
