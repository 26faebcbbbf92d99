"""The papers' reference pipelines (pipelines/), each exact at small size.

Every pipeline runs four ways on one multi-process cluster with the tiny model (and the
small one for the two-model variants): optimized (everything on), naive (no rewrites, a
task per call), eagerly over the whole batch (operator at a time) and eagerly one query at
a time. Greedy decoding on a batch-invariant engine: all four must give the same tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import daskllm
from pipelines import TWO_MODELS, registry
from pipelines.data import Inputs, make_inputs
from pipelines.harmonia import CLASSIFY, GRADE, ROUTES
from pipelines.ops import NAIVE, Eager, Lazy, picked, plain

PIPELINES = registry()


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(models=["tiny", "small"], n_workers=2, threads_per_worker=4,
                     engine_options={"kv_cache_tokens": 8192}) as client:
        yield client


@pytest.fixture(scope="module")
def inputs(client) -> Inputs:
    return make_inputs(client, 3, per_query=3, index_docs=600)


def _config(name: str) -> dict:
    return {"model": "tiny", "max_tokens": 5, **({"model2": "small"} if name in TWO_MODELS else {})}


def test_every_paper_has_its_pipelines():
    assert {"naive_rag", "advanced_rag", "w1", "w2", "w3", "w4", "w5", "w6", "mapred", "debate", "reflect",
            "iterative", "parallel", "trading", "factool", "corrective_rag", "adaptive_rag"} <= set(PIPELINES)
    for fn in PIPELINES.values():
        assert fn.__module__ in {f"pipelines.{m}" for m in ("teola", "halo", "helium", "alto", "harmonia")}
        assert sys.modules[fn.__module__].__doc__.count(".txt")  # names its paper


@pytest.mark.bits
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_optimized_naive_opwise_and_sequential_runs_agree(client, inputs, name):
    fn, config = PIPELINES[name], _config(name)
    with daskllm.usage() as usage:
        optimized = plain(daskllm.compute(fn(inputs, **config))[0])
    naive = plain(daskllm.compute(fn(inputs, **config), **NAIVE)[0])
    opwise = plain(fn(inputs, Eager("tiny"), **config))
    one_by_one = Eager("tiny", parallel=False)
    sequential = [plain(fn(inputs.subset(i, i + 1), one_by_one, **config))[0] for i in range(len(inputs))]
    assert len(optimized) == len(inputs)
    assert optimized == naive == opwise == sequential
    assert usage.executed.get("generate", 0) >= len(inputs)
    assert any(str(a).strip() for a in optimized)


def test_lazy_build_is_a_graph_not_a_run(client, inputs):
    from daskllm.worker.results import RESULTS

    RESULTS.clear()  # earlier tests' results would turn the calls into cached values
    nodes = PIPELINES["trading"](inputs, **_config("trading"))
    report = daskllm.explain(nodes, file=None)
    assert report["tasks"]["decode"] >= 10  # analysts, debate, risk team, trader: all planned at once


def test_harmonia_branches_are_both_taken(client, tiny_model_dir):
    """With the tiny model the grader's and classifier's picks are arbitrary, but over a
    dozen questions each outcome occurs: both branches of the control flow run."""
    questions = [f"What does function number {i} in the library do?" for i in range(12)]
    ops = Lazy("tiny")
    grades = daskllm.compute(ops.choose(GRADE, ("yes", "no"), d="some passage", q=questions))[0]
    routes = daskllm.compute(ops.choose(CLASSIFY, ROUTES, q=questions))[0]
    assert {picked(g, ("yes", "no")) for g in grades} == {"yes", "no"}
    assert len({picked(r, ROUTES) for r in routes}) >= 2


def test_each_rejects_batches_of_different_sizes():
    with pytest.raises(ValueError, match="different sizes"):
        Lazy("tiny").each(print, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="different sizes"):
        Eager("tiny").each(print, ["a", "b"], ["c"])


def test_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="questions"):
        Inputs([])
    with pytest.raises(ValueError, match="question 1"):
        Inputs(["a", "b"], contexts=[["x"], []])


@pytest.mark.slow
def test_pipeline_module_runs_from_its_main(tiny_model_dir, daskllm_cache):
    done = subprocess.run([sys.executable, "-m", "pipelines.halo", "--pipeline", "w2", "--queries", "2",
                           "--max-tokens", "4", "--workers", "1", "--index-docs", "100"],
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "DASKLLM_CACHE_DIR": daskllm_cache})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("Q: ") == 2
    assert "w2: 2 queries" in done.stdout
