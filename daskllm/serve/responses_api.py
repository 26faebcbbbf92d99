"""OpenAI's Responses API (``POST /v1/responses``) as a chat: text, JSON and function tools.

A request is the chat its ``instructions`` (a system message) and ``input`` make, run as
``/v1/chat/completions`` runs it: the same prompt, so the same tokens. ``input`` holds
messages (text parts), the model's earlier ``function_call`` items (an assistant message's
``tool_calls``) and the ``function_call_output`` items that answer them (``tool`` messages);
``tools`` of type ``function`` and ``tool_choice`` become the chat's, so the chat route's tool
machinery (:mod:`daskllm.serve.tools`: template, constrained decoding, parser) serves them.
``text.format`` (a JSON schema, or any JSON object) constrains decoding as a chat's
``response_format`` does. What needs state or OpenAI's own tools (``previous_response_id``,
built-in tools, other item types) is refused by name.

The output is a ``message`` item for text and a ``function_call`` item per call. A streamed
response is the API's server-sent events, each ``event: TYPE`` with its JSON:
``response.created``, ``.in_progress``, then per item ``.output_item.added``, its deltas
(``.content_part.added`` and ``.output_text.delta`` for text, ``.function_call_arguments.delta``
for a call) and its ``.done`` events, and last ``response.completed`` (``response.incomplete``
when ``max_output_tokens`` cut it, ``response.failed`` on an error).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict

from daskllm.serve.openai_api import APIError, Call, ChatRequest, ContentPart, Result, chat_call
from daskllm.serve.tools import ToolCall, ToolStream, parse


class InputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call, function_call_output: the call
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # store, metadata, user, truncation...: no effect here

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension: generate to the limit
    stream: bool = False
    text: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None


TEXT_PARTS = ("input_text", "output_text", "text")


def call(req: ResponsesRequest) -> Call:
    """The chat call of a request (the chat route's own parsing: same prompt, same options)."""
    if req.previous_response_id is not None:
        raise APIError("previous_response_id: responses are not stored here; send the conversation as input",
                       param="previous_response_id")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", param="max_output_tokens")
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError("input must not be empty", param="input")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(items)
    c = chat_call(ChatRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream,
                              ignore_eos=req.ignore_eos,
                              response_format=_response_format(req.text), tools=_chat_tools(req.tools),
                              tool_choice=_chat_tool_choice(req.tool_choice),
                              parallel_tool_calls=req.parallel_tool_calls))
    c.prompt_field = "input"
    c.max_tokens_field = "max_output_tokens" if req.max_output_tokens is not None else None
    return c


def _messages(items: list[InputItem]) -> list[dict]:
    """The chat messages of input items. Function calls following an assistant's message (or
    each other) are that message's ``tool_calls``, as a chat writes parallel calls."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        if item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise APIError(f"input[{i}]: a function_call needs call_id, name and arguments", param="input")
            called = {"id": item.call_id, "type": "function",
                      "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(called)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [called]})
        elif item.type == "function_call_output":
            if not item.call_id:
                raise APIError(f"input[{i}]: a function_call_output needs the call_id it answers", param="input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(i, item.output)})
        elif item.type == "message" and item.role is not None:
            messages.append({"role": item.role, "content": _text(i, item.content)})
        else:
            raise APIError(f"input[{i}]: items of type {item.type!r} are not supported (message, function_call "
                           "and function_call_output are)", param="input")
    return messages


def _text(i: int, content: str | list[ContentPart] | None) -> str:
    parts = content if isinstance(content, list) else [ContentPart(type="text", text=content)]
    if any(p.type not in TEXT_PARTS for p in parts):
        raise APIError(f"input[{i}]: only text parts are supported", param="input")
    return "".join(p.text or "" for p in parts)


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools as a chat's (``{"type": "function", "function": {...}}``): the same
    functions, so the same prompt. OpenAI's built-in tools run on OpenAI's side: refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(f"tools[{i}]: only function tools are served here, not {kind!r}", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise APIError(f"tool_choice: none, auto, required or {{\"type\": \"function\", \"name\": ...}}, "
                       f"not {choice!r}", param="tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}
def _response_format(text: dict | None) -> dict | None:
    """``text.format`` as a chat's ``response_format`` (the Responses API has it one level flatter)."""
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    raise APIError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", param="text")



# --- responses ------------------------------------------------------------------------------


def body(req: ResponsesRequest, c: Call, result: Result | None, *, output: list[dict] | None = None,
         error: str | None = None) -> dict:
    """The response object: in progress (no ``result``), completed, incomplete or failed;
    ``output``: its items (default: those of ``result``)."""
    status = ("failed" if error else "in_progress" if result is None
              else "incomplete" if result.finish_reason == "length" else "completed")
    if output is None:
        output = output_items(c, result) if result is not None else []
    return {"id": f"resp_{c.id}", "object": "response", "created_at": c.created, "status": status,
            "model": c.model, "output": output,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": c.options["max_tokens"],
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "metadata": {}, "usage": usage(result) if result is not None else None}


def output_items(c: Call, result: Result) -> list[dict]:
    """A message for the text (also when there is neither text nor a call), a function_call per call."""
    status = _status(result)
    content, calls = parse(c.tools, result.text) if c.tools is not None else (result.text, [])
    items = [message(c, content or "", status)] if content or not calls else []
    return items + [function_call(tc, status) for tc in calls]


def _status(result: Result) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def message(c: Call, text: str | None, status: str) -> dict:
    content = [] if text is None else [_part(text)]
    return {"type": "message", "id": f"msg_{c.id}", "status": status, "role": "assistant", "content": content}


def function_call(tc: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{tc.id.removeprefix('call_')}", "call_id": tc.id, "name": tc.name,
            "arguments": tc.arguments, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def usage(r: Result) -> dict:
    prompt, output = len(r.prompt_token_ids), len(r.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": r.cached_tokens or 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


class Events:
    """The server-sent events of one streamed response, numbered in order. Text and calls come
    as the chat route streams them (:class:`~daskllm.serve.tools.ToolStream`'s deltas); each
    opens its item where it starts and closes the one before."""

    def __init__(self, req: ResponsesRequest, c: Call):
        self.req, self.call = req, c
        self.items: list[dict] = []  # the output so far; the last may be open
        self._open = False
        self._seq = itertools.count()
        self._tools = ToolStream(c.tools) if c.tools is not None else None

    def event(self, kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(self._seq), **fields}

    def start(self) -> Iterator[dict]:
        response = body(self.req, self.call, None)
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)

    def delta(self, text: str) -> Iterator[dict]:
        for delta in self._tools.feed(text) if self._tools is not None else [{"content": text}]:
            yield from self._delta(delta)

    def finish(self, result: Result) -> Iterator[dict]:
        for delta in self._tools.finish() if self._tools is not None else ():
            yield from self._delta(delta)
        if not self.items:  # neither text nor a call: an empty message, as the whole response has
            yield from self._text("")
        yield from self._close(_status(result))
        response = body(self.req, self.call, result, output=self.items)
        yield self.event(f"response.{response['status']}", response=response)

    def failed(self, error: str) -> dict:
        return self.event("response.failed", response=body(self.req, self.call, None, error=error))

    def _delta(self, delta: dict) -> Iterator[dict]:
        if delta.get("content"):
            yield from self._text(delta["content"])
        for part in delta.get("tool_calls") or ():
            function = part["function"]
            if "id" in part:  # a new call
                yield from self._close("completed")
                yield from self._add(function_call(ToolCall(function["name"], "", part["id"]), "in_progress"))
            if function.get("arguments"):
                item = self.items[-1]
                item["arguments"] += function["arguments"]
                yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, delta=function["arguments"])

    def _text(self, text: str) -> Iterator[dict]:
        if not (self._open and self.items[-1]["type"] == "message"):
            yield from self._close("completed")
            yield from self._add(message(self.call, None, "in_progress"))
            self.items[-1]["content"].append(_part(""))
            yield self.event("response.content_part.added", **self._where(), part=_part(""))
        if text:
            self.items[-1]["content"][0]["text"] += text
            yield self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def _add(self, item: dict) -> Iterator[dict]:
        self.items.append(item)
        self._open = True
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item={**item, "content": []} if item["type"] == "message" else dict(item))

    def _close(self, status: str) -> Iterator[dict]:
        """The done events of the open item, if one is."""
        if not self._open:
            return
        self._open = False
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield self.event("response.output_text.done", **self._where(), text=text, logprobs=[])
            yield self.event("response.content_part.done", **self._where(), part=_part(text))
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}
