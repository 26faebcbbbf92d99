"""Shared pytest fixtures."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import dask.config
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(request, tmp_path_factory) -> Iterator[pathlib.Path]:
    """The `tiny` recipe, built once into a cache shared by the session and its children.

    DASKLLM_CACHE_DIR is exported so subprocesses and Dask workers resolve the
    same directory instead of building their own copy; the pytest cache keeps the
    build across sessions.
    """
    from daskllm.models import resolve

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
            model_dir = resolve("tiny")
        yield model_dir
