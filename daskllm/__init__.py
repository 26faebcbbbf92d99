"""daskllm: Dask as an engine for LLM workflows."""

from __future__ import annotations

import importlib

from daskllm.quiet_start import quiet_until_started

quiet_until_started()  # the `daskllm` command only: a Ctrl-C while the modules below import

from daskllm import config  # noqa: E402,F401  (registers dask.config defaults)

__version__ = "0.1.0"

# Heavy modules (torch, transformers) load on first use, so a scheduler preload or
# `daskllm --help` stays fast.
_LAZY = {
    "prompt": "daskllm.api",
    "chat": "daskllm.api",
    "generate": "daskllm.api",
    "prefill": "daskllm.api",
    "embed": "daskllm.api",
    "search": "daskllm.api",
    "rerank": "daskllm.api",
    "gather": "daskllm.api",
    "pmap": "daskllm.api",
    "collect": "daskllm.api",
    "delimited": "daskllm.api",
    "words": "daskllm.api",
    "ItemError": "daskllm.streaming",
    "StreamJanitor": "daskllm.streaming",
    "Budget": "daskllm.budget",
    "Cascade": "daskllm.dataframe.cascade",
    "CallError": "daskllm.worker.failures",
    "batch": "daskllm.api",
    "tokens": "daskllm.api",
    "compute": "daskllm.api",
    "explain": "daskllm.api",
    "usage": "daskllm.runtime.metering",
    "ShardedIndex": "daskllm.retrieval",
    "LocalLLMCluster": "daskllm.cluster",
    "EngineHost": "daskllm.worker",
    "get_engine": "daskllm.worker",
    "SamplingParams": "daskllm.engines.protocol",
    "Completion": "daskllm.engines.protocol",
    "TorchEngine": "daskllm.engines.torch_engine",
}


# The ``.llm`` accessor on dask dataframes: registered with dask, so ``ddf.llm`` works after
# ``import daskllm`` (this imports pandas and dask.dataframe, not torch).
from daskllm import dataframe  # noqa: E402,F401


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'daskllm' has no attribute {name!r}")


__all__ = sorted(_LAZY)
