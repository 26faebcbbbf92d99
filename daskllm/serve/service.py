"""What the server does with a request, independent of HTTP: a Dask client's view of serving.

A completion becomes ``daskllm.generate(prompt, model, ..., logprobs=k)`` (the record form
carries the tokens and finish reason a response needs) and goes through the
:class:`~daskllm.serve.consolidate.Consolidator` with every other request of its micro-batch;
a streamed one goes through the :class:`~daskllm.serve.relay.StreamRelay`. Either way the
prompt is the same token ids a batch run of the same builder would send, so greedy outputs
equal the batch run's.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

from daskllm import config
from daskllm.api import embed, generate
from daskllm.plan.items import prompt_calls
from daskllm.prompts import tokenizer_for, tokens
from daskllm.retrieval import ShardedIndex
from daskllm.runtime.view import take_view
from daskllm.serve.consolidate import Consolidator
from daskllm.serve.embeddings import Embedder, shortened
from daskllm.serve.openai_api import APIError, Call, PipelineRequest, Result, check_context
from daskllm.serve.relay import StreamRelay
from daskllm.serve.tools import ToolError, render

class Service:
    """Serving on ``client``'s cluster. ``consolidate``/``window``/``max_batch``: see
    :class:`Consolidator`; ``pipelines``: serve the reference pipelines (a source checkout's
    ``pipelines`` package) at ``/v1/pipelines/NAME``, searching ``pipelines_index`` (default: an
    index of the pipelines' passages, built on the first pipeline request)."""

    def __init__(self, client, *, consolidate: bool = True, window: float = 0.1, max_batch: int = 256,
                 pipelines: bool = False, pipelines_index: ShardedIndex | None = None,
                 plan_options: dict | None = None):
        self.client = client
        self.consolidator = Consolidator(client, enabled=consolidate, window=window, max_batch=max_batch,
                                         plan_options=plan_options)
        self.relay: StreamRelay | None = None
        self.pipelines = _pipeline_registry() if pipelines else {}
        self._pipelines_index = pipelines_index
        self._inputs = None  # the pipelines' index and default contexts, made on first use
        self._inputs_lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin serving on ``loop`` (the HTTP server's event loop)."""
        self.relay = StreamRelay(self.client, loop)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self.consolidator.close()

    # --- models -------------------------------------------------------------------------------

    def held(self, *, fresh: bool = False) -> dict[str, list[str]]:
        """engine kind -> model names the cluster's workers hold (the planner's cluster view,
        reused for a few seconds: :func:`~daskllm.runtime.view.take_view`)."""
        return {kind: sorted(models) for kind, models in take_view(self.client, fresh=fresh).held().items()}

    def check_model(self, model: str, kind: str = "llm") -> None:
        names = self.held().get(kind, [])
        if model not in names:  # a worker may just have joined: look again before answering 404
            names = self.held(fresh=True).get(kind, [])
        if model not in names:
            raise APIError(f"The model `{model}` does not exist: this server's workers hold {names or 'none'}"
                           f" ({kind})", status=404, param="model", code="model_not_found")

    # --- completions --------------------------------------------------------------------------

    def node(self, call: Call):
        """The daskllm call of a request (a bad option is an APIError naming it)."""
        if call.prompt is None:  # a chat with tools: rendered once (the node is built again once its limit is set)
            call.prompt = self.tool_prompt(call)
        try:
            return generate(call.prompt, model=call.model, **call.options, logprobs=call.logprobs or 0)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc)) from None

    @staticmethod
    def tool_prompt(call: Call):
        """A chat with tools, rendered by the model's template (transformers' ``tools=``) into the
        token ids the template's text has, as a chat without tools gets."""
        tokenizer = tokenizer_for(call.model)
        try:
            text = render(tokenizer.tokenizer, call.messages, call.tools)
        except ToolError as exc:
            raise APIError(str(exc), param=exc.param) from None
        except Exception as exc:  # noqa: BLE001 - a template's own error (jinja) names what it needs
            raise APIError(f"messages: the chat template cannot render them: {exc}", param="messages") from None
        return tokens(tokenizer.encode(text, False), call.model)

    def prompt_ids(self, call: Call, node) -> list[int]:
        """The prompt's token ids, refused (``context_length_exceeded``) if the model's context
        cannot hold them: here, rather than by the engine, whose refusal would be a failed task."""
        (prompt,) = prompt_calls(node)
        if not prompt.static:
            raise APIError("prompt: text that is not valid Unicode", param="prompt")
        ids = list(prompt.parts[0])
        context = take_view(self.client).context(call.model)
        if context is None:  # not reported yet (a worker that just loaded it), or an engine without one
            context = take_view(self.client, fresh=True).context(call.model)
        if context is not None:
            check_context(call, len(ids), context)
            if call.fill_context:  # no limit set: what the context leaves after the prompt, as vLLM gives
                call.options["max_tokens"] = context - len(ids)
        return ids

    async def complete(self, calls: list[Call]) -> list[Result]:
        for call in calls:
            self.check_model(call.model)
        nodes = [self.node(c) for c in calls]
        ids = [self.prompt_ids(c, n) for c, n in zip(calls, nodes)]
        nodes = [self.node(c) if c.fill_context else n for c, n in zip(calls, nodes)]  # their limit now set
        records = await asyncio.gather(*(self.consolidator.run(n, priority=c.priority, deadline_ms=c.deadline_ms)
                                         for n, c in zip(nodes, calls)))
        return [Result.from_record(r, i) for r, i in zip(records, ids)]

    async def stream(self, call: Call) -> AsyncIterator[str | Result]:
        """Text deltas, then the :class:`Result`."""
        self.check_model(call.model)
        node = self.node(call)
        ids = self.prompt_ids(call, node)
        node = self.node(call) if call.fill_context else node  # its limit now set
        order = self.consolidator.order_key(call.priority, call.deadline_ms, time.monotonic())
        key = f"{call.id}-{call.index}"  # a choice's own stream
        async for item in self.relay.stream(key, call.model, ids, node.params["sampling"], -order):
            if isinstance(item, dict):
                yield Result(item["text"], item["token_ids"], item["finish_reason"], item["prompt_token_ids"],
                             item["logprobs"], item["top_logprobs"], item["cached_tokens"])
            else:
                yield item

    def detokenize(self, model: str):
        tokenizer = tokenizer_for(model).tokenizer
        return lambda ids: tokenizer.decode(ids)

    # --- embeddings and pipelines -------------------------------------------------------------

    async def embed(self, model: str, inputs: list[str | list[int]], dimensions: int | None = None
                    ) -> tuple[list[np.ndarray], int]:
        """The vectors of texts or token ids (``dimensions`` long where given), and the tokens embedded."""
        self.check_model(model, "embed")
        embedder = Embedder.of(model)
        texts = embedder.texts(inputs)
        vectors = list(await self.consolidator.run(embed(texts, model=model)))
        embedder.check(dimensions, len(vectors[0]))
        return shortened(vectors, dimensions), embedder.tokens(texts)

    async def pipeline(self, name: str, req: PipelineRequest):
        if name not in self.pipelines:
            raise APIError(f"no pipeline {name!r}; this server runs {sorted(self.pipelines) or 'none'}"
                           + ("" if self.pipelines else " (start it with --pipelines, from a source checkout)"),
                           status=404, param="name")
        model = req.model or config.get("model")
        self.check_model(model)
        inputs = await asyncio.get_running_loop().run_in_executor(None, self._pipeline_inputs, req)
        try:
            node = self.pipelines[name](inputs, model=model, max_tokens=req.max_tokens)
        except (ValueError, TypeError) as exc:
            raise APIError(f"pipeline {name!r}: {exc}") from None
        (answer,) = await self.consolidator.run(node, priority=req.priority, deadline_ms=req.deadline_ms)
        return _plain(answer)

    def _pipeline_inputs(self, req: PipelineRequest):
        from pipelines.data import Inputs, contexts, passages  # a source checkout's package, not daskllm's

        with self._inputs_lock:
            if self._inputs is None:
                index = self._pipelines_index or ShardedIndex.from_texts(self.client, "daskllm-serve-passages",
                                                                          passages())
                self._inputs = (index, contexts(1)[0])
        index, default_context = self._inputs
        return Inputs([req.question], index, [req.contexts or default_context])


def _pipeline_registry() -> dict:
    try:
        registry = importlib.import_module("pipelines").registry
    except ImportError as exc:
        raise RuntimeError("--pipelines needs the reference pipelines (`pipelines/` of a daskllm source "
                           f"checkout) importable: {exc}") from None
    return registry()


def _plain(value):
    """A pipeline's answer as JSON: lists and dicts as they are, anything else as text."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)
