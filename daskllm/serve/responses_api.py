"""OpenAI's Responses API (``POST /v1/responses``), text in and text out, as a chat.

A request is the chat its ``instructions`` (a system message) and ``input`` (a text, or
messages of text parts) make, run as ``/v1/chat/completions`` runs it: the same prompt,
so the same tokens. ``text.format`` (a JSON schema, or any JSON object) constrains decoding
as a chat's ``response_format`` does. What needs state or tools (``previous_response_id``,
``tools``, items other than messages) is refused by name. A streamed response is the API's
server-sent events, each ``event: TYPE`` with its JSON: ``response.created``, ``.in_progress``,
``.output_item.added``, ``.content_part.added``, ``.output_text.delta`` per piece of text,
then the ``.done`` events and ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it, ``response.failed`` on an error).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict

from daskllm.serve.openai_api import APIError, Call, ChatRequest, ContentPart, Result, chat_call


class InputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # store, metadata, user, truncation...: no effect here

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # vLLM's extension
    stream: bool = False
    text: dict | None = None
    tools: list[dict] | None = None
    previous_response_id: str | None = None


TEXT_PARTS = ("input_text", "output_text", "text")


def call(req: ResponsesRequest) -> Call:
    """The chat call of a request (the chat route's own parsing: same prompt, same options)."""
    if req.previous_response_id is not None:
        raise APIError("previous_response_id: responses are not stored here; send the conversation as input",
                       param="previous_response_id")
    if req.tools:
        raise APIError("tools: the Responses API is served for text only; use /v1/chat/completions for tools",
                       param="tools")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", param="max_output_tokens")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError("input must not be empty", param="input")
    for i, item in enumerate(items):
        if item.type != "message" or item.role is None:
            raise APIError(f"input[{i}]: only messages are supported, got {item.type!r}", param="input")
        parts = item.content if isinstance(item.content, list) else [ContentPart(type="text", text=item.content)]
        if any(p.type not in TEXT_PARTS for p in parts):
            raise APIError(f"input[{i}].content: only text parts are supported", param="input")
        messages.append({"role": item.role, "content": "".join(p.text or "" for p in parts)})
    return chat_call(ChatRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream,
                                 response_format=_response_format(req.text)))


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


def body(req: ResponsesRequest, c: Call, result: Result | None, *, error: str | None = None) -> dict:
    """The response object: in progress (no ``result``), completed, incomplete or failed."""
    status = ("failed" if error else "in_progress" if result is None
              else "incomplete" if result.finish_reason == "length" else "completed")
    return {"id": f"resp_{c.id}", "object": "response", "created_at": c.created, "status": status,
            "model": c.model, "output": [message(c, result.text, "completed")] if result is not None else [],
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "previous_response_id": None,
            "store": False, "metadata": {}, "usage": usage(result) if result is not None else None}


def message(c: Call, text: str | None, status: str) -> dict:
    content = [] if text is None else [_part(text)]
    return {"type": "message", "id": f"msg_{c.id}", "status": status, "role": "assistant", "content": content}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def usage(r: Result) -> dict:
    prompt, output = len(r.prompt_token_ids), len(r.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": r.cached_tokens or 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


class Events:
    """The server-sent events of one streamed response, numbered in order."""

    def __init__(self, req: ResponsesRequest, c: Call):
        self.req, self.call = req, c
        self._seq = itertools.count()
        self._where = {"item_id": f"msg_{c.id}", "output_index": 0, "content_index": 0}

    def event(self, kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(self._seq), **fields}

    def start(self) -> Iterator[dict]:
        response = body(self.req, self.call, None)
        yield self.event("response.created", response=response)
        yield self.event("response.in_progress", response=response)
        yield self.event("response.output_item.added", output_index=0, item=message(self.call, None, "in_progress"))
        yield self.event("response.content_part.added", **self._where, part=_part(""))

    def delta(self, text: str) -> dict:
        return self.event("response.output_text.delta", **self._where, delta=text, logprobs=[])

    def finish(self, result: Result) -> Iterator[dict]:
        yield self.event("response.output_text.done", **self._where, text=result.text, logprobs=[])
        yield self.event("response.content_part.done", **self._where, part=_part(result.text))
        yield self.event("response.output_item.done", output_index=0,
                         item=message(self.call, result.text, "completed"))
        response = body(self.req, self.call, result)
        yield self.event(f"response.{response['status']}", response=response)

    def failed(self, error: str) -> dict:
        return self.event("response.failed", response=body(self.req, self.call, None, error=error))
