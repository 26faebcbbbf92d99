"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

# Two test processes share the machine's cores (`make test` runs `-n 2`), and every cluster,
# subprocess and docs example they start inherits this: OpenMP threads that spin while they
# wait for work (libgomp's default) would take the cores the other process's models need
# (measured: four docs examples in two processes, 75 s with spinning, 57 s without).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dask.config
import pytest
from distributed import Client

import reaper
from daskllm import LocalLLMCluster
from helpers import VLLM_BLOCK, vllm_unavailable

CHECKOUT = str(pathlib.Path(__file__).resolve().parents[1])
REAPER = pytest.StashKey()  # the run's reaper process, kept for the session


def pytest_configure(config) -> None:
    """The run's first pytest process (xdist's workers inherit its tag) tags the run and starts
    its reaper, after ending what a killed earlier run of this checkout left (tests/reaper.py)."""
    if reaper.TAG in os.environ:
        return
    reaper.kill(reaper.leftovers(CHECKOUT))
    os.environ[reaper.TAG] = tag = reaper.this_run(CHECKOUT)
    config.stash[REAPER] = reaper.start(tag)


# A test using the llm_cluster fixture (directly or through another fixture) starts worker
# processes and loads engines: it is marked with this, and `-m "not slow"` leaves it out.
CLUSTER_MARK = "slow"


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "llm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(CLUSTER_MARK)


# Under pytest-xdist (`make test` runs `-n 2`), a module's tests go to one process, so they
# share its module-scoped clusters and engines; test_docs' block runs go by chain, so blocks
# joined by "continues" share their one run. (xdist's own --dist loadgroup does not work with
# pytest >= 9.2: it renames Item._nodeid, which pytest no longer reads.)
DOCS_RUNS = "tests/test_docs.py::test_python_block_runs["


def xdist_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or for a docs block run, its chain."""
    if nodeid.startswith(DOCS_RUNS) and nodeid.endswith("]"):
        from test_docs import chain_head

        return "docs:" + chain_head(nodeid[len(DOCS_RUNS):-1])
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: known only where xdist is installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return ByGroup(config, log)


@pytest.fixture
def stream_every_decode():
    """Streams every split decode feeding a pmap: ``tiny``'s decodes finish well within
    ``daskllm.rewrite.stream-min-seconds``, so the pipeline pass would not stream them."""
    with dask.config.set({"daskllm.rewrite.stream-min-seconds": 0}):
        yield


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


@pytest.fixture(scope="session", autouse=True)
def result_store_off(tmp_path_factory) -> Iterator[None]:
    """Tests count executed calls: the persistent result store is off unless a test switches it
    on (tests/test_result_store.py), and never points at the user's own store (the variables
    reach worker processes and subprocesses too)."""
    path = str(tmp_path_factory.mktemp("daskllm-results"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DASK_DASKLLM__RESULT_STORE__ENABLED", "False")
        monkeypatch.setenv("DASK_DASKLLM__RESULT_STORE__PATH", path)
        with dask.config.set({"daskllm.result-store.enabled": False, "daskllm.result-store.path": path}):
            yield


@pytest.fixture(scope="session", autouse=True)
def calibrations_apart(tmp_path_factory) -> Iterator[None]:
    """Calibrations the session's workers remember go to a directory of the session's own: a
    preview never finds one remembered by another run (the variable reaches worker processes)."""
    path = str(tmp_path_factory.mktemp("daskllm-calibrations"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DASK_DASKLLM__CALIBRATIONS__PATH", path)
        with dask.config.set({"daskllm.calibrations.path": path}):
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


@pytest.fixture(scope="session")
def vllm_engines(tiny_model_dir) -> Iterator[dict]:
    """The session's real vLLM engines on ``tiny`` (each starts in 35-55 s, so the modules that
    need one share these): ``main``, 4096 tokens of cache; ``small``, 512 tokens (16 blocks of
    32), prefill chunks of 32 tokens and 8 sequences a step: it evicts, preempts and chunks, and
    the engine protocol suite's last test closes it.
    Skips, saying why, where vLLM cannot run."""
    if reason := vllm_unavailable():
        pytest.skip(reason)
    from daskllm.engines import EngineSpec

    spec = EngineSpec(model=str(tiny_model_dir), name="tiny", backend="vllm")
    engines: dict = {}
    try:
        engines["main"] = spec.load(block_size=VLLM_BLOCK, kv_cache_tokens=4096)
        engines["small"] = spec.load(block_size=VLLM_BLOCK, kv_cache_tokens=512, max_num_batched_tokens=32,
                                     max_num_seqs=8)
        yield engines
    finally:
        for engine in engines.values():
            engine.close()


@contextlib.contextmanager
def _llm_cluster(models=("tiny",), *, n_workers: int = 2, threads_per_worker: int = 4, timeout: float = 120,
                 set_as_default: bool = True, **options) -> Iterator:
    """A LocalLLMCluster and a Client on it; the workers must be up within ``timeout`` seconds."""
    options.setdefault("dashboard_address", "127.0.0.1:0")
    with LocalLLMCluster(models=list(models), n_workers=n_workers, threads_per_worker=threads_per_worker,
                         **options) as cluster, \
            Client(cluster, set_as_default=set_as_default, timeout=timeout) as client:
        client.wait_for_workers(n_workers, timeout=timeout)
        yield client


@pytest.fixture(scope="session")
def llm_cluster(daskllm_cache):
    """Starts multi-process clusters: ``with llm_cluster(models=["tiny"], n_workers=2, ...) as
    client:`` (the other keywords go to LocalLLMCluster; ``client.cluster`` is the cluster).
    Tests using it are marked slow."""
    return _llm_cluster
