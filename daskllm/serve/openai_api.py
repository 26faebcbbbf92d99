"""The OpenAI wire format: requests parsed into daskllm calls, results written as responses.

Only this module knows OpenAI's field names. A request becomes a :class:`Call` (a daskllm
prompt, ``generate`` options and how to answer); a bad field is an :class:`APIError` naming it,
answered with OpenAI's error body. Extensions follow vLLM's spelling where it has one
(``ignore_eos``, ``allowed_token_ids``, ``structured_outputs``, ``return_token_ids``,
``priority``), so a client written for vLLM works unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from daskllm import config
from daskllm.prompts import Prompt, Text, as_prompt, chat, tokens
from daskllm.serve.tools import ToolCall, ToolError, Tools, parse, tools_of

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}

# max_tokens when a request gives none: OpenAI's and vLLM's 16 for completions; for a chat
# (and a response) the context's room after the prompt (Call.fill_context), or the operator's
# daskllm.serve.default-max-tokens; CHAT_MAX_TOKENS only where the model reports no context.
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 512
MAX_N = 128  # choices per request: one request cannot fill the engines' queues


class APIError(Exception):
    """A request the server answers with an OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do (clients send e.g. `user`);
    # known fields daskllm cannot honour are refused by name below.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names)
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None
    structured_outputs: dict | None = None
    return_token_ids: bool = False
    priority: int = 0
    # daskllm's: the latency target of this request, in milliseconds from its arrival
    deadline_ms: float | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    # Text, texts, one text's token ids or several texts' (the embedding model's own ids)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32, as OpenAI's
    dimensions: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_the_shapes(cls, value):
        ids = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
        if isinstance(value, str) or ids(value) or (isinstance(value, list) and (
                all(isinstance(x, str) for x in value) or all(ids(x) for x in value))):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    def inputs(self) -> list[str | list[int]]:
        """One item per vector asked for: a text or a text's token ids."""
        raw = self.input
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items or not all(items) or any(t < 0 for x in items if isinstance(x, list) for t in x):
            raise APIError("input must not be empty, nor hold an empty text, an empty list or a negative token id",
                           param="input")
        if self.dimensions is not None and self.dimensions < 1:
            raise APIError(f"dimensions must be at least 1, got {self.dimensions}", param="dimensions")
        return items


class PipelineRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    question: str
    contexts: list[str] | None = None
    model: str | None = None
    max_tokens: int = 16
    priority: int = 0
    deadline_ms: float | None = None


@dataclass
class Call:
    """One request as daskllm runs it: ``generate(prompt, model=model, **options)``."""

    kind: str  # "completion" or "chat" (a Responses API request is a chat)
    model: str
    prompt: Prompt | None  # None: ``messages`` rendered with ``tools`` by the model's template (set when first built)
    options: dict
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: int | None = None  # what the client asked for (the call always computes logprobs=0 or more)
    priority: int = 0
    deadline_ms: float | None = None
    tools: Tools | None = None
    messages: list[dict] | None = None  # the chat, where the prompt is rendered with tools
    prompt_field: str = "prompt"  # the request's field the prompt came from (messages, input): errors name it
    max_tokens_field: str | None = None  # the field that set max_tokens (None: the default)
    fill_context: bool = False  # no limit set: max_tokens becomes the context's room once the prompt is tokenized
    index: int = 0  # the choice this call answers
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])  # the request's (its choices share it)
    created: int = field(default_factory=lambda: int(time.time()))


def _options(req: _Request, max_tokens: tuple[str, int | None], default_max_tokens: int) -> dict:
    """``generate``'s options; ``max_tokens`` is (the field that gave it, its value)."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    name, limit = max_tokens
    if limit is not None and limit < 1:
        raise APIError(f"{name} must be at least 1, got {limit}", param=name)
    if not req.temperature >= 0:
        raise APIError(f"temperature must be at least 0, got {req.temperature}", param="temperature")
    if not 0 < req.top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(f"{name}: penalties are not supported", param=name)
    allowed = list(req.allowed_token_ids or ())
    for token, bias in (req.logit_bias or {}).items():
        # Only "+100" (always allowed) has a meaning daskllm keeps: a restriction to those tokens.
        if bias < 100:
            raise APIError("logit_bias: only biases of 100 (restrict the output to those tokens) are supported",
                           param="logit_bias")
        try:
            allowed.append(int(token))
        except ValueError:
            raise APIError(f"logit_bias: {token!r} is not a token id", param="logit_bias") from None
    options: dict[str, Any] = dict(
        max_tokens=limit if limit is not None else default_max_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or ()),
        ignore_eos=req.ignore_eos, allowed_token_ids=sorted(set(allowed)))
    if req.structured_outputs:
        options.update(_structured(req.structured_outputs))
    if req.deadline_ms is not None and not req.deadline_ms > 0:
        raise APIError("deadline_ms must be a positive number of milliseconds", param="deadline_ms")
    return options


def _structured(spec: dict) -> dict:
    known = {"json": "schema", "choice": "choices", "regex": "regex"}
    given = [k for k in spec if spec[k] is not None]
    if len(given) != 1 or given[0] not in known:
        raise APIError(f"structured_outputs: give exactly one of {sorted(known)}, got {sorted(spec)}",
                       param="structured_outputs")
    value = spec[given[0]]
    if given[0] == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise APIError(f"structured_outputs.json: not valid JSON ({exc})", param="structured_outputs") from None
    return {known[given[0]]: value}


def completion_calls(req: CompletionRequest) -> list[Call]:
    """``n`` calls per prompt of a completions request (``prompt`` may be a list of prompts)."""
    if req.echo:
        raise APIError("echo is not supported", param="echo")
    if req.best_of not in (None, 1):
        raise APIError("best_of: only 1 is supported", param="best_of")
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError("logprobs must be between 0 and 20", param="logprobs")
    options = _options(req, ("max_tokens", req.max_tokens), COMPLETION_MAX_TOKENS)
    raw = req.prompt
    prompts: list = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    calls: list[Call] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            prompt = as_prompt(p)
        elif p and all(isinstance(t, int) and t >= 0 for t in p):
            prompt = tokens(p, req.model)
        else:
            raise APIError(f"prompt[{i}] must be text or a non-empty list of token ids", param="prompt")
        call = _call("completion", req, prompt, options, req.logprobs)
        call.max_tokens_field = "max_tokens" if req.max_tokens is not None else None
        if calls:
            call.id, call.created = calls[0].id, calls[0].created  # one response
        calls += choices(call, req.n, first=i * req.n)
    return calls


def choices(call: Call, n: int, first: int = 0) -> list[Call]:
    """The ``n`` choices of ``call``, indexed from ``first``. Greedy: n equal calls (they share one
    computation); sampled, n draws: with a seed, choice i draws with seed + i (reproducible, and
    the first is the n=1 answer), without one, each its own."""
    seed, greedy = call.options.get("seed"), call.options.get("temperature") == 0
    return [dataclasses.replace(call, index=first + i,
                                options=call.options if seed is None or greedy else {**call.options, "seed": seed + i})
            for i in range(n)]


def chat_calls(req: ChatRequest) -> list[Call]:
    return choices(chat_call(req), req.n)


def chat_call(req: ChatRequest) -> Call:
    if not req.messages:
        raise APIError("messages must not be empty", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            text = "".join(p.text or "" for p in m.content)
        else:
            text = m.content or ""
        if m.tool_calls and m.role != "assistant":
            raise APIError(f"messages[{i}].tool_calls: only an assistant message makes tool calls", param="messages")
        message = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.role == "tool":
            message.update(tool_call_id=m.tool_call_id, name=m.name)
        messages.append(message)
    try:
        tools = tools_of(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolError as exc:
        raise APIError(str(exc), param=exc.param) from None
    limit = ("max_completion_tokens", req.max_completion_tokens) if req.max_completion_tokens is not None \
        else ("max_tokens", req.max_tokens)
    server_default = config.get("serve.default-max-tokens", None)
    options = _options(req, limit, server_default or CHAT_MAX_TOKENS)
    if req.response_format:
        options.update(_response_format(req.response_format))
    if tools is not None and (schema := tools.schema()) is not None:
        if any(k in options for k in ("schema", "choices", "regex")):
            raise APIError(f"tool_choice {tools.choice!r} constrains the output: it cannot be combined with "
                           f"response_format or structured_outputs", param="tool_choice")
        options["schema"] = schema
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError("top_logprobs must be between 0 and 20", param="top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if (tools is None or tools.choice == "none") and not any(m["role"] == "tool" or "tool_calls" in m
                                                             for m in messages):
        # No tools in sight: the model's own template, as for any chat. The content is literal
        # text (an OpenAI message has no template fields: braces are braces).
        literal = [{"role": m["role"], "content": Prompt((Text(m["content"]),) if m["content"] else (), {})}
                   for m in messages]
        call = _call("chat", req, chat(literal), options, logprobs)
    else:
        call = _call("chat", req, None, options, logprobs)
        call.messages = messages
    call.tools = tools
    call.prompt_field = "messages"
    call.max_tokens_field = limit[0] if limit[1] is not None else None
    call.fill_context = limit[1] is None and not server_default
    return call


def check_context(call: Call, prompt_tokens: int, context: int) -> None:
    """Refuse a call its model's context cannot hold, as vLLM does: the prompt and one generated
    token, or the prompt and an explicit ``max_tokens`` (a default one stops at the context)."""
    field, given = call.prompt_field, call.max_tokens_field
    limit = call.options["max_tokens"] if given is not None else 1
    if prompt_tokens + limit <= context:
        return
    if given is None:
        verb = "have" if field == "messages" else "has"  # "your messages have", "your prompt has"
        asked = f"your {field} {verb} {prompt_tokens} tokens, and at least one token must be generated"
    else:
        asked = (f"you requested {prompt_tokens + limit} tokens ({prompt_tokens} in the {field}, {limit} in the "
                 f"completion)")
    raise APIError(f"This model's maximum context length is {context} tokens. However, {asked}. Please reduce "
                   f"the length of the {field}{f' or {given}' if given else ''}.", param=field,
                   code="context_length_exceeded")


def _response_format(fmt: dict) -> dict:
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"schema": {"type": "object"}}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"schema": schema}
    raise APIError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format")


def _call(kind: str, req: _Request, prompt: Prompt, options: dict, logprobs: int | None) -> Call:
    return Call(kind, req.model, prompt, options, stream=req.stream,
                include_usage=bool((req.stream_options or {}).get("include_usage")),
                return_token_ids=req.return_token_ids, logprobs=logprobs,
                priority=req.priority, deadline_ms=req.deadline_ms)


# --- responses ------------------------------------------------------------------------------


@dataclass
class Result:
    """What one call produced, whichever way it ran."""

    text: str
    token_ids: list[int]
    finish_reason: str  # the engine's: eos, stop, length
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cached_tokens: int | None = None

    @classmethod
    def from_record(cls, record: dict, prompt_token_ids: list[int]) -> Result:
        """From a ``generate(..., logprobs=k)`` value."""
        return cls(record["text"], list(record["token_ids"]), record["finish_reason"], list(prompt_token_ids),
                   record["logprobs"], record["top_logprobs"])


def usage(results: list[Result]) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(r.token_ids) for r in results)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if all(r.cached_tokens is not None for r in results):
        out["prompt_tokens_details"] = {"cached_tokens": sum(r.cached_tokens for r in results)}
    return out


def _completion_logprobs(result: Result, k: int, detok) -> dict:
    texts = [detok([t]) for t in result.token_ids]
    return {"tokens": texts, "token_logprobs": list(result.logprobs or ()),
            "top_logprobs": [{detok([t]): lp for t, lp in top.items()} for top in (result.top_logprobs or ())]
            if k else None,
            "text_offset": [sum(len(x) for x in texts[:i]) for i in range(len(texts))]}


def _chat_logprobs(result: Result, detok) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(result.token_ids, result.logprobs or ())):
        top = (result.top_logprobs or [{}] * len(result.token_ids))[i]
        token = detok([t])
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": detok([u]), "logprob": v, "bytes": list(detok([u]).encode())}
                                         for u, v in top.items()]})
    return {"content": content}


def completion_response(calls: list[Call], results: list[Result], detok) -> dict:
    out = []
    for call, r in zip(calls, results):
        choice = {"index": call.index, "text": r.text, "finish_reason": FINISH.get(r.finish_reason, r.finish_reason),
                  "logprobs": _completion_logprobs(r, call.logprobs, detok) if call.logprobs is not None else None}
        if call.return_token_ids:
            choice.update(token_ids=r.token_ids, prompt_token_ids=r.prompt_token_ids)
        out.append(choice)
    first = calls[0]
    return {"id": f"cmpl-{first.id}", "object": "text_completion", "created": first.created, "model": first.model,
            "choices": out, "usage": usage(results)}


def finish_reason(result: Result, called: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the answer is calls, unless cut by ``max_tokens``."""
    if called and result.finish_reason != "length":
        return "tool_calls"
    return FINISH.get(result.finish_reason, result.finish_reason)


def chat_response(calls: list[Call], results: list[Result], detok) -> dict:
    first = calls[0]
    return {"id": f"chatcmpl-{first.id}", "object": "chat.completion", "created": first.created,
            "model": first.model, "choices": [_chat_choice(c, r, detok) for c, r in zip(calls, results)],
            "usage": usage(results)}


def _chat_choice(call: Call, r: Result, detok) -> dict:
    message: dict = {"role": "assistant", "content": r.text}
    calls: list[ToolCall] = []
    if call.tools is not None:
        message["content"], calls = parse(call.tools, r.text)
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
    choice = {"index": call.index, "message": message, "finish_reason": finish_reason(r, bool(calls)),
              "logprobs": _chat_logprobs(r, detok) if call.logprobs is not None else None}
    if call.return_token_ids:
        choice.update(token_ids=r.token_ids, prompt_token_ids=r.prompt_token_ids)
    return choice


def chunk(call: Call, delta: str | dict | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
    """One server-sent event of a streamed response; a chat's ``delta`` may be a whole delta
    (a tool call's)."""
    finish = FINISH.get(finish_reason, finish_reason) if finish_reason else None
    if call.kind == "chat":
        if isinstance(delta, dict):
            message: dict = delta
        else:
            message = {"role": "assistant", "content": delta or ""} if first else ({"content": delta} if delta else {})
        return {"id": f"chatcmpl-{call.id}", "object": "chat.completion.chunk", "created": call.created,
                "model": call.model, "choices": [{"index": call.index, "delta": message, "finish_reason": finish,
                                                   "logprobs": None}]}
    return {"id": f"cmpl-{call.id}", "object": "text_completion", "created": call.created, "model": call.model,
            "choices": [{"index": call.index, "text": delta or "", "finish_reason": finish, "logprobs": None}]}


def usage_chunk(call: Call, results: list[Result]) -> dict:
    body = chunk(call, None)
    body["choices"] = []
    body["usage"] = usage(results)
    return body


def embedding_response(model: str, vectors, encoding_format: str = "float", prompt_tokens: int = 0) -> dict:
    def encoded(v):
        if encoding_format == "base64":  # what the openai client asks for by default
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        return [float(x) for x in v]

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


SERVED = ("llm", "embed")  # engine kinds a route serves: the LLM routes' and /v1/embeddings' (no reranking route)


def models_response(held: dict[str, list[str]]) -> dict:
    """``/v1/models``: what the routes serve, of what the workers hold (engine kind -> names)."""
    names = sorted({m for kind in SERVED for m in held.get(kind, ())})
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "daskllm"}
                                       for n in names]}
