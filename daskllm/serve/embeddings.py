"""What ``/v1/embeddings`` adds to ``daskllm.embed``: token-id input, ``dimensions`` and token counts.

Token ids are the embedding model's own (as vLLM takes them, not OpenAI's tiktoken ids): they
are decoded with its tokenizer and embedded as that text, so the ids of a text, as its
tokenizer gives them, embed as the text does. ``dimensions`` shortens the vectors of a model
trained for it (Matryoshka representation learning: its ``config.json`` says
``is_matryoshka`` or lists ``matryoshka_dimensions``, vLLM's convention) to their first
``dimensions`` values, made unit length again; any other model gives only its own size, since
a prefix of a vector it was not trained to front-load loses what a search needs.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskllm.engines.embedder import load_tokenizer, sentence_transformers_config
from daskllm.models import resolve
from daskllm.serve.openai_api import APIError


@dataclass(frozen=True)
class Embedder:
    """An embedding model as the server sees it: its Matryoshka sizes, and its tokenizer as its
    engine tokenizes (each text alone, cut at the model's limit)."""

    model: str
    matryoshka: bool | tuple[int, ...]  # False: no shortening; True: any size; a tuple: these sizes
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @classmethod
    @functools.cache
    def of(cls, model: str) -> Embedder:
        path = resolve(model)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        sizes = config.get("matryoshka_dimensions")
        matryoshka = tuple(sizes) if sizes else bool(config.get("is_matryoshka"))
        return cls(model, matryoshka, load_tokenizer(path, sentence_transformers_config(path)[0]))

    def texts(self, inputs: list[str | list[int]]) -> list[str]:
        """Each input as the text the engine embeds: token ids decoded by the model's tokenizer."""
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, list):
                if max(item) >= len(self.tokenizer):
                    raise APIError(f"input[{i}]: token id {max(item)} is not in {self.model}'s vocabulary of "
                                   f"{len(self.tokenizer)}", param="input")
                item = self.tokenizer.decode(item, skip_special_tokens=True)
            out.append(item)
        return out

    def tokens(self, texts: list[str]) -> int:
        """Tokens the engine embeds of ``texts`` (the response's usage)."""
        return sum(len(e.ids) for e in self.tokenizer.backend_tokenizer.encode_batch(texts))

    def check(self, dimensions: int | None, size: int) -> None:
        """A 400 naming ``dimensions`` unless this model gives vectors of that size (its own is ``size``)."""
        if dimensions is None or dimensions == size:
            return
        if self.matryoshka is False:
            raise APIError(f"dimensions: {self.model} gives {size}-dimensional vectors only (it is not trained "
                           f"for shortened ones: no is_matryoshka or matryoshka_dimensions in its config.json)",
                           param="dimensions")
        allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else range(1, size + 1)
        if dimensions not in allowed:
            raise APIError(f"dimensions: {self.model} gives vectors of "
                           f"{list(allowed) if isinstance(allowed, tuple) else f'1 to {size}'} dimensions, "
                           f"not {dimensions}", param="dimensions")


def shortened(vectors: list[np.ndarray], dimensions: int | None) -> list[np.ndarray]:
    """Matryoshka shortening: the first ``dimensions`` values of each vector, unit length again."""
    if dimensions is None:
        return vectors
    heads = [np.asarray(v, dtype=np.float32)[:dimensions] for v in vectors]
    return [h / max(float(np.linalg.norm(h)), 1e-12) for h in heads]
