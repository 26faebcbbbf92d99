"""The HTTP face of a :class:`~daskllm.serve.service.Service`: OpenAI's routes on FastAPI.

Errors are OpenAI's error bodies with the status a client library expects (400 for a bad
field, naming it; 401 without the API key; 404 for a model no worker holds). A streamed
response is server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``; a
request that fails before its first token gets an error status, not a broken stream. A
client that disconnects cancels its request, whole or streamed (as vLLM's
``with_cancellation``): its engine requests are dropped rather than finished for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from daskllm.serve import openai_api as api
from daskllm.serve.access_log import CLIENT_CLOSED, AccessLog, note
from daskllm.serve.openai_api import APIError
from daskllm.serve.service import Service
from daskllm.serve.tools import ToolStream

logger = logging.getLogger(__name__)


def create_app(service: Service, *, api_key: str | None = None, access_log: bool = True) -> FastAPI:
    """The app; with ``api_key``, every route but ``/health`` needs ``Authorization: Bearer KEY``;
    ``access_log``: a line per request on the ``daskllm.serve.access`` logger."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        service.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="daskllm", lifespan=lifespan)
    if access_log:
        app.add_middleware(AccessLog)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided", status=401, type="authentication_error",
                           code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        note(request, error=str(exc))
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # no such route, wrong method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        note(request, error=str(exc.detail))
        return JSONResponse(APIError(str(exc.detail), status=exc.status_code, type=kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        held = await asyncio.to_thread(service.held)
        return api.models_response(sorted({m for names in held.values() for m in names}))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    @with_cancellation
    async def completions(req: api.CompletionRequest, request: Request):
        note(request, model=req.model)
        calls = api.completion_calls(req, default_max_tokens=16)
        if req.stream:
            if len(calls) != 1:
                raise APIError("stream: one prompt per streamed request", param="prompt")
            return await _streamed(service, calls[0], request)
        results = await _answered(service.complete(calls))
        note(request, usage=api.usage(results))
        return api.completion_response(calls, results, service.detokenize(req.model))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    @with_cancellation
    async def chat_completions(req: api.ChatRequest, request: Request):
        note(request, model=req.model)
        call = api.chat_call(req)
        if req.stream:
            return await _streamed(service, call, request)
        (result,) = await _answered(service.complete([call]))
        note(request, usage=api.usage([result]))
        return api.chat_response(call, result, service.detokenize(req.model))

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    @with_cancellation
    async def embeddings(req: api.EmbeddingRequest, request: Request):
        note(request, model=req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        vectors = await _answered(service.embed(req.model, texts))
        return api.embedding_response(req.model, vectors, req.encoding_format)

    @app.get("/v1/pipelines", dependencies=[Depends(authorized)])
    async def pipelines():
        return {"object": "list", "data": [{"id": name, "object": "pipeline"} for name in sorted(service.pipelines)]}

    @app.post("/v1/pipelines/{name}", dependencies=[Depends(authorized)])
    @with_cancellation
    async def pipeline(name: str, req: api.PipelineRequest, request: Request):
        answer = await _answered(service.pipeline(name, req))
        return {"object": "pipeline.result", "pipeline": name, "answer": answer}

    @app.get("/v1/stats", dependencies=[Depends(authorized)])
    async def stats():
        return {"consolidation": service.consolidator.stats.as_dict()}

    return app


def with_cancellation(handler):
    """Run ``handler`` until it answers or its client disconnects, whichever comes first; a
    disconnect cancels it, and with it the request's work (vLLM's ``with_cancellation``).
    Starlette notices a disconnect only while it streams; FastAPI has read the body by now, so
    the next ASGI message is the disconnect."""

    @functools.wraps(handler)
    async def wrapper(*args, request: Request, **kwargs):
        answer = asyncio.ensure_future(handler(*args, request=request, **kwargs))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([answer, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:  # this task cancelled (server shutdown) cancels both too
            gone.cancel()
            answer.cancel()
        if not answer.done() or answer.cancelled():
            note(request, disconnected=True)
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        return answer.result()

    return wrapper


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request FastAPI could not read, as OpenAI's 400: the field it names,
    or, for a body that is not JSON, where (line and column) and what the parser expected."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        position = next((p for p in first.get("loc", ()) if isinstance(p, int)), 0)
        body = exc.body if isinstance(exc.body, str) else (exc.body or b"").decode("utf-8", "replace") \
            if isinstance(exc.body, bytes) else ""
        line = body.count("\n", 0, position) + 1
        column = position - (body.rfind("\n", 0, position) + 1) + 1
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "JSON decode error")
        return APIError(f"the body is not valid JSON: {reason} at line {line} column {column} (char {position})")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return APIError(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)


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


async def _streamed(service: Service, call: api.Call, request: Request) -> StreamingResponse:
    items = service.stream(call)
    # The first item before the response starts: a request that cannot run is an error status.
    first = await _answered(anext(items))
    tools = ToolStream(call.tools) if call.tools is not None else None

    async def events():
        if call.kind == "chat":  # OpenAI's first chat chunk names the role
            yield _event(api.chunk(call, None, first=True))
        result, item = None, first
        try:
            while True:
                if isinstance(item, api.Result):
                    result = item
                    break
                for delta in (tools.feed(item) if tools is not None else [item]):
                    yield _event(api.chunk(call, delta))
                item = await anext(items)
            for delta in (tools.finish() if tools is not None else ()):
                yield _event(api.chunk(call, delta))
        except Exception as exc:  # noqa: BLE001 - after the headers went out, an error is an event
            logger.exception("streamed request failed")
            note(request, error=f"{type(exc).__name__}: {exc}")
            yield _event(APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error").body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await items.aclose()
        note(request, usage=api.usage([result]))
        yield _event(api.chunk(call, None, api.finish_reason(result, tools is not None and tools.called)))
        if call.include_usage:
            yield _event(api.usage_chunk(call, result))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
