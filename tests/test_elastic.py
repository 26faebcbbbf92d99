"""Elastic clusters: workers added (``cluster.scale``, ``cluster.adapt``) load their engines and
take the calls placed after they join; a worker drained while a job runs (``client.retire_workers``,
or adapt scaling down) hands its calls back, and the job's outputs do not change.

Every wait is on a condition with a deadline; the cluster starts with one worker.
"""

from __future__ import annotations

import os

import dask
import pytest
from distributed.utils_test import poll_for

import daskllm
from daskllm.runtime.view import take_view
from daskllm.worker import engine_stats, resident_models


def questions(tag: str, n: int, max_tokens: int = 8):
    return daskllm.generate(daskllm.prompt("Question {q}:", q=[f"{tag}{i} " * 12 for i in range(n)]),
                            max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    # No remembered results: every computation runs on the engines. A lost worker's slot is
    # checked 2 s after it leaves (Dask's default: 15 s).
    with dask.config.set({"daskllm.rewrite.result-cache": False, "distributed.deploy.lost-worker-timeout": "2s"}), \
            llm_cluster(n_workers=1, threads_per_worker=4) as client:
        yield client


def workers(client) -> set[str]:
    return set(client.scheduler_info()["workers"])


def scale(client, n: int) -> None:
    """Scale to ``n`` workers, each with its engines loaded, and plan for them: a computation
    reuses the planner's cluster view for up to 2 s (VIEW_TTL), so ask for a fresh one, as a
    computation 2 s later would."""
    client.cluster.scale(n)
    poll_for(lambda: len(workers(client)) == n and len(client.cluster.workers) == n, timeout=120)
    resident_models(client)
    poll_for(lambda: take_view(client, fresh=True).holding("tiny") == n, timeout=30)


def finished(client, worker: str) -> int:
    return client.run(engine_stats, workers=[worker])[worker]["tiny"]["requests_finished"]


def test_a_worker_added_by_scale_loads_its_engines_and_takes_new_calls(client):
    scale(client, 1)
    node = questions("scale", 24)
    expected = daskllm.compute(node)[0]  # on the one worker
    first = workers(client)
    scale(client, 2)
    (new,) = workers(client) - first
    assert resident_models(client) == {w: ["tiny"] for w in first | {new}}
    # Started like the first workers: without Dask's MALLOC_TRIM_THRESHOLD_ (slow torch).
    assert client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"), workers=[new]) == {new: None}
    assert daskllm.compute(node)[0] == expected  # the same outputs, wherever its calls ran
    # Calls whose prompts no engine holds yet: placement balances them over both workers (the
    # calls above may all follow the first worker's prefix cache, once its heartbeat reports it).
    before = finished(client, new)
    daskllm.compute(questions("fresh", 24))
    assert finished(client, new) > before  # placement used the new worker


def test_retiring_a_worker_mid_job_hands_its_calls_back(client):
    scale(client, 2)
    node = questions("retire", 40, max_tokens=96)
    expected = daskllm.compute(node)[0]
    job = client.compute(node)
    poll_for(lambda: all(client.processing().values()), timeout=60)  # both workers run its calls
    victim = sorted(workers(client))[0]
    assert victim in client.retire_workers([victim])
    assert job.result(timeout=180) == expected
    assert any(e.get("action") == "re-placed" and e.get("worker") == victim
               for _, e in client.get_events("daskllm-placement"))
    stranded = client.run_on_scheduler(lambda dask_scheduler, w: [
        str(k) for k, ts in dask_scheduler.tasks.items() if ts.worker_restrictions and w in ts.worker_restrictions],
        w=victim)
    assert stranded == []
    # Retired on purpose: its slot goes (as with cluster.scale), no fresh worker replaces it.
    poll_for(lambda: len(client.cluster.workers) == 1 and len(client.cluster.worker_spec) == 1, timeout=60)
    assert len(workers(client)) == 1


def test_adapt_scales_up_for_engine_work_and_down_when_idle(client):
    scale(client, 1)
    first = workers(client)
    small = questions("adapt", 16)
    expected = daskllm.compute(small)[0]
    # One worker per 16 requests in the engines (default: daskllm.engine.max-num-seqs, 64).
    client.run_on_scheduler(lambda dask_scheduler: setattr(dask_scheduler.plugins["daskllm-adaptive"],
                                                           "requests_per_worker", 16))
    adaptive = client.cluster.adapt(minimum=1, maximum=2, interval="200ms", wait_count=3)
    try:
        # Dask alone sees no work here: LLM tasks give their threads back while engines work.
        job = client.compute(questions("load", 64, max_tokens=64))
        poll_for(lambda: any(r["status"] == "up" for _, r in adaptive.log), timeout=60)
        # Hold the new worker while the job ends, to see where the next calls go.
        adaptive = client.cluster.adapt(minimum=2, maximum=2)
        poll_for(lambda: len(workers(client)) == 2, timeout=120)
        assert list(resident_models(client).values()) == [["tiny"], ["tiny"]]
        (new,) = workers(client) - first
        assert len(job.result(timeout=180)) == 64
        before = finished(client, new)
        daskllm.compute(questions("adapt-fresh", 16))  # prompts no engine holds: balanced
        assert finished(client, new) > before
        # Idle: adapt retires a worker, and the calls still run, with the same outputs.
        adaptive = client.cluster.adapt(minimum=1, maximum=2)
        poll_for(lambda: len(workers(client)) == 1 and len(client.cluster.workers) == 1, timeout=60)
        assert daskllm.compute(small)[0] == expected
    finally:
        adaptive.stop()
