"""Everything above the engine, on workers with real vLLM engines (vLLM's CPU build here).

One cluster for the module, started as a user starts one: ``dask llm scheduler``, one worker
with ``dask llm worker --backend vllm`` and one with plain ``dask worker --preload
daskllm.preload --daskllm-backend vllm``, each holding a vLLM engine on ``tiny`` and the
MiniLM embedder (on torch). Every process runs in one process group that the fixture ends,
so an engine core cannot outlive the module. The last test SIGKILLs a worker mid-job.
Marker ``vllm``: ``make test-vllm`` runs these in .venv-vllm.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import cloudpickle
import dask
import pytest
from distributed import Client

import daskllm
from daskllm.worker import engine_stats, reset_prefix_caches, resident_models
from daskllm.worker.results import RESULTS
from helpers import VLLM_BLOCK, cold_start, free_port, set_policy, vllm_unavailable, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

BIN = pathlib.Path(sys.executable).parent
ROOT = pathlib.Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # client.run's functions, by value
NAIVE = {"passes": [], "granularity": "query", "result_cache": False}
QUESTIONS = [f"Question {i}: what does module number {i} of the standard library do?" for i in range(12)]
SYSTEMS = [f"System prompt {n}: you are assistant number {n}. Answer in one short sentence. " * 4 for n in range(3)]
ENGINE = ("--option", "kv_cache_tokens=4096")
START_DEADLINE = 300.0


def _die_with_this_process() -> None:
    """In a child, before exec: SIGKILL when the test process (its parent) dies, so a killed
    pytest leaves no scheduler, worker or server behind (workers' engine cores follow them)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _engine_cores(worker_pid: int) -> list[int]:
    """The pids of a worker's vLLM engine-core processes (its children named VLLM::EngineCore)."""
    import psutil

    found = []
    for child in psutil.Process(worker_pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Iterator[dict]:
    if reason := vllm_unavailable():
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("vllm-cluster")
    port, dashboard = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    # PYTHONPATH: the workers import the reference pipelines from this checkout, as the client does
    env = {**os.environ, "DASK_DASKLLM__ENGINE__BLOCK_SIZE": str(VLLM_BLOCK), "PYTHONPATH": str(ROOT),
           "DASK_DASKLLM__METERING__PROMPT_BLOCKS": "True"}  # usage's distinct-prefix bound
    commands = {
        "scheduler": [BIN / "dask", "llm", "scheduler", "--host", "127.0.0.1", "--port", port,
                      "--dashboard-address", f"127.0.0.1:{dashboard}"],
        # dask llm worker makes its workers non-daemonic for vLLM itself
        "llm-worker": [BIN / "dask", "llm", "worker", address, "--model", "tiny", "--backend", "vllm",
                       "--embedder", "all-MiniLM-L6-v2", "--reranker", "all-MiniLM-L6-v2", "--nthreads", "4", "--no-dashboard", "--name", "llm-worker",
                       "--engine-threads", "1", *ENGINE],
        # plain dask worker: the user sets what docs/vllm.md says
        "preload-worker": [BIN / "dask", "worker", address, "--nthreads", "4", "--no-dashboard", "--name",
                           "preload-worker", "--preload", "daskllm.preload", "--daskllm-model", "tiny",
                           "--daskllm-backend", "vllm", "--daskllm-embedder", "all-MiniLM-L6-v2",
                           "--daskllm-reranker", "all-MiniLM-L6-v2",
                           "--daskllm-threads", "1", "--daskllm-option", "kv_cache_tokens=4096"],
    }
    procs: dict[str, subprocess.Popen] = {}
    group = None
    try:
        for name, command in commands.items():
            # The preload worker's engine unbound; the CLI worker's bound to core 0 (its setting).
            extra = {"DASK_DISTRIBUTED__WORKER__DAEMON": "False"} if name == "preload-worker" else \
                {"DASK_DASKLLM__ENGINE__CPU_CORES": "0"} if name == "llm-worker" else {}
            log = (logs / f"{name}.log").open("w")
            procs[name] = subprocess.Popen([str(c) for c in command], stdout=log, stderr=subprocess.STDOUT,
                                           env={**env, **extra}, process_group=group or 0,
                                           preexec_fn=_die_with_this_process)
            group = group or procs[name].pid  # every process in the scheduler's group
        with dask.config.set({"daskllm.engine.block-size": VLLM_BLOCK}), \
                Client(address, timeout=60, set_as_default=True) as client:
            wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, START_DEADLINE, *procs.values(),
                     what="two workers")
            resident = wait_for(lambda: resident_models(client), START_DEADLINE, *procs.values(),
                                what="resident engines")
            assert list(resident.values()) == [["tiny"]] * 2
            assert list(resident_models(client, "embed").values()) == [["all-MiniLM-L6-v2"]] * 2
            yield {"client": client, "address": address, "dashboard": dashboard, "procs": procs, "logs": logs}
    finally:
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)  # engine cores included


@pytest.fixture
def client(cluster):
    client = cluster["client"]
    cold_start(client)
    set_policy(client, "cache_aware")
    return client


def _engines(dask_worker) -> dict:
    from daskllm.worker import PLUGIN_NAME

    host = dask_worker.plugins[PLUGIN_NAME]
    return {f"{kind}:{name}": type(engine).__name__ for kind, engines in host.engines.items()
            for name, engine in engines.items()}


def test_workers_hold_vllm_engines_that_share_the_cores(client):
    """Both ways of starting a worker give it a vLLM engine core (the embedder stays on torch);
    each engine core computes with the worker's engine threads (1 here: two engines, two
    cores). Unbound by default, so the two may use every core (vLLM's own binding would put
    both on core 0); bound where the worker's ``daskllm.engine.cpu-cores`` says (the CLI
    worker's: core 0)."""
    kinds = client.run(_engines)
    assert [k["llm:tiny"] for k in kinds.values()] == ["VLLMEngine"] * 2
    assert [k["embed:all-MiniLM-L6-v2"] for k in kinds.values()] == ["EmbedEngine"] * 2
    pids = client.run(os.getpid)
    names = {w: info["name"] for w, info in client.scheduler_info()["workers"].items()}
    for worker, pid in pids.items():
        (core,) = _engine_cores(pid)
        environ = dict(v.split("=", 1) for v in pathlib.Path(f"/proc/{core}/environ").read_text().split("\0") if "=" in v)
        assert environ["OMP_NUM_THREADS"] == "1", worker
        assert environ.get("VLLM_CPU_OMP_THREADS_BIND") == ("0" if names[worker] == "llm-worker" else None), worker
        allowed = pathlib.Path(f"/proc/{core}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
        assert names[worker] == "llm-worker" or allowed == pathlib.Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0], \
            (worker, allowed)


@pytest.mark.parametrize("name", ["naive_rag", "w2", "debate", "factool"])
def test_pipelines_on_vllm_equal_the_naive_plan(client, name):
    from pipelines import registry
    from pipelines.data import make_inputs
    from pipelines.ops import NAIVE as PIPELINE_NAIVE, plain

    inputs = make_inputs(client, 3, per_query=3, index_docs=300)
    fn = registry()[name]
    optimized = plain(daskllm.compute(fn(inputs, model="tiny", max_tokens=6))[0])
    naive = plain(daskllm.compute(fn(inputs, model="tiny", max_tokens=6), **PIPELINE_NAIVE)[0])
    assert optimized == naive and len(optimized) == 3


def test_dataframe_map_filter_extract_and_embed(client):
    """The accessor's operators on vLLM engines; the answers do not depend on how the rows are
    partitioned (batched and placed differently)."""
    import dask.dataframe as dd
    import pandas as pd

    def job(partitions: int):
        rows = dd.from_pandas(pd.DataFrame({"q": QUESTIONS[:8]}), npartitions=partitions)
        return (rows.llm.map("Q: {q}\nA:", model="tiny", max_tokens=6, out="answer")
                    .llm.filter("Is this a number? {answer}", model="tiny")
                    .llm.extract("Facts about {q}", {"alive": bool}, model="tiny", max_tokens=16)
                    .llm.embed("q", out="vec")).compute()

    got = job(2)
    cold_start(client)  # no cached results: computed again
    alone = job(3)
    assert got[["q", "answer", "alive"]].reset_index(drop=True).equals(alone[["q", "answer", "alive"]]
                                                                         .reset_index(drop=True))
    assert str(got["alive"].dtype).lower().startswith("bool") and all(len(v) == 384 for v in got["vec"])


def test_a_table_job_computes_each_prefix_once_on_vllm(client):
    """The four question columns of tests/test_table_jobs.py on the two vLLM workers (4,096
    KV cache tokens each): prefill computed within 1.1x the distinct-prefix bound, and each
    column's answers those of the column computed alone."""
    from test_table_jobs import QUESTIONS as ASKED, TEMPLATE, columns, shuffled_docs

    ddf = shuffled_docs()
    with daskllm.usage() as u:
        joint = columns(ddf).compute()
    print(f"prefill computed {u.prefill_tokens_computed} / bound {u.distinct_prompt_tokens}")
    assert u.distinct_prompt_tokens > 8 * 4096
    assert u.distinct_prompt_tokens <= u.prefill_tokens_computed <= 1.1 * u.distinct_prompt_tokens
    cold_start(client)
    for i, question in enumerate(ASKED):
        alone = ddf.llm.map(TEMPLATE + question, model="tiny", max_tokens=4, out=f"a{i}").compute()
        assert alone[f"a{i}"].tolist() == joint[f"a{i}"].tolist(), question


def test_streamed_pmap_equals_the_whole_list(client):
    lines = daskllm.generate(daskllm.prompt("List three modules:\n{x}", x="1."), model="tiny", max_tokens=24,
                             split="lines")
    upper = daskllm.pmap(lines, lambda line: daskllm.generate(daskllm.prompt("Say {l}:", l=line), model="tiny",
                                                                max_tokens=3))
    items, mapped = daskllm.compute(lines, daskllm.collect(upper))
    alone = [daskllm.compute(daskllm.generate(daskllm.prompt("Say {l}:", l=line), model="tiny", max_tokens=3),
                             **NAIVE)[0] for line in items]
    assert items and list(mapped) == alone


def test_cache_aware_placement_reads_vllm_s_kv_events(client):
    """The placement plugin mirrors each worker's resident blocks from vLLM's own KV events:
    cache-aware placement gets more prefix hits than round-robin, with the same outputs."""
    results = {}
    for policy in ("round_robin", "cache_aware"):
        cold_start(client)
        set_policy(client, policy)
        nodes = [daskllm.generate(daskllm.prompt(s + "{q}\nAnswer:", q=QUESTIONS), model="tiny", max_tokens=3)
                 for s in SYSTEMS]
        with daskllm.usage() as usage:
            values = daskllm.compute(*nodes, passes=["cse"], granularity="query")
        results[policy] = (usage.prefill_tokens_cached / usage.prefill_tokens, values)
    assert results["cache_aware"][1] == results["round_robin"][1]
    assert results["cache_aware"][0] > results["round_robin"][0], {p: r[0] for p, r in results.items()}


def test_dashboard_llm_page_shows_the_vllm_engines(cluster, client):
    daskllm.compute(daskllm.generate(daskllm.prompt("Hello {x}", x=["a", "b"]), model="tiny", max_tokens=3))
    base = f"http://127.0.0.1:{cluster['dashboard']}/llm"
    with urllib.request.urlopen(f"{base}/metrics.json", timeout=30) as page:
        metrics = json.load(page)
    assert "tiny" in json.dumps(metrics)
    with urllib.request.urlopen(base, timeout=30) as page:
        assert page.status == 200
    stats = client.run(engine_stats)
    assert sum(s["tiny"]["decode_tokens"] for s in stats.values()) > 0


def test_serve_on_vllm_workers_chat_tools_and_responses(cluster):
    import openai

    log = cluster["logs"] / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([str(BIN / "dask"), "llm", "serve", "--scheduler", cluster["address"], "--port", "0"],
                                  stdout=out, stderr=subprocess.STDOUT, process_group=cluster["procs"]["scheduler"].pid,
                                  preexec_fn=_die_with_this_process,
                                  env={**os.environ, "DASK_DASKLLM__ENGINE__BLOCK_SIZE": str(VLLM_BLOCK)})
    try:
        wait_for(lambda: "daskllm serve: listening on " in log.read_text(), 120, server, what="the server listening")
        url = log.read_text().split("daskllm serve: listening on ")[1].split()[0]
        api = openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        again = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == again.choices[0].message.content
        tool = {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "required": ["a", "b"]}}}  # booleans: random weights close them
        called = api.chat.completions.create(model="tiny", messages=messages, tools=[tool], tool_choice="required",
                                             max_tokens=32)
        (call,) = called.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
        response = api.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=8, temperature=0)
        assert response.output_text == chat.choices[0].message.content
        # n seeded draws are reproducible; logprobs and stop strings come through
        sampled = [api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0, seed=11,
                                               n=3) for _ in range(2)]
        assert [c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices]
        assert len(sampled[0].choices) == 3
        scored = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2)
        assert len(scored.choices[0].logprobs.content) == scored.usage.completion_tokens
        assert all(len(t.top_logprobs) >= 1 and t.logprob <= 0 for t in scored.choices[0].logprobs.content)
        text = chat.choices[0].message.content
        if len(text) > 2:  # stop at a piece of the greedy answer: the answer ends before it
            stopped = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                  stop=[text[2:4]])
            assert stopped.choices[0].finish_reason == "stop" and text.startswith(stopped.choices[0].message.content)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)


def test_a_worker_killed_mid_job_loses_nothing_and_leaves_no_engine_core(client):
    """SIGKILL a worker while it computes: its tasks run again elsewhere (or on its restarted
    self), the results are exact, and its engine core is gone within 10 s."""
    questions = [f"{q} (variant {v})" for v in range(4) for q in QUESTIONS]
    params = {"model": "tiny", "max_tokens": 64, "ignore_eos": True}  # a job of fixed length

    def job():
        return [daskllm.generate(daskllm.prompt(s + "{q}\nAnswer:", q=questions), **params) for s in SYSTEMS]

    expected = daskllm.compute(*job(), **NAIVE)
    RESULTS.clear()
    client.run(reset_prefix_caches)
    futures = client.compute(job())

    def busy_worker():
        """A worker with tasks of the job in hand; fails the test if the job ends first."""
        assert not all(f.done() for f in futures), "the job finished before a worker could be killed"
        return next((w for w, keys in client.processing().items() if keys), None)

    victim = wait_for(busy_worker, 60, what="a worker computing the job", interval=0.05)
    pid = client.run(os.getpid, workers=[victim])[victim]
    cores = _engine_cores(pid)
    assert cores
    os.kill(pid, signal.SIGKILL)
    assert client.gather(futures, errors="raise") == list(expected)
    import psutil

    wait_for(lambda: not any(psutil.pid_exists(c) and psutil.Process(c).status() != psutil.STATUS_ZOMBIE
                             for c in cores), 10, what="end of the killed worker's engine core")
