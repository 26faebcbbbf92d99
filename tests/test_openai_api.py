"""The OpenAI wire format: requests to daskllm calls and results to responses (pure logic, fast)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from daskllm.prompts import Text, Tokens
from daskllm.serve import openai_api as api
from daskllm.serve.openai_api import APIError


def completion(**body):
    return api.completion_calls(api.CompletionRequest(model="tiny", **body), default_max_tokens=16)


def test_a_list_of_prompts_is_one_call_each_and_token_ids_stay_ids():
    calls = completion(prompt=["a", "b"], max_tokens=5, temperature=0, stop="\n")
    assert [c.prompt.segments for c in calls] == [(Text("a"),), (Text("b"),)]
    assert calls[0].options["max_tokens"] == 5 and calls[0].options["stop"] == ["\n"]
    (ids,) = completion(prompt=[3, 4, 5])
    assert ids.prompt.segments == (Tokens((3, 4, 5), "tiny"),)
    assert len(completion(prompt=[[1, 2], [3]])) == 2


def test_defaults_follow_openai():
    (call,) = completion(prompt="x")
    assert call.options["max_tokens"] == 16 and call.options["temperature"] == 1.0
    chat = api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}]))
    assert chat.options["max_tokens"] == 512 and chat.kind == "chat"


def test_logit_bias_of_100_restricts_tokens_and_extensions_pass_through():
    (call,) = completion(prompt="x", logit_bias={"7": 100, "3": 100}, allowed_token_ids=[9],
                         structured_outputs={"choice": ["yes", "no"]}, ignore_eos=False, priority=2,
                         deadline_ms=250, return_token_ids=True)
    assert call.options["allowed_token_ids"] == [3, 7, 9]
    assert call.options["choices"] == ["yes", "no"]
    assert (call.priority, call.deadline_ms, call.return_token_ids) == (2, 250, True)


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"logit_bias": {"x": 100}}, "logit_bias"), ({"logprobs": 50}, "logprobs"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"), ({"deadline_ms": 0}, "deadline_ms"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    with pytest.raises(APIError) as error:
        completion(prompt="x", **body)
    assert error.value.param == param and error.value.status == 400
    assert error.value.body()["error"]["param"] == param


def test_chat_messages_and_response_formats():
    req = api.ChatRequest(model="tiny", messages=[{"role": "developer", "content": "Be brief."},
                                                  {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                          response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                          logprobs=True, top_logprobs=2)
    call = api.chat_call(req)
    assert call.options["schema"] == {"type": "object"} and call.logprobs == 2
    assert [role for role, _ in call.prompt.chat] == ["system", "user"]
    with pytest.raises(APIError, match="only text parts"):
        api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url"}]}]))
    with pytest.raises(APIError, match="response_format"):
        api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "x"}],
                                      response_format={"type": "xml"}))


def test_responses_carry_usage_finish_reasons_and_token_ids():
    (call,) = completion(prompt="x", return_token_ids=True, logprobs=1)
    result = api.Result("ab", [5, 6], "eos", [1, 2, 3], [-0.1, -0.2], [{5: -0.1}, {6: -0.2}], cached_tokens=2)
    body = api.completion_response([call], [result], lambda ids: "".join(chr(96 + i) for i in ids))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [5, 6] and choice["prompt_token_ids"] == [1, 2, 3]
    assert choice["logprobs"]["tokens"] == ["e", "f"] and choice["logprobs"]["top_logprobs"] == [{"e": -0.1}, {"f": -0.2}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert api.chunk(call, "x", "length")["choices"][0]["finish_reason"] == "length"


def test_base64_embeddings_are_little_endian_float32():
    body = api.embedding_response("m", [np.array([1.0, -2.5])], "base64")
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == [1.0, -2.5]
