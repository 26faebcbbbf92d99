"""Engines: the Engine protocol and the backends that implement it.

An :class:`EngineSpec` says which model a worker should keep resident and on which
backend; ``spec.load()`` builds the engine. Backends import lazily: vLLM only when a
vLLM engine is asked for. The backend is ``torch``, ``vllm``, ``llamacpp`` (a GGUF file on
llama.cpp: the CPU's fast path, the ``cpu`` extra), ``auto`` (vLLM where the loading process
has a CUDA GPU and vllm imports; else llama.cpp where it is installed and the model is a GGUF
file; else torch) or ``openai`` (an OpenAI-compatible endpoint serves the model; only its
tokenizer is loaded here); a spec that names none takes ``daskllm.engine.backend`` from the
config of the process that loads it. ``llamacpp`` and ``openai`` serve LLMs: embedders and
rerankers stay on torch (or vLLM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daskllm import config
from daskllm.engines.protocol import (
    CacheState,
    Completion,
    Engine,
    EngineStats,
    PrefillHandle,
    RequestError,
    SamplingParams,
    StructuredOutput,
)
from daskllm import models
from daskllm.models import model_name

BACKENDS = ("torch", "vllm", "llamacpp", "auto", "openai")
LLM_ONLY_BACKENDS = ("openai", "llamacpp")  # embedders and rerankers stay on the local default
KINDS = ("llm", "embed", "rerank")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """A model to keep resident: a recipe name or a local Hugging Face directory."""

    model: str
    name: str | None = None  # what tasks call it; default: the recipe name or directory name
    backend: str | None = None  # torch, vllm, llamacpp, auto, openai; None: daskllm.engine.backend
    kind: str = "llm"  # llm (generate/prefill), embed, or rerank
    options: Mapping[str, Any] = field(default_factory=dict)  # passed to the engine constructor

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"EngineSpec.model must be a recipe name or a directory path, got {self.model!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"EngineSpec.backend for model {self.model!r} must be one of {BACKENDS}, "
                             f"got {self.backend!r}")
        if self.kind not in KINDS:
            raise ValueError(f"EngineSpec.kind for model {self.model!r} must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "options", dict(self.options))

    @classmethod
    def parse(cls, value: str | Mapping | EngineSpec, kind: str = "llm") -> EngineSpec:
        if isinstance(value, EngineSpec):
            return value
        if isinstance(value, str):
            return cls(model=value, kind=kind)
        if isinstance(value, Mapping):
            return cls(**{"kind": kind, **value})
        raise TypeError(f"a model is a name, a directory, a dict or an EngineSpec; got {value!r}")

    @classmethod
    def expand(cls, models: Iterable = (), embedders: Iterable = (), rerankers: Iterable = (), *,
               backend: str | None = None, llm_options: Mapping | None = None) -> list[EngineSpec]:
        """Specs for the models, embedders and rerankers a worker keeps resident (names, dicts or
        specs); ``backend`` applies to specs that name none, ``llm_options`` to every LLM spec's
        options that it does not set itself. ``openai`` and ``llamacpp`` apply to LLMs only:
        embedders and rerankers stay on the configured local backend."""
        specs = ([cls.parse(m, "llm") for m in models] + [cls.parse(m, "embed") for m in embedders]
                 + [cls.parse(m, "rerank") for m in rerankers])
        out = []
        for spec in specs:
            if backend is not None and spec.backend is None and (backend not in LLM_ONLY_BACKENDS
                                                                 or spec.kind == "llm"):
                spec = dataclasses.replace(spec, backend=backend)
            if llm_options and spec.kind == "llm":
                spec = dataclasses.replace(spec, options={**llm_options, **spec.options})
            out.append(spec)
        return out

    @property
    def engine_name(self) -> str:
        return self.name or model_name(self.model)

    def resolved_backend(self) -> str:
        """The backend this process would load the spec on (``auto`` decided here)."""
        backend = self.backend or config.get("engine.backend")
        if backend not in BACKENDS:
            raise ValueError(f"daskllm.engine.backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = "vllm" if _cuda_with_vllm() else "torch"
            if backend == "torch" and self.kind == "llm" and self._has_gguf():
                from daskllm.engines.llamacpp import unavailable_reason as no_llamacpp

                backend = "torch" if no_llamacpp() else "llamacpp"
        if backend == "llamacpp" and self.kind != "llm":
            backend = "torch"  # llama.cpp here serves LLMs; embedders and rerankers run on torch
        if backend == "vllm" and self.kind != "llm" and not _cuda():
            # On CPU, vLLM serves LLMs: a pooling engine would be another vLLM process per
            # worker (seconds of start-up, a GB of memory) for a small encoder torch serves well.
            backend = "torch"
        return backend

    def _has_gguf(self) -> bool:
        try:
            models.resolve_gguf(self.model)
        except (models.ModelNotFoundError, OSError):
            return False
        return True

    def load(self, **defaults) -> Engine:
        """Build the engine; ``defaults`` are options the spec does not set itself.

        Each backend is imported here, when it is built: torch and vLLM are heavy, and a
        client, a scheduler or a CPU worker must not load what it never runs."""
        options = {**defaults, **self.options}
        backend = self.resolved_backend()
        if backend == "openai":
            if self.kind != "llm":
                raise ValueError(f"the openai backend serves LLMs, not {self.kind} models ({self.model!r})")
            from daskllm.engines.remote import RemoteEngine

            # A worker's defaults (torch threads, cache sizes) are for local engines: only those
            # a remote engine takes apply; its own options must all be its own.
            options = {**{k: v for k, v in defaults.items() if k in RemoteEngine.OPTIONS}, **self.options}
            return RemoteEngine(self.model, name=self.engine_name, **options)
        if self.kind != "llm" and backend == "vllm":
            options.pop("num_threads", None)  # vLLM's pooling runner takes no thread count
            options["backend"] = "vllm"  # embedding and reranking on vLLM's pooling runner
        if self.kind == "embed":
            from daskllm.engines.embedder import EmbedEngine

            return EmbedEngine(self.model, name=self.engine_name, **options)
        if self.kind == "rerank":
            from daskllm.engines.reranker import load_reranker

            return load_reranker(self.model, name=self.engine_name, **options)
        if backend == "vllm":
            from daskllm.engines.vllm import VLLMEngine

            return VLLMEngine(self.model, name=self.engine_name, **options)
        if backend == "llamacpp":
            from daskllm.engines.llamacpp import LlamaCppEngine

            return LlamaCppEngine(self.model, name=self.engine_name, **options)
        from daskllm.engines.torch_engine import TorchEngine

        return TorchEngine(self.model, name=self.engine_name, **options)


def runs_vllm(specs: Iterable[EngineSpec]) -> bool:
    """Whether a worker holding ``specs`` (on this machine) runs a vLLM engine, ``auto``
    decided as the worker will decide it: what needs non-daemonic workers and vLLM's settings."""
    return any(s.kind == "llm" and s.resolved_backend() == "vllm" for s in specs)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_with_vllm() -> bool:
    """``auto``'s rule for vLLM: a CUDA GPU and an importable vllm. On CPU machines the torch and
    llama.cpp engines serve: vLLM's CPU build starts in 35-55 s against their few seconds
    (docs/vllm.md, "vLLM on CPU")."""
    if not _cuda():
        return False
    from daskllm.engines.vllm import unavailable_reason  # here: vllm is imported only where it may serve

    return unavailable_reason() is None


__all__ = ["BACKENDS", "CacheState", "Completion", "Engine", "EngineSpec", "EngineStats", "PrefillHandle",
           "RequestError", "SamplingParams", "StructuredOutput"]
