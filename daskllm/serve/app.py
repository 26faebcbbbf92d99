"""The HTTP face of a :class:`~daskllm.serve.service.Service`: OpenAI's routes on FastAPI.

Errors are OpenAI's error bodies with the status a client library expects (400 for a bad
field, naming it; 401 without the API key; 404 for a model no worker holds or a route that
does not exist). A streamed response is server-sent events, ``data: {chunk}`` lines ending
with ``data: [DONE]`` (the Responses API's: ``event: TYPE`` lines too, and no ``[DONE]``); a
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
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from daskllm.serve import openai_api as api
from daskllm.serve import responses_api
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
        return await api_error(request, _validation_error(exc, request.headers.get("content-type")))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # no such route, wrong method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code in (404, 405):
            routes = sorted({r.path for r in app.routes if r.path.startswith("/v1/")})
            message += f"; this server's routes: {', '.join(routes)}"
        note(request, error=message)
        return JSONResponse(APIError(message, status=exc.status_code, type=kind).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return api.models_response(await asyncio.to_thread(service.held))

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    @with_cancellation
    async def completions(req: api.CompletionRequest, request: Request):
        note(request, model=req.model)
        return await _completed(service, api.completion_calls(req), request, api.completion_response)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    @with_cancellation
    async def chat_completions(req: api.ChatRequest, request: Request):
        note(request, model=req.model)
        return await _completed(service, api.chat_calls(req), request, api.chat_response)

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    @with_cancellation
    async def responses(req: responses_api.ResponsesRequest, request: Request):
        note(request, model=req.model)
        call = responses_api.call(req)
        if req.stream:
            return await _streamed_response(service, req, call, request)
        (result,) = await _answered(service.complete([call]))
        note(request, usage=api.usage([result]))
        return responses_api.body(req, call, result)

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    @with_cancellation
    async def embeddings(req: api.EmbeddingRequest, request: Request):
        note(request, model=req.model)
        vectors, tokens = await _answered(service.embed(req.model, req.inputs(), req.dimensions))
        return api.embedding_response(req.model, vectors, req.encoding_format, tokens)

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


def _validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """The first problem of a request FastAPI could not read, as OpenAI's 400: the field it names;
    for a body that is not JSON, where (line and column) and what the parser expected; for a
    body sent as another media type (FastAPI reads only JSON as JSON), that type."""
    first = exc.errors()[0] if exc.errors() else {}
    media = (content_type or "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json") and tuple(first.get("loc", ())) == ("body",):
        return APIError(f"the body must be JSON sent with Content-Type: application/json; this request's "
                        f"Content-Type is {content_type}")
    if first.get("type") == "json_invalid":
        position = next((p for p in first.get("loc", ()) if isinstance(p, int)), 0)
        body = exc.body if isinstance(exc.body, str) else (exc.body or b"").decode("utf-8", "replace") \
            if isinstance(exc.body, bytes) else ""
        line = body.count("\n", 0, position) + 1
        column = position - (body.rfind("\n", 0, position) + 1) + 1
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "JSON decode error")
        return APIError(f"the body is not valid JSON: {reason} at line {line} column {column} (char {position})")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    # A validator's own message (ValueError) as it is, without pydantic's "Value error, " before it
    reason = (first.get("ctx") or {}).get("error") if first.get("type") == "value_error" else None
    return APIError(f"{where or 'body'}: {reason or first.get('msg', 'invalid request')}", param=where or None)


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


async def _completed(service: Service, calls: list[api.Call], request: Request, respond):
    """A completions or chat request's answer: streamed, or ``respond(calls, results, detokenize)``."""
    if calls[0].stream:
        return await _streamed(service, calls, request)
    results = await _answered(service.complete(calls))
    note(request, usage=api.usage(results))
    return respond(calls, results, service.detokenize(calls[0].model))


async def _opened(service: Service, calls: list[api.Call]) -> list[AsyncIterator]:
    """Each call's stream, its first item already read: a request that cannot run is an error
    status (the response has not started), and the streams opened for it are closed."""
    streams = [service.stream(c) for c in calls]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await _answered(asyncio.gather(*firsts))
    except BaseException:
        for first in firsts:
            first.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    return [_after(first.result(), s) for first, s in zip(firsts, streams)]


async def _after(first, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from all ``streams`` as their items come; a stream's error is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - raised to the reader below
            await queue.put((i, exc))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (got := await queue.get())[1] is not done:
                if isinstance(got[1], Exception):
                    raise got[1]
                yield got
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _streamed(service: Service, calls: list[api.Call], request: Request) -> StreamingResponse:
    """Chat or completion chunks of every choice (``index`` says whose), as they decode."""
    streams = await _opened(service, calls)
    tools = [ToolStream(c.tools) if c.tools is not None else None for c in calls]

    async def events():
        results: list[api.Result | None] = [None] * len(calls)
        for call in calls:
            if call.kind == "chat":  # OpenAI's first chat chunk of a choice names the role
                yield _event(api.chunk(call, None, first=True))
        try:
            async for i, item in _merged(streams):
                call, tool = calls[i], tools[i]
                if isinstance(item, api.Result):
                    results[i] = item
                    for delta in (tool.finish() if tool is not None else ()):
                        yield _event(api.chunk(call, delta))
                    yield _event(api.chunk(call, None, api.finish_reason(item, tool is not None and tool.called)))
                    continue
                for delta in (tool.feed(item) if tool is not None else [item]):
                    yield _event(api.chunk(call, delta))
        except Exception as exc:  # noqa: BLE001 - after the headers went out, an error is an event
            logger.exception("streamed request failed")
            note(request, error=f"{type(exc).__name__}: {exc}")
            yield _event(APIError(f"{type(exc).__name__}: {exc}", status=500, type="server_error").body())
            yield "data: [DONE]\n\n"
            return
        note(request, usage=api.usage(results))
        if calls[0].include_usage:
            yield _event(api.usage_chunk(calls[0], results))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _streamed_response(service: Service, req: responses_api.ResponsesRequest, call: api.Call,
                             request: Request) -> StreamingResponse:
    """A Responses API stream: its typed events around the text and the calls' arguments."""
    (stream,) = await _opened(service, [call])
    events_of = responses_api.Events(req, call)

    async def events():
        for event in events_of.start():
            yield _event(event, named=True)
        try:
            async for item in stream:
                if isinstance(item, api.Result):
                    note(request, usage=api.usage([item]))
                    for event in events_of.finish(item):
                        yield _event(event, named=True)
                else:
                    for event in events_of.delta(item):
                        yield _event(event, named=True)
        except Exception as exc:  # noqa: BLE001 - after the headers went out, an error is an event
            logger.exception("streamed request failed")
            note(request, error=f"{type(exc).__name__}: {exc}")
            yield _event(events_of.failed(f"{type(exc).__name__}: {exc}"), named=True)

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(body: dict, *, named: bool = False) -> str:
    """A server-sent event; ``named``: with its ``event:`` line (the Responses API's)."""
    data = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
    return f"event: {body['type']}\n{data}" if named else data
