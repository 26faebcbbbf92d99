"""`daskllm serve`: the OpenAI API over a real cluster, answered with the batch run's tokens.

Every test talks HTTP to a real uvicorn server on 127.0.0.1 (in a thread of this process, or
the `daskllm serve` command in a subprocess) with the official `openai` client, `litellm` or
httpx; none waits without a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pathlib
import signal
import subprocess
import sys

import httpx
import openai
import pytest

import daskllm
from daskllm.engines import SamplingParams
from helpers import vllm_unavailable, wait_for
from daskllm.serve import Service, serving
from daskllm.serve.openai_api import Call
from daskllm.serve.relay import StreamRelay

pytestmark = pytest.mark.slow

DEADLINE = 120  # seconds any one request may take here
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as"]
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is Dask?"}]


@pytest.fixture(scope="module")
def cluster(llm_cluster):
    with llm_cluster(models=["tiny"], embedders=["all-MiniLM-L6-v2"], n_workers=2, threads_per_worker=8) as client:
        daskllm.worker.resident_models(client)
        yield client


@pytest.fixture(scope="module")
def url(cluster):
    with serving(cluster, timeout=DEADLINE) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", timeout=DEADLINE, max_retries=0)


def batch(prompts, **options):
    """The same calls as one batch run (no server)."""
    return daskllm.generate(list(prompts), model="tiny", **options).compute()


def test_completions_return_the_batch_run_s_tokens(client, cluster):
    expected = batch(PROMPTS, max_tokens=12)
    records = batch(PROMPTS, max_tokens=12, logprobs=0)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent clients
        answers = list(pool.map(lambda p: client.completions.create(
            model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}), PROMPTS))
    for answer, text, record in zip(answers, expected, records):
        choice = answer.choices[0]
        assert choice.text == text
        assert choice.model_extra["token_ids"] == record["token_ids"]
        assert answer.usage.completion_tokens == len(record["token_ids"])
        assert choice.finish_reason == ("length" if len(record["token_ids"]) == 12 else "stop")
    # Several prompts in one request: one choice each, in order.
    many = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == expected


def test_token_id_prompts_and_stop_strings(client, cluster):
    ids = daskllm.prompts.tokenizer_for("tiny").encode(PROMPTS[0], True)
    by_ids = client.completions.create(model="tiny", prompt=list(ids), max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == batch(PROMPTS[:1], max_tokens=8)[0]
    # Token ids are the prompt exactly as sent: no special token is added in front.
    bare = client.completions.create(model="tiny", prompt=list(ids[1:]), max_tokens=2, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert bare.choices[0].model_extra["prompt_token_ids"] == list(ids[1:])
    text = by_ids.choices[0].text
    stop = text[len(text) // 2:][:3] if len(text) > 4 else None
    if stop and stop.strip():
        stopped = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop])
        assert stopped.choices[0].text == batch(PROMPTS[:1], max_tokens=8, stop=[stop])[0]
        assert stop not in stopped.choices[0].text


def test_chat_streamed_and_whole_equal_the_batch_run(client, cluster):
    expected = daskllm.generate(daskllm.chat(MESSAGES), model="tiny", max_tokens=16).compute()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it really streamed
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.bits
def test_streamed_completion_matches_transformers_generate(client, tiny_model_dir):
    """The whole prompt string through transformers' own generate gives the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    prompt = PROMPTS[2]
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_litellm_talks_to_it(url, cluster):
    litellm = pytest.importorskip("litellm")
    expected = daskllm.generate(daskllm.chat(MESSAGES), model="tiny", max_tokens=10).compute()
    common = dict(model="openai/tiny", api_base=url, api_key="unused", messages=MESSAGES, max_tokens=10,
                  temperature=0, timeout=DEADLINE)
    assert litellm.completion(**common).choices[0].message.content == expected
    streamed = litellm.completion(**common, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_embeddings_equal_daskllm_embed(client, cluster):
    texts = ["How do I read a CSV file?", "Parse JSON in Python"]
    expected = daskllm.embed(texts, model="all-MiniLM-L6-v2").compute()
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    assert [len(d.embedding) for d in got.data] == [384, 384]
    for d, e in zip(got.data, expected):
        assert d.embedding == pytest.approx(list(map(float, e)), abs=1e-6)


def test_embeddings_of_token_ids_dimensions_and_usage(client, url):
    """Token ids (the embedding model's own, as vLLM takes them) embed as their text does; the
    usage counts the tokens embedded; MiniLM is not trained for shortened vectors: `dimensions`
    other than its 384 is a 400 naming the field."""
    import numpy as np

    from transformers import AutoTokenizer

    texts = ["How do I read a CSV file?", "Parse JSON in Python"]
    ids = AutoTokenizer.from_pretrained(daskllm.models.resolve("all-MiniLM-L6-v2"))(texts)["input_ids"]
    assert [len(i) for i in ids] == [11, 8]  # [CLS] ... [SEP]: what the engine embeds, no padding
    by_text = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[0], dimensions=384)
    for got in (by_ids.data, one.data):
        for d, e in zip(got, by_text.data):
            assert np.asarray(d.embedding) == pytest.approx(np.asarray(e.embedding), abs=1e-6)
    assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == sum(map(len, ids))
    assert by_ids.usage.prompt_tokens == sum(map(len, ids)) and one.usage.prompt_tokens == len(ids[0])
    for body, param in (({"dimensions": 128}, "dimensions"), ({"input": [3.5]}, "input"),
                        ({"input": [[101, 10 ** 7]]}, "input")):
        reply = httpx.post(f"{url}/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", **body},
                           timeout=DEADLINE)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        assert param in reply.json()["error"]["message"]


def test_models_lists_what_the_workers_hold(client):
    assert {m.id for m in client.models.list()} == {"tiny", "all-MiniLM-L6-v2"}


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
          "additionalProperties": False}


def test_responses_equal_the_chat_route(client):
    """/v1/responses (instructions, input, max_output_tokens, a JSON schema), whole and streamed:
    the chat route's greedy tokens for the chat they make."""
    import json

    instructions, question = MESSAGES[0]["content"], MESSAGES[1]["content"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    whole = client.responses.create(model="tiny", instructions=instructions, input=question, max_output_tokens=16,
                                    temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.object == "response"
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    events = list(client.responses.create(model="tiny", instructions=instructions, input=[
        {"role": "user", "content": [{"type": "input_text", "text": question}]}], max_output_tokens=16,
        temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{whole.status}" and kinds.count("response.output_text.delta") > 1
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    structured = client.responses.create(model="tiny", input="Paris?", max_output_tokens=60, temperature=0,
                                         text={"format": fmt})
    as_chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris?"}],
                                             max_tokens=60, temperature=0, response_format={
                                                 "type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}})
    assert structured.output_text == as_chat.choices[0].message.content
    assert set(json.loads(structured.output_text)) == {"city"}


def test_n_choices_greedy_sampled_and_streamed(client):
    """n greedy choices are the one answer n times; n sampled ones with a seed are draws with seeds
    seed, seed + 1, ... (the same again for the same request; the first is the n=1 draw); streamed,
    each chunk names its choice."""
    common = dict(model="tiny", messages=MESSAGES, max_tokens=8)
    one = client.chat.completions.create(**common, temperature=0).choices[0].message.content
    greedy = client.chat.completions.create(**common, temperature=0, n=3, extra_body={"return_token_ids": True})
    assert [(c.index, c.message.content) for c in greedy.choices] == [(0, one), (1, one), (2, one)]
    assert greedy.usage.completion_tokens == 3 * len(greedy.choices[0].model_extra["token_ids"])
    sampled = [client.chat.completions.create(**common, temperature=1.0, seed=11, n=3) for _ in range(2)]
    texts = [[c.message.content for c in s.choices] for s in sampled]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1
    assert client.chat.completions.create(**common, temperature=1.0, seed=11).choices[0].message.content == texts[0][0]
    chunks = list(client.chat.completions.create(**common, temperature=1.0, seed=11, n=3, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts[0]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    completions = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    assert [c.text for c in sorted(completions.choices, key=lambda c: c.index)] == [
        t for t in batch(PROMPTS[:2], max_tokens=6) for _ in range(2)]


def test_finished_answers_come_from_the_result_store_unless_it_is_off(cluster, tmp_path):
    """serving.md: a finished greedy request's repeat is answered from the result store (on by
    default; the session's workers have it off until this test turns it on), and with
    daskllm.rewrite.result-cache off the server's requests run again (what a benchmark wants)."""
    import dask.config

    def store(on: bool) -> None:
        settings = {"daskllm.result-store.enabled": on, "daskllm.result-store.path": str(tmp_path)}
        cluster.run(lambda: dask.config.set(settings) and None)

    service = Service(cluster)
    call = Call("completion", "tiny", daskllm.prompts.as_prompt("A repeated benchmark prompt"),
                {"max_tokens": 4, "temperature": 0})

    def executed() -> int:
        async def run():
            service.start(asyncio.get_running_loop())
            return await asyncio.wait_for(service.complete([call]), DEADLINE)

        with daskllm.usage() as usage:
            asyncio.run(run())
        return usage.executed.get("generate", 0)

    store(True)
    try:
        assert executed() == 1
        assert executed() == 0
        with dask.config.set({"daskllm.rewrite.result-cache": False}):
            assert executed() == 1
    finally:
        store(False)
        service.close()


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": -3}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x " * 5000, "max_tokens": 4}, 400, None),  # longer than tiny holds
])
def test_bad_requests_get_openai_error_bodies(url, body, status, param):
    reply = httpx.post(f"{url}/{'chat/completions' if 'messages' in body else 'completions'}", json=body,
                       timeout=DEADLINE)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param and param in error["message"]


def test_a_bad_request_in_a_batch_fails_alone(url, client):
    """A prompt too long for the model, among good ones arriving together: only it fails."""
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0} for p in PROMPTS]
    bodies.insert(1, {"model": "tiny", "prompt": "x " * 5000, "max_tokens": 6})

    async def send():
        async with httpx.AsyncClient(timeout=DEADLINE) as http:
            return await asyncio.gather(*(http.post(f"{url}/completions", json=b) for b in bodies))

    replies = asyncio.run(send())
    assert [r.status_code for r in replies] == [200, 400, 200, 200, 200]
    assert "tokens" in replies[1].json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in replies if r.status_code == 200] == batch(PROMPTS, max_tokens=6)


def test_requests_arriving_together_are_planned_together(cluster):
    """Eight requests (four distinct prompts) at once: the first goes alone (the cluster is idle),
    the others that arrive while it is planned go together, and a request equal to one pending
    or running shares its value: four plans' worth of calls, each run once."""
    service = Service(cluster, window=0.5)

    async def run():
        service.start(asyncio.get_running_loop())
        calls = [Call("completion", "tiny", daskllm.prompts.as_prompt(p), {"max_tokens": 6}) for p in PROMPTS * 2]
        with daskllm.usage() as usage:
            results = await asyncio.wait_for(service.complete(calls), DEADLINE)
        return results, usage

    try:
        results, usage = asyncio.run(run())
    finally:
        service.close()
    assert [r.text for r in results] == batch(PROMPTS, max_tokens=6) * 2
    assert service.consolidator.stats.as_dict()["batches"] == 2
    assert service.consolidator.stats.requests == 4  # the four repeats shared the first four's values
    assert service.consolidator.stats.largest_batch == 3
    assert usage.executed["generate"] == 4, usage


def _die_with_this_process() -> None:
    """In the child, before exec: SIGKILL when the test process dies, so a killed pytest leaves no server."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(tmp_path, *args: str, model: str = "tiny") -> tuple[subprocess.Popen, pathlib.Path]:
    """`daskllm serve --model MODEL --workers 1 --port 0 ARGS` in a process group of its own; its
    stderr goes to the file returned."""
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "daskllm.cli", "serve", "--model", model, "--workers", "1",
                                 "--port", "0", "--dashboard-address", "127.0.0.1:0", *args],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path, process_group=0,
                                preexec_fn=_die_with_this_process)
    return proc, log


def _ends_cleanly(proc, log, signalled: float) -> None:
    """The server exited 0 (a minute's deadline: a hang fails), printed no traceback, and its
    whole process group is gone soon after. The times are printed, never asserted: a loaded
    machine closes a cluster slower."""
    import time

    assert proc.wait(timeout=60) == 0, log.read_text()
    exited = time.monotonic() - signalled
    wait_for(lambda: not _group(proc.pid), 60, what=f"the end of process group {proc.pid}", interval=0.05)
    text = log.read_text()
    assert "Traceback" not in text and "Aborted" not in text and "Restarting worker" not in text, text
    print(f"exited {exited:.2f} s after the signal, its process group {time.monotonic() - signalled:.2f} s after")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["two SIGINTs", "SIGTERM"])
def test_the_command_needs_its_key_embeds_by_default_and_stops_cleanly(daskllm_cache, tmp_path, stop):
    """`daskllm serve` in a subprocess of its own process group: needs its key, serves the default
    embedder with no --embedder, logs each request on stderr (a refused one as one line, no
    traceback), and a SIGTERM to the whole group (a supervisor's stop) ends every process of
    it, exit status 0, with no traceback; two Ctrl-Cs (SIGINT to the group) 0.2 s apart end it
    too (the times are printed: under 1 s for the server on an idle machine; the group follows
    as its workers see their parent gone)."""
    import time

    proc, log = _serve(tmp_path, "--api-key", "s3cret")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            line = pool.submit(_listening_line, proc).result(timeout=240)
        base = line.rsplit(" ", 1)[-1]
        assert base.startswith("http://127.0.0.1:")
        denied = httpx.get(f"{base}/models", timeout=DEADLINE)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        allowed = openai.OpenAI(base_url=base, api_key="s3cret", timeout=DEADLINE, max_retries=0)
        assert {m.id for m in allowed.models.list()} == {"tiny", "all-MiniLM-L6-v2"}
        vectors = allowed.embeddings.create(model="all-MiniLM-L6-v2", input=["read a CSV file"])
        assert len(vectors.data[0].embedding) == 384
        refused = _refusals(base, "s3cret")
        lines = wait_for(lambda: [x for x in log.read_text().splitlines() if "daskllm.serve.access" in x]
                         if log.read_text().count("daskllm.serve.access") >= 3 + len(refused) else None,
                         DEADLINE, proc, what="an access-log line per request")
        assert len(lines) == 3 + len(refused), lines  # one each: the models (twice), the vectors, the refusals
        for (path, status), logged in zip(refused, lines[3:]):
            assert f'"POST /v1/{path} HTTP/1.1" {status}' in logged, (path, logged)
        assert "Compute Failed" not in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
        members = _group(proc.pid)
        assert len(members) >= 3, members  # the server, its workers' forkserver, its worker
        os.killpg(proc.pid, stop)
        if stop == signal.SIGINT:
            time.sleep(0.2)  # the second Ctrl-C, while the server closes
            os.killpg(proc.pid, signal.SIGINT)
        _ends_cleanly(proc, log, time.monotonic())
        lines = log.read_text().splitlines()
        assert any('"GET /v1/models HTTP/1.1" 401' in line for line in lines), lines
        assert any('"GET /v1/models HTTP/1.1" 200' in line and "latency=" in line for line in lines), lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _refusals(base: str, key: str) -> list[tuple[str, int]]:
    """Every kind of refusal, each asserted to be OpenAI's error: a prompt longer than the
    model's context on each route, whole and streamed (context_length_exceeded, naming the
    prompt's field), a bad field, an unknown model. Returns (route, status) in order."""
    long = "x " * 5000  # tiny holds 2048 tokens
    overflows = [("chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
                 ("completions", {"prompt": long}, "prompt"), ("responses", {"input": long}, "input"),
                 ("completions", {"prompt": "x", "max_tokens": 4000}, "prompt")]
    sent = []
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=DEADLINE) as http:
        for path, body, param in overflows:
            for stream in (False, True):
                reply = http.post(f"/{path}", json={"model": "tiny", **body, "stream": stream})
                error = reply.json()["error"]
                assert reply.status_code == 400 and error["code"] == "context_length_exceeded", reply.text
                assert error["param"] == param and "maximum context length is 2048 tokens" in error["message"]
                sent.append((path, 400))
        bad = http.post("/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                   "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
        unknown = http.post("/responses", json={"model": "nope", "input": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    return sent + [("chat/completions", 400), ("responses", 404)]


@pytest.mark.parametrize("delay", [0.5, 2.0, 5.0])
def test_ctrl_c_at_any_moment_of_the_start_ends_it_quietly(daskllm_cache, tmp_path, delay):
    """A Ctrl-C (SIGINT to the process group) this long after the launch, wherever the start is
    (importing, starting the cluster, loading the model): exit 0, no traceback, and nothing of
    the group left."""
    import time

    proc, log = _serve(tmp_path)
    try:
        time.sleep(delay)  # the moment of the signal is what is tested, not a wait for a condition
        os.killpg(proc.pid, signal.SIGINT)
        _ends_cleanly(proc, log, time.monotonic())
        assert "listening" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_model_no_worker_can_load_is_a_clear_exit(daskllm_cache, tmp_path):
    """A model directory the workers cannot load (an architecture the torch engine does not run):
    the command exits non-zero naming the model and the worker's error, and never says it listens."""
    import json

    model = tmp_path / "gpt2-like"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc, log = _serve(tmp_path, model=str(model))
    try:
        out, _ = proc.communicate(timeout=240)
        text = log.read_text()
        assert proc.returncode != 0 and "listening" not in out, (out, text)
        assert f"cannot serve {model}" in text and "GPT2LMHeadModel" in text and "not supported" in text, text
        wait_for(lambda: not _group(proc.pid), 60, what=f"the end of process group {proc.pid}", interval=0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    members = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.vllm
def test_serve_with_backend_vllm_answers_from_vllm_engines(daskllm_cache, tmp_path):
    """`daskllm serve --backend vllm` starts its local workers on vLLM engines: a vLLM engine
    core runs in its process group and answers; it stops cleanly."""
    import time

    if reason := vllm_unavailable():
        pytest.skip(reason)
    proc, log = _serve(tmp_path, "--backend", "vllm", "--embedder", "all-MiniLM-L6-v2")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            base = pool.submit(_listening_line, proc).result(timeout=300).rsplit(" ", 1)[-1]
        client = openai.OpenAI(base_url=base, api_key="none", timeout=DEADLINE, max_retries=0)
        done = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"
        titles = []
        for pid in _group(proc.pid):
            with contextlib.suppress(OSError):  # gone meanwhile
                titles.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes())
        assert any(b"EngineCore" in t for t in titles), titles  # vLLM's engine core, not the torch engine
        os.killpg(proc.pid, signal.SIGTERM)
        _ends_cleanly(proc, log, time.monotonic())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_request_with_no_limit_generates_what_the_context_leaves(cluster, client, url):
    """No hidden cap (vLLM's and OpenAI's behaviour): a chat or a response that sets no output
    limit may generate to the end of the model's context; /v1/responses echoes the limit applied."""
    from daskllm.runtime.view import take_view

    # The workers report their models' contexts with their heartbeats (until then the limit is 512).
    wait_for(lambda: take_view(cluster, fresh=True).context("tiny"), DEADLINE, what="tiny's context in the view")
    long = " ".join(["tea"] * 700)  # 1,400 tokens: tiny holds 2,048, so about 600 are left
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert 400 < chat.usage.completion_tokens == 2048 - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length"
    response = httpx.post(f"{url}/responses", json={"model": "tiny", "input": long, "temperature": 0,
                                                   "ignore_eos": True}, timeout=DEADLINE).json()
    room = 2048 - response["usage"]["input_tokens"]
    assert response["status"] == "incomplete" and response["incomplete_details"]["reason"] == "max_output_tokens"
    assert response["max_output_tokens"] == room == response["usage"]["output_tokens"]
    # Streamed, the events carry the same limit from the first one on (a prompt leaving a few tokens).
    nearly = " ".join(["tea"] * 1010)
    events = list(client.responses.create(model="tiny", input=nearly, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    final = events[-1].response
    assert final.status == "incomplete" and 0 < final.usage.output_tokens < 100
    assert {e.response.max_output_tokens for e in events if hasattr(e, "response")} == {final.usage.output_tokens}


def _listening_line(proc) -> str:
    for line in proc.stdout:
        if "listening on" in line:
            return line.strip()
    raise AssertionError(f"daskllm serve exited ({proc.wait()}) without listening")


def test_relay_skips_text_a_rerun_repeats():
    """A rerun's events (from offset 0 again) forward only text the reader has not had."""
    relay = StreamRelay.__new__(StreamRelay)
    relay._readers = {}

    async def run():
        reader: asyncio.Queue = asyncio.Queue()
        relay._readers["r"] = reader
        for msg in ({"id": "r", "at": 0, "delta": "Hello"}, {"id": "r", "at": 0, "delta": "Hel"},
                    {"id": "r", "at": 0, "delta": "Hello, w"}, {"id": "x", "at": 0, "delta": "other"}):
            relay._route(msg)
        return [reader.get_nowait() for _ in range(reader.qsize())]

    msgs = asyncio.run(run())
    have, out = 0, []
    for m in msgs:
        if m["at"] <= have < m["at"] + len(m["delta"]):
            out.append(m["delta"][have - m["at"]:])
            have = m["at"] + len(m["delta"])
    assert "".join(out) == "Hello, w" and len(msgs) == 3


def test_sampling_of_a_served_request_is_the_builder_s(cluster):
    service = Service(cluster)
    call = Call("completion", "tiny", daskllm.prompts.as_prompt("x"), {"max_tokens": 5, "temperature": 0.5,
                                                                       "seed": 3, "stop": ["\n"]})
    assert service.node(call).params["sampling"] == SamplingParams(max_tokens=5, temperature=0.5, seed=3,
                                                                   stop=("\n",), logprobs=0)


def test_reference_pipelines_run_as_workflow_requests(cluster):
    """`/v1/pipelines/NAME`: a workflow (w2: three dependent calls, on one worker's engine; naive_rag:
    a search over the index sharded across workers, then calls) equals its batch run, over the
    same index (the server's own would hold the same passages: built once, not twice)."""
    from pipelines import registry
    from pipelines.data import Inputs, contexts, passages
    from pipelines.ops import plain

    question = "How do I read a CSV file in Python?"
    # 200 passages: what is asserted (the server equals the batch run over one index) needs no more
    index = daskllm.ShardedIndex.from_texts(cluster, "test-serve-passages", passages(200))
    inputs = Inputs([question], index, [contexts(1)[0]])
    with serving(cluster, pipelines=True, pipelines_index=index, timeout=DEADLINE) as base:
        listed = httpx.get(f"{base}/pipelines", timeout=DEADLINE).json()["data"]
        assert {"w2", "naive_rag"} <= {p["id"] for p in listed}
        for name in ("w2", "naive_rag"):
            reply = httpx.post(f"{base}/pipelines/{name}", timeout=DEADLINE,
                               json={"question": question, "model": "tiny", "max_tokens": 8})
            assert reply.status_code == 200, reply.text
            expected = plain(daskllm.compute(registry()[name](inputs, model="tiny", max_tokens=8))[0])
            assert reply.json()["answer"] == plain(expected)[0]
        missing = httpx.post(f"{base}/pipelines/nope", json={"question": "x"}, timeout=DEADLINE)
        assert missing.status_code == 404 and "w2" in missing.json()["error"]["message"]


def test_a_stream_survives_its_worker_being_killed(client, cluster):
    """SIGKILL the worker decoding a streamed request after its first text: Dask reruns the task on
    the other worker, and the client still reads exactly the batch run's text, nothing repeated."""
    expected = batch(PROMPTS[2:3], max_tokens=120, ignore_eos=True)[0]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=120, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [next(c.choices[0].text for c in stream if c.choices and c.choices[0].text)]

    def decoding(dask_scheduler):
        return {k: ts.processing_on.address for k, ts in dask_scheduler.tasks.items()
                if str(k).startswith("daskllm-stream-") and ts.processing_on is not None}

    running = cluster.run_on_scheduler(decoding)
    assert len(running) == 1, running
    (worker,) = running.values()
    os.kill(cluster.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    pieces += [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == expected
    cluster.wait_for_workers(2, timeout=DEADLINE)  # the nanny restarts it for the tests after
    daskllm.worker.resident_models(cluster)


TOOL = {"type": "function", "function": {"name": "record", "description": "Record a city and its country",
                                         "parameters": {"type": "object", "required": ["city", "country"],
                                                        "properties": {"city": {"type": "string", "maxLength": 12},
                                                                       "country": {"type": "string", "maxLength": 12}}}}}


def test_tool_calls_named_required_and_streamed(client):
    """tool_choice naming a function (DocETL's default) or `required`: the output is constrained to
    the call, so even tiny's random weights call it with arguments that follow the schema."""
    import json

    common = dict(model="tiny", messages=[{"role": "user", "content": "Paris, {France}"}], tools=[TOOL],
                  max_tokens=60, temperature=0)
    named = client.chat.completions.create(**common, tool_choice={"type": "function", "function": {"name": "record"}})
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "record"
    assert set(json.loads(call.function.arguments)) == {"city", "country"}
    required = client.chat.completions.create(**common, tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    chunks = list(client.chat.completions.create(**common, tool_choice="required", stream=True))
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ())
    assert streamed == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # The call and its result in the history: rendered with the tools, answered as text.
    history = [*common["messages"], named.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "recorded"}]
    after = client.chat.completions.create(**{**common, "messages": history, "max_tokens": 4}, tool_choice="none",
                                           extra_body={"return_token_ids": True})
    assert after.choices[0].message.tool_calls is None
    prompt = daskllm.prompts.tokenizer_for("tiny").tokenizer.decode(after.choices[0].model_extra["prompt_token_ids"])
    assert call.function.arguments in prompt and "<tool_response>\nrecorded\n</tool_response>" in prompt


def _engine_counter(cluster, *names: str) -> int:
    """The sum of these counters of every LLM engine of the cluster, as the heartbeat sends them."""
    def read(dask_worker):
        engines = dask_worker.metrics["daskllm"]()["engines"]["llm"]
        return sum(s[name] for s in engines.values() for name in names)

    return sum(cluster.run(read).values())


def _engine_load(cluster) -> int:
    return _engine_counter(cluster, "running", "waiting")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_request(url, cluster, stream):
    """A long request whose client closes the connection: the engines cancel it (they count it
    cancelled, not finished; the time it took is printed: about 0.1 s on an idle machine)."""
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    address = urlsplit(url)
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=DEADLINE)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    cancelled = _engine_counter(cluster, "requests_cancelled")
    deadline = time.monotonic() + DEADLINE
    while _engine_load(cluster) == 0:
        assert time.monotonic() < deadline, "the request never reached an engine"
    sock.close()
    closed = time.monotonic()
    while _engine_load(cluster) > 0:
        assert time.monotonic() < closed + DEADLINE, f"an engine still runs the request {DEADLINE} s after its client left"
    assert _engine_counter(cluster, "requests_cancelled") == cancelled + 1
    print(f"engines idle {time.monotonic() - closed:.3f} s after the client closed (stream={stream})")


def test_errors_say_what_is_wrong_and_requests_are_logged(url, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="daskllm.serve.access"):
        bad = httpx.post(f"{url}/chat/completions", content=b'{"model": "tiny",\n "messages": [}',
                         headers={"content-type": "application/json", "x-request-id": "req-42"}, timeout=DEADLINE)
        good = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                      "temperature": 0}, timeout=DEADLINE)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "req-42"
    error = bad.json()["error"]
    assert error["param"] is None and error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"] and "Expecting value at line 2 column 15" in error["message"]
    # Valid JSON sent as another media type: the content type is named (FastAPI reads only JSON as JSON).
    plain = httpx.post(f"{url}/chat/completions", content=b'{"model": "tiny", "messages": []}',
                       headers={"content-type": "text/plain"}, timeout=DEADLINE)
    assert plain.status_code == 400, plain.text
    assert "Content-Type: application/json" in plain.json()["error"]["message"]
    assert "this request's Content-Type is text/plain" in plain.json()["error"]["message"]
    nowhere = httpx.post(f"{url}/nowhere", json={}, timeout=DEADLINE)
    error = nowhere.json()["error"]
    assert nowhere.status_code == 404 and error["type"] == "not_found_error"
    assert "POST /v1/nowhere" in error["message"] and "/v1/responses" in error["message"], error
    lines = [r.getMessage() for r in caplog.records if r.name == "daskllm.serve.access"]
    assert any('"POST /v1/chat/completions HTTP/1.1" 400' in line and "id=req-42" in line for line in lines), lines
    assert any('"POST /v1/completions HTTP/1.1" 200 model=tiny prompt_tokens=' in line
               and f"completion_tokens={good.json()['usage']['completion_tokens']}" in line for line in lines), lines


RECORD = {"type": "function", **TOOL["function"], "strict": True}  # TOOL as the Responses API writes it
NOW = {"type": "function", "name": "now", "description": "The time now", "strict": True,
       "parameters": {"type": "object", "properties": {}}}


def _as_chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _prompt_ids(**request) -> list[int]:
    """The prompt token ids of a Responses API request, as the server renders it."""
    from daskllm.serve import responses_api

    return list(Service.tool_prompt(responses_api.call(responses_api.ResponsesRequest(**request))).segments[0].ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_loop_on_the_responses_api_is_the_chat_route_s(client, stream):
    """An agent's loop on /v1/responses with the official client: tool_choice "required" makes the
    model call the function; its output goes back as a function_call_output item with the call;
    the model answers in text. Each step, greedy, is the chat route's answer to the same
    conversation: the same prompt token ids, the same name, arguments and text."""
    import json

    question = {"role": "user", "content": "Paris, {France}"}
    common = dict(model="tiny", tools=[RECORD], max_output_tokens=60, temperature=0)

    def respond(**request):
        if not stream:
            return client.responses.create(**common, **request)
        events = list(client.responses.create(**common, **request, stream=True))
        final = events[-1].response
        assert events[-1].type == f"response.{final.status}"
        assert [e.item.id for e in events if e.type == "response.output_item.done"] == [o.id for o in final.output]
        deltas = [e for e in events if e.type in ("response.output_text.delta", "response.function_call_arguments.delta")]
        streamed = "".join(e.delta for e in deltas)
        assert streamed == (final.output_text or "".join(o.arguments for o in final.output
                                                           if o.type == "function_call"))
        assert len(deltas) > 1  # it really streamed
        return final

    called = respond(input=[question], tool_choice="required")
    (call,) = called.output
    assert (call.type, call.name, call.status) == ("function_call", "record", "completed")
    assert set(json.loads(call.arguments)) == {"city", "country"} and call.call_id.startswith("call_")
    chat = client.chat.completions.create(model="tiny", messages=[question], tools=[_as_chat_tool(RECORD)],
                                          tool_choice="required", max_tokens=60, temperature=0,
                                          extra_body={"return_token_ids": True})
    (chat_call,) = chat.choices[0].message.tool_calls
    assert (chat_call.function.name, chat_call.function.arguments) == (call.name, call.arguments)
    assert called.usage.output_tokens == chat.usage.completion_tokens
    assert _prompt_ids(input=[question], tool_choice="required", **common) == \
        chat.choices[0].model_extra["prompt_token_ids"]

    history = [question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "recorded"}]
    answered = respond(input=history, tool_choice="auto")
    assert [o.type for o in answered.output] == ["message"] and answered.output_text
    chat_history = [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "recorded"}]
    after = client.chat.completions.create(model="tiny", messages=chat_history, tools=[_as_chat_tool(RECORD)],
                                           max_tokens=60, temperature=0, extra_body={"return_token_ids": True})
    assert answered.output_text == after.choices[0].message.content
    assert answered.usage.output_tokens == len(after.choices[0].model_extra["token_ids"])
    assert _prompt_ids(input=history, tool_choice="auto", **common) == after.choices[0].model_extra["prompt_token_ids"]


def test_responses_tool_choice_named_none_and_parallel_calls(client):
    """tool_choice naming a function calls it; `none` answers in text as the request without
    tools does; `required` with two tools is a list of calls, at most one with
    parallel_tool_calls false: each the chat route's answer."""
    question = {"role": "user", "content": "Paris, {France}"}
    common = dict(model="tiny", input=[question], tools=[RECORD, NOW], max_output_tokens=60, temperature=0)
    chat_common = dict(model="tiny", messages=[question], tools=[_as_chat_tool(RECORD), _as_chat_tool(NOW)],
                       max_tokens=60, temperature=0)

    def calls(response):
        return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]

    def chat_calls(reply):
        return [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or ()]

    named = client.responses.create(**common, tool_choice={"type": "function", "name": "now"})
    assert calls(named) == chat_calls(client.chat.completions.create(
        **chat_common, tool_choice={"type": "function", "function": {"name": "now"}})) == [("now", "{}")]
    for parallel in (True, False):
        required = client.responses.create(**common, tool_choice="required", parallel_tool_calls=parallel)
        assert required.parallel_tool_calls is parallel and calls(required)
        assert calls(required) == chat_calls(client.chat.completions.create(
            **chat_common, tool_choice="required", parallel_tool_calls=parallel))
        assert parallel or len(calls(required)) == 1
        assert len({o.call_id for o in required.output}) == len(required.output)
    none = client.responses.create(**common, tool_choice="none")
    assert [o.type for o in none.output] == ["message"]
    assert none.output_text == client.chat.completions.create(**chat_common, tool_choice="none").choices[0].message.content
    assert none.output_text == client.responses.create(model="tiny", input=[question], max_output_tokens=60,
                                                       temperature=0).output_text
    for tool, param in (({"type": "web_search"}, "tools"), ({"type": "file_search", "vector_store_ids": ["v"]}, "tools")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny", input="x", tools=[tool])
        assert refused.value.body["param"] == param and tool["type"] in refused.value.body["message"]


def test_langchain_s_responses_mode_runs_a_bound_tool_loop(url):
    """langchain-openai's ChatOpenAI(use_responses_api=True) with a bound tool, end to end: the
    forced call, the tool's result sent back, the answer in text."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class Place(BaseModel):  # short strings: tiny's random words would fill max_tokens
        city: str = Field(max_length=12)
        country: str = Field(max_length=12)

    @tool(args_schema=Place)
    def record(city: str, country: str) -> str:
        """Record a city and its country"""
        return f"recorded {city}, {country}"

    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=url, api_key="unused", use_responses_api=True,
                                      temperature=0, max_tokens=60, timeout=DEADLINE, max_retries=0)
    messages = [HumanMessage("Paris, {France}")]
    called = llm.bind_tools([record], tool_choice="required").invoke(messages)
    (call,) = called.tool_calls
    assert call["name"] == "record" and set(call["args"]) == {"city", "country"}
    messages += [called, ToolMessage(record.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([record]).invoke(messages)
    assert not answer.tool_calls and answer.text
    streamed = list(llm.bind_tools([record], tool_choice="required").stream(messages[:1]))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("record", call["args"])]
