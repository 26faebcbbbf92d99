"""The remote engine: the Engine protocol over an OpenAI-compatible endpoint.

The request mapping, the finish reasons, the retry policy and the token bucket are pure and
tested alone. The engine itself is tested against a real ``daskllm serve`` subprocess on the
tiny model: it answers with the local torch engine's tokens, a cluster whose worker holds
the model remotely runs a reference pipeline to the same outputs (CSE and usage included),
a dead endpoint fails over to the fallback, and a refused request fails alone.
"""

from __future__ import annotations

import json
import pathlib
import queue
import shutil
import subprocess
import sys
import threading
import time

import click
import httpx
import openai
import pytest

import daskllm
from daskllm.engines import EngineSpec, RequestError, SamplingParams, StructuredOutput
from daskllm.engines.protocol import EngineClosed
from daskllm.engines.remote import (
    Endpoint,
    EndpointUnavailable,
    RemoteEngine,
    RetryPolicy,
    TokenBucket,
    endpoint,
    finish_reason,
    request_body,
    retry_after,
    retryable,
)
from helpers import free_port, scheduler_address

SERVE_DEADLINE = 180  # seconds for `daskllm serve` to start its cluster and answer
NOWHERE = "http://127.0.0.1:1/v1"  # port 1: connections are refused at once

# --- the request body ----------------------------------------------------------------------


def test_sampling_params_map_onto_openai_fields_and_vllm_extensions():
    body = request_body([1, 2, 3], SamplingParams(max_tokens=7), "m")
    assert body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.0, "top_p": 1.0,
                    "extra_body": {"return_token_ids": True}}
    params = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=5, stop=("\n", "END"), ignore_eos=True,
                            allowed_token_ids=(4, 9), logprobs=2)
    body = request_body("hi", params, "m", priority=-3)
    assert (body["seed"], body["stop"], body["logprobs"], body["temperature"], body["top_p"]) == \
        (5, ["\n", "END"], 2, 0.7, 0.9)
    assert body["extra_body"] == {"return_token_ids": True, "ignore_eos": True, "allowed_token_ids": [4, 9],
                                  "priority": -3}


@pytest.mark.parametrize("structured, field", [
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), "json"),
    (StructuredOutput.choice(["yes", "no"]), "choice"),
    (StructuredOutput.regex("[0-9]+"), "regex"),
])
def test_a_grammar_goes_as_structured_outputs(structured, field):
    body = request_body("q", SamplingParams(structured=structured), "m")
    assert body["extra_body"]["structured_outputs"] == {field: structured.value}
    json.dumps(body)  # plain JSON on the wire


def test_without_extensions_only_openai_fields_are_sent():
    body = request_body([1], SamplingParams(allowed_token_ids=(4, 9)), "m", priority=2, extensions=False)
    assert "extra_body" not in body
    assert body["logit_bias"] == {"4": 100, "9": 100}  # OpenAI's spelling of "only these"
    for params in (SamplingParams(ignore_eos=True), SamplingParams(structured=StructuredOutput.regex("a+"))):
        with pytest.raises(RequestError, match="extensions=False"):
            request_body([1], params, "m", extensions=False)


def test_finish_reasons():
    eos = frozenset({1})
    plain, stopping = SamplingParams(), SamplingParams(stop=("\n",))
    assert finish_reason("length", plain, [5], eos) == "length"
    assert finish_reason("stop", plain, [5], eos) == "eos"  # no stop strings: only the end of sequence
    assert finish_reason("stop", stopping, [5, 1], eos) == "eos"  # ended on an EOS token
    assert finish_reason("stop", stopping, [5, 6], eos) == "stop"
    assert finish_reason("stop", stopping, [5, 1], eos, stop_reason="\n") == "stop"  # vLLM says which
    assert finish_reason("stop", stopping, [5, 6], eos, stop_reason=None) == "eos"
    assert finish_reason("content_filter", plain, [5], eos) == "content_filter"


# --- retries and limits --------------------------------------------------------------------


def _status_error(status: int, headers: dict | None = None) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://x/v1/completions")
    response = httpx.Response(status, headers=headers or {}, request=request)
    return openai.APIStatusError(f"status {status}", response=response, body={"message": "why"})


def test_what_is_retried():
    request = httpx.Request("POST", "http://x/v1/completions")
    assert retryable(openai.APIConnectionError(request=request))
    assert retryable(openai.APITimeoutError(request=request))
    for status in (408, 429, 500, 502, 503):
        assert retryable(_status_error(status)), status
    for status in (400, 401, 404, 422):
        assert not retryable(_status_error(status)), status
    assert not retryable(ValueError("a bug, not the network"))


def test_backoff_doubles_up_to_its_cap_and_honours_retry_after():
    policy = RetryPolicy(max_retries=5, base_delay=0.5, max_delay=3.0)
    assert [policy.delay(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(0, retry_after=2.5) == 2.5
    assert policy.delay(0, retry_after=60) == 3.0
    assert retry_after(_status_error(429, {"retry-after": "2"})) == 2.0
    assert retry_after(_status_error(429, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    assert retry_after(_status_error(503)) is None
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def test_token_bucket_allows_a_burst_then_the_rate():
    now = [0.0]
    bucket = TokenBucket(rate=2, clock=lambda: now[0])  # burst: 2
    assert [bucket.reserve() for _ in range(2)] == [0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.5)  # in debt: each next one half a second later
    assert bucket.reserve() == pytest.approx(1.0)
    now[0] = 10.0  # refilled, never above the burst
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]
    assert TokenBucket(rate=0.5, clock=lambda: 0.0).burst == 1
    with pytest.raises(ValueError, match="rate_limit"):
        TokenBucket(rate=0)


def test_engines_of_one_endpoint_share_its_limits():
    a = endpoint("http://limits.example/v1", 3, 5.0)
    assert endpoint("http://limits.example/v1", 3, 5.0) is a
    assert endpoint("http://limits.example/v1", 8, None) is a  # the first engine's limits hold
    assert endpoint("http://other.example/v1", 3, 5.0) is not a
    with pytest.raises(ValueError, match="max_concurrency"):
        Endpoint("http://x", 0, None)


# --- the spec and loading ------------------------------------------------------------------


def test_openai_is_a_backend_for_llms_only():
    spec = EngineSpec(model="tiny", backend="openai", options={"base_url": NOWHERE})
    assert spec.resolved_backend() == "openai"
    specs = EngineSpec.expand(["tiny"], ["all-MiniLM-L6-v2"], backend="openai")
    assert [(s.kind, s.backend) for s in specs] == [("llm", "openai"), ("embed", None)]
    with pytest.raises(ValueError, match="LLMs"):
        EngineSpec(model="all-MiniLM-L6-v2", kind="embed", backend="openai").load()
    from daskllm.preload import dask_setup

    choice = next(p for p in dask_setup.params if p.name == "backend").type
    assert isinstance(choice, click.Choice) and "openai" in choice.choices


def test_loading_needs_the_tokenizer_not_the_weights(tiny_model_dir, tmp_path):
    """A directory without weights loads: only the tokenizer and config are read."""
    light = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, light, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with EngineSpec(model=str(light), name="tiny", backend="openai",
                    options={"base_url": NOWHERE}).load(num_threads=2, kv_cache_tokens=4096) as engine:
        assert isinstance(engine, RemoteEngine)
        assert engine.tokenize("def f(x):") == list(daskllm.prompts.tokenizer_for("tiny").encode("def f(x):", True))
        assert (engine.remote_model, engine.base_url) == ("tiny", NOWHERE)
        assert engine.cache_state().resident_hashes == frozenset()
    with pytest.raises(ValueError, match="base_url"):
        EngineSpec(model=str(light), backend="openai").load()
    with pytest.raises(TypeError):
        EngineSpec(model=str(light), backend="openai", options={"base_url": NOWHERE, "kv_cache_tokens": 1}).load()


def test_a_dead_endpoint_fails_after_its_retries(tiny_model_dir):
    with RemoteEngine("tiny", base_url=NOWHERE, max_retries=2, retry_delay=0.01) as engine:
        with pytest.raises(EndpointUnavailable, match=r"127\.0\.0\.1:1.*after 3 attempt"):
            engine.generate(["hello"])
        stats = engine.stats()
        assert (stats.requests_submitted, stats.requests_failed, stats.running) == (1, 1, 0)
        with pytest.raises(RequestError):
            engine.submit([10 ** 9])  # checked here, before anything is sent


def _wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_cancelling_or_closing_ends_requests_that_wait_for_a_retry(tiny_model_dir):
    engine = RemoteEngine("tiny", base_url=NOWHERE, max_retries=3, retry_delay=30)
    cancelled, pending = engine.submit("hello"), engine.submit("world")
    assert cancelled.cancel()
    _wait_for(lambda: engine.stats().requests_cancelled == 1)
    engine.close()
    with pytest.raises(EngineClosed):
        pending.result(timeout=5)
    with pytest.raises(EngineClosed):
        engine.submit("again")


# --- against a real `daskllm serve` ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(daskllm_cache, tiny_model_dir, tmp_path_factory):
    """``daskllm serve --model tiny`` in a subprocess; its base URL."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "daskllm.cli", "serve", "--model", "tiny", "--workers", "1",
                                 "--threads", "8", "--port", "0", "--dashboard-address", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + SERVE_DEADLINE
        url = None
        while url is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"daskllm serve did not announce itself in {SERVE_DEADLINE} s; "
                            f"stderr:\n{log.read_text()[-3000:]}")
            if line.startswith("daskllm serve: listening on "):
                url = line.split(" on ", 1)[1].strip()
            elif proc.poll() is not None:
                pytest.fail(f"daskllm serve exited with {proc.returncode}; stderr:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def local():
    from daskllm.engines.torch_engine import TorchEngine

    with TorchEngine("tiny") as engine:
        yield engine


PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "The capital of France is", "class Stack:\n    def"]


@pytest.mark.slow
@pytest.mark.timeout(SERVE_DEADLINE + 120)
def test_remote_generation_equals_the_local_engine(server, local):
    """Greedy: the same text, tokens and finish reasons, for text and token-id prompts, whole
    or streamed; stop strings and log-probabilities too."""
    with RemoteEngine("tiny", base_url=server) as remote:
        ids = [local.tokenize(p) for p in PROMPTS]  # what the planner sends: ids with BOS
        for params in (SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, stop=("\n",)),
                       SamplingParams(max_tokens=6, logprobs=2)):
            expected = local.generate(PROMPTS, params)
            for prompts in (PROMPTS, ids):
                got = remote.generate(prompts, params)
                assert [c.text for c in got] == [c.text for c in expected]
                assert [c.token_ids for c in got] == [c.token_ids for c in expected]
                assert [c.prompt_token_ids for c in got] == [c.prompt_token_ids for c in expected]
                assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
            if params.logprobs:
                assert [c.logprobs for c in got] == [pytest.approx(c.logprobs) for c in expected]
                assert [sorted(t) for c in got for t in c.top_logprobs] == \
                    [sorted(t) for c in expected for t in c.top_logprobs]
        params = SamplingParams(max_tokens=12)
        assert "".join(remote.stream(ids[0], params)) == local.generate([ids[0]], params)[0].text
        handle = remote.prefill(ids[1])
        assert (handle.num_tokens, handle.block_hashes) == (len(ids[1]), ())
        stats = remote.stats()
        assert stats.requests_finished == stats.requests_submitted >= 20
        assert stats.decode_tokens > 0 and stats.prefill_tokens_computed > 0 and stats.busy_seconds > 0


@pytest.mark.slow
@pytest.mark.timeout(SERVE_DEADLINE + 120)
def test_a_refused_request_fails_alone(server, local):
    too_long = [5] * 5000  # longer than the served model's context
    with RemoteEngine("tiny", base_url=server, max_retries=0) as remote:
        results = remote.generate([too_long, PROMPTS[0]], SamplingParams(max_tokens=5), return_exceptions=True)
        assert isinstance(results[0], RequestError) and "HTTP 400" in str(results[0])
        assert results[1].text == local.generate(PROMPTS[:1], SamplingParams(max_tokens=5))[0].text
        assert remote.stats().requests_failed == 1


@pytest.mark.slow
@pytest.mark.timeout(SERVE_DEADLINE + 120)
def test_an_endpoint_s_concurrency_and_rate_limits(server):
    # Another spelling of the server's address: limits of its own (the first engine of a URL sets them).
    url = server.replace("127.0.0.1", "localhost")
    params = SamplingParams(max_tokens=2)
    with RemoteEngine("tiny", base_url=url, max_concurrency=2, rate_limit=4) as a, \
            RemoteEngine("tiny", name="other", remote_model="tiny", base_url=url, max_concurrency=2,
                         rate_limit=4) as b:
        started = time.perf_counter()
        futures = a.submit_many(PROMPTS * 2, params) + b.submit_many(PROMPTS, params)
        assert all(f.result(timeout=120).token_ids for f in futures)
        # 12 requests at 4 a second after a burst of 4: two seconds at least, shared by both engines.
        assert time.perf_counter() - started >= 1.9
        assert a.stats().max_batch_size + b.stats().max_batch_size <= 4
        assert max(a.stats().max_batch_size, b.stats().max_batch_size) <= 2
        assert (a.stats().running, a.stats().waiting) == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(SERVE_DEADLINE + 120)
def test_a_dead_endpoint_fails_over_to_the_fallback(server, local):
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    params = SamplingParams(max_tokens=8)
    with RemoteEngine("tiny", base_url=dead, max_retries=1, retry_delay=0.01, fallback_base_url=server,
                      fallback_model="tiny") as remote:
        assert remote.path is None  # answers may come from the fallback: never stored
        assert [c.text for c in remote.generate(PROMPTS, params)] == [c.text for c in local.generate(PROMPTS, params)]
    with RemoteEngine("tiny", base_url=dead, max_retries=0, fallback_base_url=dead) as remote:
        with pytest.raises(EndpointUnavailable, match="and the fallback"):
            remote.generate(PROMPTS[:1], params)
    with RemoteEngine("tiny", base_url=server, max_retries=0, timeout=1e-4) as remote:
        with pytest.raises(EndpointUnavailable, match="Timeout"):  # the per-request timeout
            remote.generate(PROMPTS[:1], params)


@pytest.mark.slow
@pytest.mark.timeout(SERVE_DEADLINE + 240)
def test_a_cli_worker_holds_the_model_remotely(server, local, tmp_path):
    """`dask worker --preload daskllm.preload --daskllm-backend openai --daskllm-option base_url=...`."""
    from distributed import Client

    from daskllm.worker import engine_stats, generate, resident_models

    bin_dir = pathlib.Path(sys.executable).parent
    scheduler_file = tmp_path / "scheduler.json"
    params = SamplingParams(max_tokens=6)
    with open(tmp_path / "cluster.log", "w") as log:  # kept for a failure's reader
        processes = [subprocess.Popen([bin_dir / "dask", "scheduler", "--scheduler-file", scheduler_file, "--port",
                                       "0", "--no-dashboard", "--host", "127.0.0.1"], stdout=log, stderr=log)]
        try:
            address = scheduler_address(scheduler_file, processes[0])
            processes.append(subprocess.Popen(
                [bin_dir / "dask", "worker", address, "--nthreads", "4", "--no-dashboard", "--preload",
                 "daskllm.preload", "--daskllm-model", "tiny", "--daskllm-backend", "openai",
                 "--daskllm-option", f"base_url={server}", "--daskllm-option", "max_retries=1",
                 "--daskllm-threads", "2"], stdout=log, stderr=log))
            with Client(address, timeout=60) as client:
                client.wait_for_workers(1, timeout=120)
                assert list(resident_models(client).values()) == [["tiny"]]
                got = client.gather(client.map(generate, ["tiny"] * len(PROMPTS), PROMPTS, [params] * len(PROMPTS)))
                stats = list(client.run(engine_stats).values())[0]["tiny"]
        finally:
            for proc in reversed(processes):
                proc.terminate()
                proc.wait(60)
    assert [c.token_ids for c in got] == [c.token_ids for c in local.generate(PROMPTS, params)]
    assert stats["requests_finished"] == len(PROMPTS) and stats["cache_blocks_total"] == 0


@pytest.fixture(scope="module")
def remote_cluster(server, llm_cluster):
    """A cluster whose one worker holds tiny through the server."""
    spec = {"model": "tiny", "backend": "openai", "options": {"base_url": server, "max_concurrency": 16}}
    with llm_cluster(models=[spec], embedders=(), rerankers=(), n_workers=1) as client:
        yield client


def _remote_stats(client) -> dict:
    from daskllm.worker import PLUGIN_NAME

    async def stats(dask_worker):
        plugin = dask_worker.plugins[PLUGIN_NAME]
        await plugin.loaded()  # engines load in the background of a started worker
        engine = plugin.engines["llm"]["tiny"]
        return type(engine).__name__, engine.stats().requests_finished

    return next(iter(client.run(stats).values()))


@pytest.mark.timeout(SERVE_DEADLINE + 300)
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_reference_pipeline_on_a_remote_worker_equals_the_local_run(server, remote_cluster, chat):
    from pipelines import registry
    from pipelines.data import Inputs
    from pipelines.ops import Lazy, plain

    inputs = Inputs(["What does os.path.join do?", "How do I sort a dict by value?"])
    mapred = registry()["mapred"]

    def build():
        return mapred(inputs, Lazy("tiny", chat=chat), experts=3, max_tokens=5)

    with remote_cluster.as_current():
        kind, before = _remote_stats(remote_cluster)
        assert kind == "RemoteEngine"
        with daskllm.usage() as usage:
            got = plain(daskllm.compute(build(), result_cache=False)[0])
        kind, after = _remote_stats(remote_cluster)
    # The same pipeline on a torch engine in this process (Dask's threads, not the cluster).
    expected = plain(daskllm.compute(build(), result_cache=False, scheduler="threads")[0])
    assert got == expected
    assert usage.executed["generate"] == len(inputs) * 4
    assert after - before >= usage.executed["generate"]  # and prefills, if the plan warms shared prefixes


@pytest.mark.timeout(SERVE_DEADLINE + 300)
def test_remote_calls_take_part_in_cse_and_usage(server, remote_cluster):
    with remote_cluster.as_current():
        _, before = _remote_stats(remote_cluster)
        a = daskllm.generate("Name a prime number:", model="tiny", max_tokens=4)
        b = daskllm.generate("Name a prime number:", model="tiny", max_tokens=4)
        with daskllm.usage() as usage:
            first, second = daskllm.compute(a, b, result_cache=False)
        _, after = _remote_stats(remote_cluster)
    assert first == second
    assert (usage.requested["generate"], usage.executed["generate"], after - before) == (2, 1, 1)
    assert usage.decode_tokens > 0 and usage.prefill_tokens_computed > 0
