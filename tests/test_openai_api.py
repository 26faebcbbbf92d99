"""The OpenAI wire format: requests to daskllm calls and results to responses (pure logic, fast)."""

from __future__ import annotations

import base64

import dask
import numpy as np
import pytest

from daskllm.prompts import Text, Tokens
from daskllm.serve import openai_api as api
from daskllm.serve.openai_api import APIError


def completion(**body):
    return api.completion_calls(api.CompletionRequest(model="tiny", **body))


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
    assert chat.fill_context and chat.kind == "chat"  # no cap: the context's room, once the prompt is known
    assert not api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=7)).fill_context
    with dask.config.set({"daskllm.serve.default-max-tokens": 300}):  # the operator's default
        capped = api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}]))
    assert capped.options["max_tokens"] == 300 and not capped.fill_context


def test_n_choices_greedy_copies_seeded_draws_and_indices():
    greedy = completion(prompt="x", n=3, temperature=0, seed=5)
    assert [c.index for c in greedy] == [0, 1, 2] and len({c.id for c in greedy}) == 1
    assert all(c.options == greedy[0].options for c in greedy)  # equal calls: computed once
    seeded = completion(prompt="x", n=3, temperature=0.8, seed=7)
    assert [c.options["seed"] for c in seeded] == [7, 8, 9]  # reproducible; the first is the n=1 draw
    assert [c.options["seed"] for c in completion(prompt="x", n=2, temperature=0.8)] == [None, None]
    two_prompts = completion(prompt=["a", "b"], n=2)
    assert [(c.index, c.prompt.segments) for c in two_prompts] == [
        (0, (Text("a"),)), (1, (Text("a"),)), (2, (Text("b"),)), (3, (Text("b"),))]
    assert len({c.id for c in two_prompts}) == 1
    chat = api.chat_calls(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, seed=1))
    assert [(c.index, c.options["seed"]) for c in chat] == [(0, 1), (1, 2)]
    results = [api.Result("a", [1], "eos", [9]), api.Result("b", [2, 3], "length", [9])]
    body = api.chat_response(chat, results, str)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"), (1, "b", "length")]
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == 2
    assert api.chunk(chat[1], "x")["choices"][0]["index"] == 1


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"), ({"n": 0}, "n"),
])
def test_chat_fields_are_refused_by_name(body, param):
    with pytest.raises(APIError) as error:
        api.chat_calls(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], **body))
    assert error.value.param == param and param in str(error.value)


def test_logit_bias_of_100_restricts_tokens_and_extensions_pass_through():
    (call,) = completion(prompt="x", logit_bias={"7": 100, "3": 100}, allowed_token_ids=[9],
                         structured_outputs={"choice": ["yes", "no"]}, ignore_eos=False, priority=2,
                         deadline_ms=250, return_token_ids=True)
    assert call.options["allowed_token_ids"] == [3, 7, 9]
    assert call.options["choices"] == ["yes", "no"]
    assert (call.priority, call.deadline_ms, call.return_token_ids) == (2, 250, True)


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": api.MAX_N + 1}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
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


def test_embedding_inputs_texts_and_token_ids():
    def inputs(value, **body):
        return api.EmbeddingRequest(model="m", input=value, **body).inputs()

    assert inputs("a") == ["a"] and inputs(["a", "b"]) == ["a", "b"]
    assert inputs([101, 7592, 102]) == [[101, 7592, 102]] and inputs([[1, 2], [3]]) == [[1, 2], [3]]
    for bad in ([], [""], [[1], []], [-1]):
        with pytest.raises(APIError) as error:
            inputs(bad)
        assert error.value.param == "input"
    for bad in (5, [1, "a"], [[1], "a"], {"text": "a"}, [True]):
        with pytest.raises(ValueError, match="a list of lists of token ids"):
            api.EmbeddingRequest(model="m", input=bad)
    with pytest.raises(APIError) as error:
        inputs("a", dimensions=0)
    assert error.value.param == "dimensions"
    assert api.embedding_response("m", [np.ones(2)], prompt_tokens=7)["usage"] == {"prompt_tokens": 7,
                                                                                 "total_tokens": 7}


def test_dimensions_shorten_matryoshka_models_only():
    from daskllm.serve.embeddings import Embedder, shortened

    plain, trained, sizes = Embedder("m", False), Embedder("m", True), Embedder("m", (64, 128))
    for embedder in (plain, trained, sizes):
        embedder.check(None, 384)
        embedder.check(384, 384)  # the model's own size is always fine
    for embedder, dimensions in ((plain, 128), (sizes, 100), (trained, 500), (trained, 0)):
        with pytest.raises(APIError) as error:
            embedder.check(dimensions, 384)
        assert error.value.param == "dimensions" and "dimensions" in str(error.value)
    trained.check(100, 384)
    sizes.check(128, 384)
    vector = np.arange(1, 385, dtype=np.float32)
    (short,) = shortened([vector / np.linalg.norm(vector)], 128)
    assert short.shape == (128,) and np.linalg.norm(short) == pytest.approx(1.0)
    assert short == pytest.approx(vector[:128] / np.linalg.norm(vector[:128]))
    assert shortened([vector], None)[0] is vector


def test_models_are_what_the_routes_serve():
    held = {"llm": ["tiny"], "embed": ["all-MiniLM-L6-v2"], "rerank": ["all-MiniLM-L6-v2", "bge-reranker"]}
    assert [m["id"] for m in api.models_response(held)["data"]] == ["all-MiniLM-L6-v2", "tiny"]


def test_base64_embeddings_are_little_endian_float32():
    body = api.embedding_response("m", [np.array([1.0, -2.5])], "base64")
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == [1.0, -2.5]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def tool_chat(**body):
    body = {"tools": TOOLS, **body}
    return api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         **body))


def test_tool_choice_sets_the_constraint_as_vllm_does():
    assert "schema" not in tool_chat().options and tool_chat().tools.choice == "auto"
    named = tool_chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.options["schema"] == {**TOOLS[0]["function"]["parameters"], "additionalProperties": False}
    required = tool_chat(tool_choice="required", parallel_tool_calls=False).options["schema"]
    assert required["type"] == "array" and required["maxItems"] == 1
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "now"}]
    none = tool_chat(tool_choice="none")  # the request without tools: the model's own template
    assert none.prompt is not None and "schema" not in none.options


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_refused_by_name(body, param):
    with pytest.raises(APIError) as error:
        tool_chat(**body)
    assert error.value.param == param and param in str(error.value)


def test_tool_calls_are_parsed_from_hermes_and_llama_layouts():
    from daskllm.serve.tools import parse

    tools = tool_chat().tools
    content, calls = parse(tools, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                  '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    _, calls = parse(tools, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    # Not a call to one of the request's functions: it stays text.
    assert parse(tools, '{"name": "rm", "arguments": {}}') == ('{"name": "rm", "arguments": {}}', [])
    assert parse(tools, "It is sunny {today}.") == ("It is sunny {today}.", [])


def test_tool_responses_and_streamed_deltas():
    from daskllm.serve.tools import ToolStream

    call = tool_chat()
    result = api.Result('<tool_call>{"name": "now", "arguments": {}}</tool_call>', [1, 2], "eos", [3])
    choice = api.chat_response([call], [result], str)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    # Streamed: content goes out while it cannot be a call; the call comes whole at the end.
    stream = ToolStream(call.tools)
    deltas = [d for piece in ("Sure", ". <tool", '_call>{"name": "now", "arguments": {}}</tool_call>')
              for d in stream.feed(piece)] + list(stream.finish())
    assert deltas[:2] == [{"content": "Sure"}, {"content": ". "}] and stream.called
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    # A named function: its arguments stream as they come, the first delta naming the call.
    named = ToolStream(tool_chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools)
    first, second = [d for piece in ('{"city": ', '"Paris"}') for d in named.feed(piece)]
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}


def test_history_with_tool_calls_renders_with_the_tools():
    from daskllm.prompts import tokenizer_for
    from daskllm.serve.tools import render

    messages = [{"role": "user", "content": "Weather in {Paris}?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    call = api.chat_call(api.ChatRequest(model="tiny", messages=messages, tools=TOOLS))
    assert call.prompt is None and call.messages[1]["tool_calls"]
    text = render(tokenizer_for("tiny").tokenizer, call.messages, call.tools)
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert "Weather in {Paris}?" in text and text.endswith("<|im_start|>assistant\n")


def test_chat_content_is_literal_text():
    """Braces in a message are text, not template fields."""
    call = api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": 'Say {"a": 1}'}]))
    assert call.prompt.chat == (("user", (Text('Say {"a": 1}'),)),)


def test_a_response_request_is_the_chat_of_its_instructions_and_input():
    from daskllm.serve import responses_api as responses

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = responses.ResponsesRequest(model="tiny", instructions="Be brief.", max_output_tokens=9, temperature=0,
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                                     text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    call = responses.call(req)
    chat = api.chat_call(api.ChatRequest(model="tiny", max_tokens=9, temperature=0,
                                         messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}],
                                         response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    assert call.prompt == chat.prompt and call.options == chat.options
    plain = responses.call(responses.ResponsesRequest(model="tiny", input="Hi"))
    assert plain.prompt.chat == (("user", (Text("Hi"),)),) and plain.options["max_tokens"] == api.CHAT_MAX_TOKENS
    result = api.Result('{"city": "Par', [1, 2], "length", [3, 4, 5], cached_tokens=2)
    body = responses.body(req, call, result)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"] == [{"type": "output_text", "text": '{"city": "Par', "annotations": []}]
    assert body["usage"]["input_tokens"] == 3 and body["usage"]["output_tokens"] == 2
    events = responses.Events(req, call)
    kinds = [e["type"] for e in [*events.start(), *events.delta("{"), *events.finish(result)]]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tools": [{"type": "file_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f f"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": []}, "input"), ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_a_response_cannot_do_is_refused_by_name(body, param):
    from daskllm.serve import responses_api as responses

    with pytest.raises(APIError) as error:
        responses.call(responses.ResponsesRequest(model="tiny", **{"input": "Hi", **body}))
    assert error.value.param == param


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                   "strict": True},
                  {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}, "strict": True}]


def test_a_response_with_tools_is_the_chat_with_those_tools():
    """Function tools, tool_choice and the conversation's calls and results become the chat
    route's: the same messages, tools and constraint, so the same prompt and tokens."""
    from daskllm.serve import responses_api as responses

    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
                     "id": "fc_1", "status": "completed"},
                    {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"type": "function_call_output", "call_id": "call_2",
                     "output": [{"type": "input_text", "text": "noon"}]}]
    chat_messages = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                         {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                     {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in RESPONSE_TOOLS]
    for choice, chat_choice in (("required", "required"), ("none", "none"), ("auto", "auto"),
                                ({"type": "function", "name": "now"}, {"type": "function", "function": {"name": "now"}})):
        for parallel in (None, False):
            c = responses.call(responses.ResponsesRequest(model="tiny", input=conversation, tools=RESPONSE_TOOLS,
                                                          tool_choice=choice, parallel_tool_calls=parallel))
            chat = api.chat_call(api.ChatRequest(model="tiny", messages=chat_messages, tools=chat_tools,
                                                 tool_choice=chat_choice, parallel_tool_calls=parallel))
            assert (c.messages, c.tools, c.options) == (chat.messages, chat.tools, chat.options)
            assert (c.prompt_field, chat.prompt_field) == ("input", "messages")
    assert c.options["schema"] == {"type": "object", "properties": {}, "additionalProperties": False}
    required = responses.call(responses.ResponsesRequest(model="tiny", input="Hi", tools=RESPONSE_TOOLS,
                                                         tool_choice="required", parallel_tool_calls=False))
    assert required.options["schema"]["maxItems"] == 1


def test_response_calls_are_function_call_items_whole_and_streamed():
    from daskllm.serve import responses_api as responses

    req = responses.ResponsesRequest(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, tool_choice="required")
    c = responses.call(req)
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"now","parameters":{}}]'
    result = api.Result(text, [1, 2], "eos", [3])
    output = responses.body(req, c, result)["output"]
    assert [(o["type"], o["name"], o["arguments"], o["status"]) for o in output] == [
        ("function_call", "get_weather", '{"city": "Oslo"}', "completed"), ("function_call", "now", "{}", "completed")]
    assert all(o["call_id"].startswith("call_") and o["id"].startswith("fc_") for o in output)
    # Streamed: a required list of calls comes whole at the end, one item per call
    events = responses.Events(req, c)
    got = [*events.start(), *events.delta(text[:20]), *events.delta(text[20:]), *events.finish(result)]
    assert [e["type"] for e in got] == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1]
    final = got[-1]["response"]["output"]
    assert [(o["name"], o["arguments"]) for o in final] == [(o["name"], o["arguments"]) for o in output]
    assert [e["item"]["id"] for e in got if e["type"] == "response.output_item.added"] == [o["id"] for o in final]
    # A named function: its arguments stream as they decode
    named = responses.ResponsesRequest(model="tiny", input="Weather?", tools=RESPONSE_TOOLS, stream=True,
                                       tool_choice={"type": "function", "name": "get_weather"})
    events = responses.Events(named, responses.call(named))
    result = api.Result('{"city": "Rome"}', [1, 2], "eos", [3])
    got = [*events.start(), *events.delta('{"city": '), *events.delta('"Rome"}'), *events.finish(result)]
    assert [e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"] == [
        '{"city": ', '"Rome"}']
    assert [e["arguments"] for e in got if e["type"] == "response.function_call_arguments.done"] == [result.text]
    # auto: text, then a call, as two items; tool_choice none: text only
    auto = responses.ResponsesRequest(model="tiny", input="Weather?", tools=RESPONSE_TOOLS)
    said = 'Let me look.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    output = responses.body(auto, responses.call(auto), api.Result(said, [1], "eos", [3]))["output"]
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me look."
    events = responses.Events(auto, responses.call(auto))
    got = [*events.start(), *events.delta(said), *events.finish(api.Result(said, [1], "eos", [3]))]
    assert [(o["type"], o.get("name")) for o in got[-1]["response"]["output"]] == [("message", None),
                                                                                  ("function_call", "now")]


def test_overflow_is_context_length_exceeded_naming_the_prompt_field():
    """vLLM's wording and OpenAI's code; an explicit max_tokens counts, a default one does not
    (generation stops at the context)."""
    from daskllm.serve import responses_api as responses

    chat = api.chat_call(api.ChatRequest(model="tiny", messages=[{"role": "user", "content": "hi"}]))
    api.check_context(chat, 2047, 2048)  # the default max_tokens: room for one token is enough
    with pytest.raises(APIError) as error:
        api.check_context(chat, 2048, 2048)
    assert (error.value.status, error.value.code, error.value.param) == (400, "context_length_exceeded", "messages")
    assert "maximum context length is 2048 tokens" in str(error.value)
    assert "your messages have 2048 tokens" in str(error.value)
    (default_completion,) = completion(prompt="x")  # no max_tokens: the prompt and one token must fit
    with pytest.raises(APIError) as error:
        api.check_context(default_completion, 2048, 2048)
    assert "your prompt has 2048 tokens, and at least one token must be generated" in str(error.value)
    with pytest.raises(APIError) as error:
        api.check_context(responses.call(responses.ResponsesRequest(model="tiny", input="hi")), 2048, 2048)
    assert "your input has 2048 tokens" in str(error.value)
    (completion_call,) = completion(prompt="x", max_tokens=100)
    api.check_context(completion_call, 1948, 2048)
    with pytest.raises(APIError) as error:
        api.check_context(completion_call, 1949, 2048)
    assert error.value.param == "prompt" and "you requested 2049 tokens (1949 in the prompt, 100" in str(error.value)
    response = responses.call(responses.ResponsesRequest(model="tiny", input="hi", max_output_tokens=10))
    with pytest.raises(APIError) as error:
        api.check_context(response, 2040, 2048)
    assert error.value.param == "input" and "max_output_tokens" in str(error.value)
    assert error.value.body()["error"]["code"] == "context_length_exceeded"
