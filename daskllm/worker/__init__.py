"""Worker-side execution: engines kept resident, the planned tasks' functions, stream ends,
index shards and the per-process result store. Nothing here imports the planner.

* :mod:`~daskllm.worker.host`: :class:`EngineHost`, the WorkerPlugin keeping engines resident
* :mod:`~daskllm.worker.execute`: what each planned task runs (prefill, decode, embed, ...)
* :mod:`~daskllm.worker.streams` / :mod:`~daskllm.worker.consumer`: the two ends of a stream
* :mod:`~daskllm.worker.indexes`: vector-index shards held by the worker
* :mod:`~daskllm.worker.results`: remembered results of deterministic calls
* :mod:`~daskllm.worker.calls`: plain task functions for Dask users (one model call per task)
* :mod:`~daskllm.worker.control`: what a client runs on every worker (counters, cache resets)
* :mod:`~daskllm.worker.calibrations`: measured costs remembered on disk per model, numerics and machine
"""

from daskllm.worker.calls import embed, generate, prefill, rerank
from daskllm.worker.control import engine_stats, reset_prefix_caches, resident_models
from daskllm.worker.host import (PLUGIN_NAME, EngineHost, EngineLoadError, LocalHost, default_num_threads, get_engine,
                                 gpu_metrics, host, local_host)

__all__ = ["PLUGIN_NAME", "EngineHost", "EngineLoadError", "LocalHost", "default_num_threads", "embed", "engine_stats",
           "generate", "get_engine", "gpu_metrics", "host", "local_host", "prefill", "rerank", "reset_prefix_caches",
           "resident_models"]
