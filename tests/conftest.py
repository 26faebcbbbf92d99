"""Shared pytest fixtures."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import dask.config
import pytest


@pytest.fixture(scope="session")
def daskllm_cache(request, tmp_path_factory) -> Iterator[str]:
    """One model/corpus cache for the session and its children.

    DASKLLM_CACHE_DIR is exported so subprocesses and Dask workers resolve the same
    directory instead of building their own copy; the pytest cache keeps builds across
    sessions.
    """
    shared = os.environ.get("DASKLLM_CACHE_DIR")
    if not shared:
        pytest_cache = getattr(request.config, "cache", None)
        if pytest_cache is not None:
            shared = str(pytest_cache.mkdir("daskllm-models"))
        else:  # cacheprovider disabled (-p no:cacheprovider)
            shared = str(tmp_path_factory.mktemp("daskllm-models"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DASKLLM_CACHE_DIR", shared)
        with dask.config.set({"daskllm.models.cache-dir": shared}):
            yield shared


# The environment variable Dask reads for daskllm.model: tests of mechanics default to `tiny`
# (fast, random weights); the tests that run the real model name `smollm2`, and the docs'
# examples run without this variable, as a user would.
DEFAULT_MODEL_ENV = "DASK_DASKLLM__MODEL"


@pytest.fixture(scope="session", autouse=True)
def mechanics_use_tiny() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(DEFAULT_MODEL_ENV, "tiny")
        with dask.config.set({"daskllm.model": "tiny"}):
            yield


@pytest.fixture(scope="session")
def smollm2_model_dir(daskllm_cache) -> pathlib.Path:
    """The real model, SmolLM2-135M-Instruct, converted once into the shared cache."""
    from daskllm.models import resolve

    return resolve("smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(daskllm_cache) -> pathlib.Path:
    """The `tiny` recipe, built once into the shared cache."""
    from daskllm.models import resolve

    return resolve("tiny")


@pytest.fixture(scope="session")
def stdlib_corpus(daskllm_cache) -> pathlib.Path:
    """The stdlib documentation table's parquet file, built once into the shared cache."""
    from daskllm.corpus import corpus_path

    return corpus_path()
