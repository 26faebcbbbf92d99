"""The access log: a line per request on the ``daskllm.serve.access`` logger, as uvicorn's and
vLLM's, with what an operator of an LLM server asks first: which model, how many tokens, how
long, and the request's id (also sent back as ``x-request-id``, or taken from the client's).

A pure ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``, which would stand
between the app and the client's disconnect message that cancellation listens for.
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.requests import Request

logger = logging.getLogger("daskllm.serve.access")

_KEY = "daskllm.access"  # the scope entry handlers add what they learn to (see note)
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before the answer


def note(request: Request, **fields) -> None:
    """Record ``fields`` (model, usage, error, disconnected) for this request's log line."""
    entry = request.scope.get(_KEY)
    if entry is not None:
        entry.update(fields)


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        request_id = given[:64] or uuid.uuid4().hex
        entry: dict = {"status": 500}
        scope[_KEY] = entry

        logged = False

        def log() -> None:
            nonlocal logged
            if not logged:
                logged = True
                _log(scope, entry, request_id, time.perf_counter() - start)

        async def sending(message):
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                log()  # before the last byte goes out: a client that has its answer finds it logged
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log()  # no answer sent (an error, a client gone)


def _log(scope, entry: dict, request_id: str, seconds: float) -> None:
    client = scope.get("client")
    status = CLIENT_CLOSED if entry.get("disconnected") else entry["status"]
    parts = [f'{client[0]}:{client[1]}' if client else "-",
             f'"{scope["method"]} {scope["path"]} HTTP/{scope.get("http_version", "1.1")}"', str(status)]
    if "model" in entry:
        parts.append(f"model={entry['model']}")
    if usage := entry.get("usage"):
        parts.append(f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}")
    parts += [f"latency={seconds:.3f}s", f"id={request_id}"]
    if error := entry.get("error"):
        parts.append(f"error={error!r}")
    logger.log(logging.WARNING if status >= 500 else logging.INFO, " ".join(parts))
