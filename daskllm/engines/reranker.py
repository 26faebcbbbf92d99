"""Rerankers: score documents against a query and keep the best ``k``.

The default is a bi-encoder on MiniLM: the cosine of query and document embeddings,
computed by an :class:`~daskllm.engines.embedder.EmbedEngine` (shared with the worker's
embed engine when both use the same model). Any cross-encoder directory (a
``*ForSequenceClassification`` checkpoint) scores (query, document) pairs jointly instead.

Ranking is by score, then by document position, so equal scores always rank the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import numpy as np
import torch

from daskllm import models
from daskllm.engines import compute
from daskllm.engines.batcher import Batcher
from daskllm.engines.embedder import EmbedEngine
from daskllm.engines.protocol import RequestError
from daskllm.models import is_cross_encoder


@dataclass(slots=True)
class RerankStats:
    requests: int = 0
    pairs: int = 0
    batches: int = 0
    failed: int = 0
    busy_seconds: float = 0.0
    waiting: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """(document index, score) of the ``k`` best, by score then index."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:k]
    return [(i, float(scores[i])) for i in order]


def _validate(query, docs) -> list[str]:
    if not isinstance(query, str):
        raise RequestError(f"rerank query must be a str, got {type(query).__name__}")
    if isinstance(docs, str):
        raise RequestError("rerank docs must be a list of str, got one str")
    docs = list(docs)
    for i, d in enumerate(docs):
        if not isinstance(d, str):
            raise RequestError(f"rerank doc {i} is a {type(d).__name__}, not a str: {d!r:.80}")
    return docs


class BiEncoderReranker:
    """Cosine similarity of embeddings (the default: no reranker weights are needed)."""

    kind = "rerank"

    def __init__(self, model: str | os.PathLike = "all-MiniLM-L6-v2", *, name: str | None = None,
                 embedder: EmbedEngine | None = None, **embed_options):
        self.name = name or models.model_name(model)
        self._owns_embedder = embedder is None
        self.embedder = embedder or EmbedEngine(model, name=f"{self.name}-embed", **embed_options)
        self._stats = RerankStats()

    def submit(self, query: str, docs: Sequence[str]) -> Future[np.ndarray]:
        docs = _validate(query, docs)
        self._stats.requests += 1
        self._stats.pairs += len(docs)
        inner = self.embedder.submit([query, *docs])
        result: Future[np.ndarray] = Future()

        def done(f: Future):
            if f.exception() is not None:
                self._stats.failed += 1
                result.set_exception(f.exception())
                return
            vectors = f.result().astype(np.float64)
            # Per-pair dot products: a document's score does not depend on the others.
            result.set_result((vectors[1:] * vectors[0]).sum(axis=1))

        inner.add_done_callback(done)
        return result

    def scores(self, query: str, docs: Sequence[str]) -> np.ndarray:
        return self.submit(query, docs).result()

    def rerank(self, query: str, docs: Sequence[str], k: int | None = None) -> list[tuple[int, float]]:
        return top_k(self.scores(query, docs), len(docs) if k is None else k)

    def stats(self) -> RerankStats:
        s = RerankStats(**asdict(self._stats))
        e = self.embedder.stats()
        s.batches, s.busy_seconds, s.waiting = e.batches, e.busy_seconds, e.waiting
        return s

    def close(self) -> None:
        if self._owns_embedder:
            self.embedder.close()


class CrossEncoderReranker:
    """A sequence-classification model scoring (query, document) pairs, batched across requests."""

    kind = "rerank"

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, device: str | None = None,
                 max_batch_pairs: int = 64, num_threads: int | None = None, backend: str = "torch", **_ignored):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = models.resolve(model)
        self.name = name or models.model_name(model)
        if num_threads:
            compute.set_num_threads(int(num_threads))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._stats = RerankStats()
        if backend == "vllm":
            from daskllm.engines.vllm import PoolingModel  # vLLM only on the workers that use it

            self.model = PoolingModel(path)
            run = self.model.score
        else:
            # loaded, like every batch, on the compute thread (engines/compute.py)
            self.model = compute.run(lambda: AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval())
            run = self._run
        self._batcher: Batcher[tuple[str, str], float] = Batcher(run, max_batch_items=max_batch_pairs,
                                                                 name=f"rerank-{self.name}")

    def submit(self, query: str, docs: Sequence[str]) -> Future[np.ndarray]:
        docs = _validate(query, docs)
        self._stats.requests += 1
        self._stats.pairs += len(docs)
        result: Future[np.ndarray] = Future()
        if not docs:
            result.set_result(np.zeros(0))
            return result
        inner = self._batcher.submit([(query, d) for d in docs])
        inner.add_done_callback(lambda f: result.set_exception(f.exception()) if f.exception() is not None
                                else result.set_result(np.asarray(f.result(), dtype=np.float64)))
        return result

    def scores(self, query: str, docs: Sequence[str]) -> np.ndarray:
        return self.submit(query, docs).result()

    def rerank(self, query: str, docs: Sequence[str], k: int | None = None) -> list[tuple[int, float]]:
        return top_k(self.scores(query, docs), len(docs) if k is None else k)

    @torch.inference_mode()
    def _run(self, pairs: list[tuple[str, str]]) -> list[float]:
        enc = self.tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True,
                             return_tensors="pt").to(self.device)
        logits = self.model(**enc).logits
        return (logits[:, 0] if logits.shape[-1] == 1 else logits[:, -1]).float().cpu().tolist()

    def stats(self) -> RerankStats:
        b = self._batcher
        return RerankStats(self._stats.requests, self._stats.pairs, b.batches, b.failed, b.busy_seconds, b.waiting)

    def close(self) -> None:
        self._batcher.close()
        if hasattr(self.model, "close"):
            self.model.close()


def load_reranker(model: str | os.PathLike = "all-MiniLM-L6-v2", **options):
    """A cross-encoder for sequence-classification checkpoints, else a bi-encoder."""
    if is_cross_encoder(models.resolve(model)):
        options.pop("embedder", None)
        return CrossEncoderReranker(model, **options)
    return BiEncoderReranker(model, **options)
