"""Plain task functions for Dask users: one model call per task, on the worker's resident engine.

    client.submit(daskllm.worker.generate, "smollm2", "Hello", SamplingParams(max_tokens=8))

They run against the engines of the worker executing them (loaded into this process
outside a cluster). daskllm's own planned tasks are in :mod:`daskllm.worker.execute`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from daskllm.engines import Completion, PrefillHandle, SamplingParams
from daskllm.worker.host import get_engine


def generate(model: str, prompts: str | list, params: SamplingParams | None = None) -> Completion | list[Completion]:
    """Generate on this worker's resident engine (one prompt, or a list together)."""
    engine = get_engine(model)
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        return engine.generate(prompts, params)
    return engine.submit(prompts, params).result()


def prefill(model: str, prefix) -> PrefillHandle:
    """Put ``prefix`` in this worker's prefix cache."""
    return get_engine(model).prefill(prefix)


def embed(model: str, texts: Sequence[str]) -> np.ndarray:
    """``[len(texts), dim]`` unit vectors from this worker's embed engine."""
    return get_engine(model, "embed").embed([texts] if isinstance(texts, str) else list(texts))


def rerank(model: str, query: str, docs: Sequence[str], k: int | None = None) -> list[tuple[int, float]]:
    """(document position, score) of the best ``k`` documents for ``query``."""
    return get_engine(model, "rerank").rerank(query, docs, k)
