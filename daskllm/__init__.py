"""daskllm: Dask as an engine for LLM workflows."""

from __future__ import annotations

import importlib

from daskllm import config  # noqa: F401  (registers dask.config defaults)

__version__ = "0.1.0"

# Heavy modules (torch, transformers) load on first use, so a scheduler preload or
# `daskllm --help` stays fast.
_LAZY = {
    "LocalLLMCluster": "daskllm.cluster",
    "EngineHost": "daskllm.worker",
    "get_engine": "daskllm.worker",
    "SamplingParams": "daskllm.engines.protocol",
    "Completion": "daskllm.engines.protocol",
    "TorchEngine": "daskllm.engines.torch_engine",
    "models": "daskllm.models",
}


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, name)
    raise AttributeError(f"module 'daskllm' has no attribute {name!r}")


__all__ = sorted(_LAZY)
