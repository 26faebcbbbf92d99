"""The HTTP face of a :class:`~daskllm.serve.service.Service`: OpenAI's routes on FastAPI.

Errors are OpenAI's error bodies with the status a client library expects (400 for a bad
field, naming it; 401 without the API key; 404 for a model no worker holds). A streamed
response is server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``; a
request that fails before its first token gets an error status, not a broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from daskllm.serve import openai_api as api
from daskllm.serve.openai_api import APIError
from daskllm.serve.service import Service

logger = logging.getLogger(__name__)


def create_app(service: Service, *, api_key: str | None = None) -> FastAPI:
    """The app; with ``api_key``, every route but ``/health`` needs ``Authorization: Bearer KEY``."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        service.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="daskllm", lifespan=lifespan)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided", status=401, type="authentication_error",
                           code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(APIError(f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                                     param=where or None).body(), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        held = await asyncio.to_thread(service.held)
        return api.models_response(sorted({m for names in held.values() for m in names}))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(req: api.CompletionRequest):
        calls = api.completion_calls(req, default_max_tokens=16)
        if req.stream:
            if len(calls) != 1:
                raise APIError("stream: one prompt per streamed request", param="prompt")
            return await _streamed(service, calls[0])
        results = await _answered(service.complete(calls))
        return api.completion_response(calls, results, service.detokenize(req.model))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(req: api.ChatRequest):
        call = api.chat_call(req)
        if req.stream:
            return await _streamed(service, call)
        (result,) = await _answered(service.complete([call]))
        return api.chat_response(call, result, service.detokenize(req.model))

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    async def embeddings(req: api.EmbeddingRequest):
        texts = [req.input] if isinstance(req.input, str) else req.input
        vectors = await _answered(service.embed(req.model, texts))
        return api.embedding_response(req.model, vectors, req.encoding_format)

    @app.get("/v1/pipelines", dependencies=[Depends(authorized)])
    async def pipelines():
        return {"object": "list", "data": [{"id": name, "object": "pipeline"} for name in sorted(service.pipelines)]}

    @app.post("/v1/pipelines/{name}", dependencies=[Depends(authorized)])
    async def pipeline(name: str, req: api.PipelineRequest):
        answer = await _answered(service.pipeline(name, req))
        return {"object": "pipeline.result", "pipeline": name, "answer": answer}

    @app.get("/v1/stats", dependencies=[Depends(authorized)])
    async def stats():
        return {"consolidation": service.consolidator.stats.as_dict()}

    return app


async def _answered(awaitable):
    """The awaited value; a call's own failure (a prompt too long, bad text) is a 400 naming it."""
    try:
        return await awaitable
    except APIError:
        raise
    except (ValueError, TypeError, LookupError) as exc:
        raise APIError(str(exc)) from None
    except Exception as exc:
        logger.exception("request failed")
        raise APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error") from None


async def _streamed(service: Service, call: api.Call) -> StreamingResponse:
    items = service.stream(call)
    # The first item before the response starts: a request that cannot run is an error status.
    first = await _answered(anext(items))

    async def events():
        if call.kind == "chat":  # OpenAI's first chat chunk names the role
            yield _event(api.chunk(call, None, first=True))
        result, item = None, first
        try:
            while True:
                if isinstance(item, api.Result):
                    result = item
                    break
                yield _event(api.chunk(call, item))
                item = await anext(items)
        except Exception as exc:  # noqa: BLE001 - after the headers went out, an error is an event
            yield _event(APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error").body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await items.aclose()
        yield _event(api.chunk(call, None, result.finish_reason))
        if call.include_usage:
            yield _event(api.usage_chunk(call, result))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
