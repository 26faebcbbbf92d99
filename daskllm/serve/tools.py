"""Tool calls, as vLLM and SGLang serve them: the prompt, the constraint and the parser.

A request with ``tools`` is rendered with the model's chat template given those tools
(transformers' ``apply_chat_template(tools=...)``); a template that cannot show tools (it never
reads ``tools``) gets the Hermes layout on ChatML, which SmolLM2 and Qwen were tuned on:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``. Then ``tool_choice`` decides:

- ``none``: the tools are left out of the prompt, and the output is text (the request is the
  same as one without tools);
- ``auto``: the model chooses; its output is parsed for calls, in the Hermes layout or as
  Llama 3's bare JSON (``{"name": ..., "parameters": ...}``);
- a named function: decoding is constrained to the function's parameters schema (no
  properties beyond those it names, unless it says otherwise), and the output is that call's
  arguments;
- ``required``: decoding is constrained to a JSON list of calls (vLLM's layout:
  ``[{"name": ..., "parameters": {...}}]``); with one tool, to that tool's arguments, as named.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

# Hermes tool calls on ChatML (Qwen2.5's layout), for a ChatML template that cannot show tools.
HERMES_CHATML = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    + '\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' + ('\\n' + message.content if message.content else '') }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson)
    + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# The compact layout of a required list of calls: fewer tokens than json.dumps's spaces.
_COMPACT = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}


class ToolError(ValueError):
    """A bad ``tools``/``tool_choice``/message field: ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools and how it must use them."""

    functions: dict[str, dict]  # name -> {"name", "description", "parameters"}
    choice: str  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def forced(self) -> str | None:
        """The one function the output is the arguments of (named, or required with one tool)."""
        if self.choice == "named":
            return self.named
        if self.choice == "required" and len(self.functions) == 1:
            return next(iter(self.functions))
        return None

    def schema(self) -> dict | None:
        """The JSON schema decoding is constrained to (None: free text)."""
        if self.forced is not None:
            return _parameters(self.functions[self.forced])
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in self.functions.items()]
        schema = {"x-guidance": _COMPACT, "type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _parameters(function: dict) -> dict:
    """The schema of a function's arguments. An object schema that does not say otherwise gets
    no properties beyond those it names (OpenAI's strict mode): a small model given the freedom
    pads the arguments with keys until ``max_tokens``."""
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": False}
    return schema


def tools_of(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> Tools | None:
    """The request's :class:`Tools` (None without tools); a bad field is a :class:`ToolError`."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ToolError("tool_choice: needs `tools`", "tool_choice")
    if not tools:
        return None
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name: a name of letters, digits, _, . or -, got {name!r}", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[name] = function
    choice, named = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in functions:
            raise ToolError(f"tool_choice: names function {named!r}; the tools are {sorted(functions)}",
                            "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                        "tool_choice")
    return Tools(functions, choice, named, parallel_tool_calls is not False)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: a call's arguments as a dict (what
    templates serialize with ``tojson``), a tool result's text as its content."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = []
        for j, call in enumerate(m.get("tool_calls") or ()):
            function = call.get("function") or {}
            arguments = function.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError as exc:
                raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON ({exc})",
                                "messages") from None
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function.get("name"), "arguments": arguments}})
        if calls:
            m["tool_calls"] = calls
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def render(tokenizer, messages: list[dict], tools: Tools | None) -> str:
    """The prompt text: the chat template given the tools (none with ``tool_choice: none``)."""
    shown = [{"type": "function", "function": f} for f in tools.functions.values()] \
        if tools is not None and tools.choice != "none" else None
    template = tokenizer.chat_template
    if not (isinstance(template, str) and "tools" in template and "tool_calls" in template):
        if "<|im_start|>" not in tokenizer.get_vocab():
            raise ToolError("tools: this model's chat template cannot show tools or tool calls, and it is not "
                            "ChatML (where daskllm would use the Hermes layout)", "tools")
        template = HERMES_CHATML
    return tokenizer.apply_chat_template(template_messages(messages), tools=shown, chat_template=template,
                                         tokenize=False, add_generation_prompt=True)


# --- output -----------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def parse(tools: Tools, text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a model's output. Text that is not a well-formed call to one of
    the request's functions stays content: a request is never failed for what the model said."""
    if tools.forced is not None:
        return None, [ToolCall(tools.forced, text)]
    if tools.choice == "required":
        try:
            return None, [ToolCall(c["name"], _json(c["parameters"])) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):  # cut by max_tokens
            return text, []
    if tools.choice == "none":
        return text, []
    start = text.find("<tool_call>")
    if start >= 0:  # Hermes: content, then one <tool_call> block per call
        calls = [_call(tools, body) for body in _HERMES.findall(text[start:])]
        if calls and all(calls):
            return text[:start] or None, calls
        return text, []
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls = []
    while body.startswith("{"):  # Llama 3: bare JSON objects, `;`-separated
        try:
            value, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        calls.append(_call(tools, value))
        body = body[end:].strip().removeprefix(";").strip()
    if calls and all(calls) and not body:
        return None, calls
    return text, []


_DECODER = json.JSONDecoder()


def _call(tools: Tools, value) -> ToolCall | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or value.get("name") not in tools.functions:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else _json(arguments))


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolStream:
    """A streamed tool request's deltas: a forced call's arguments as they come, content while
    it cannot be the start of a call, and parsed calls once the output is whole."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of content (or forced arguments) already streamed
        self.called = False
        self._forced = ToolCall(tools.forced, "") if tools.forced is not None else None

    def feed(self, delta: str) -> Iterator[dict]:
        self.text += delta
        if self._forced is not None:
            yield self._arguments(delta)
        elif self.tools.choice in ("auto", "none"):
            safe = self._safe()
            if safe > self.sent:
                yield {"content": self.text[self.sent:safe]}
                self.sent = safe

    def finish(self) -> Iterator[dict]:
        if self._forced is not None:
            self.called = True
            return
        content, calls = parse(self.tools, self.text)
        rest = (content or "")[self.sent:]
        if rest:
            yield {"content": rest}
        if calls:
            self.called = True
            yield {"tool_calls": [c.as_dict(i) for i, c in enumerate(calls)]}

    def _arguments(self, delta: str) -> dict:
        if self.sent == 0 and not self.called:
            self.called = True
            first = self._forced.as_dict(0)
            first["function"]["arguments"] = delta
            return {"tool_calls": [first]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}

    def _safe(self) -> int:
        """How much of the text so far is content whatever follows."""
        if self.tools.choice == "none":
            return len(self.text)
        lead = self.text.lstrip()
        if any(p.startswith(lead) or lead.startswith(p) for p in ("{", _PYTHON_TAG)):
            return 0  # it may be a bare JSON call: wait for the whole output
        start = self.text.find("<tool_call>")
        if start >= 0:
            return start
        for k in range(min(len(self.text), len("<tool_call>")), 0, -1):  # a tag may be arriving
            if "<tool_call>".startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)
