"""The remote engine: the Engine protocol over an OpenAI-compatible endpoint.

A worker can hold a model that runs elsewhere: a hosted API, a vLLM server or another
``daskllm serve``. The planner still tokenizes prompts with the model's tokenizer, so the
spec's ``model`` names the same model the endpoint serves, and only its tokenizer is loaded
here, never its weights.

Requests go to ``/v1/completions`` through the official ``openai`` client, as token ids
(what the planner gives) or text. All remote engines of a process share one event-loop
thread, so any number of requests are in flight at once, and per endpoint (``base_url``)
one concurrency limit and one rate limit, whichever engine sends. A request that fails on
a connection error, a 429 or a 5xx is retried with exponential backoff, then sent to the
fallback model if there is one; a 4xx fails that request alone with a RequestError.

Prefix caching is the server's: ``prefill`` sends the prefix for one token so the server
caches it, and the handle claims no blocks of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import openai

from daskllm import config, models
from daskllm.engines.lifecycle import close_at_exit
from daskllm.engines.protocol import (
    BatchingEngine,
    CacheState,
    Completion,
    EngineClosed,
    EngineStats,
    PrefillHandle,
    Prompt,
    RequestError,
    SamplingParams,
    TokenCallback,
    check_params,
    encode_prompt,
)

logger = logging.getLogger(__name__)
_request_ids = itertools.count()

# --- what a request sends, and what its answer means -------------------------------------

STRUCTURED_FIELDS = {"json_schema": "json", "choice": "choice", "regex": "regex"}


def request_body(prompt: str | list[int], params: SamplingParams, model: str, *, priority: int = 0,
                 extensions: bool = True) -> dict:
    """Keyword arguments of ``client.completions.create`` for one request. Fields OpenAI's API
    lacks go in ``extra_body`` with vLLM's names; without ``extensions`` (an endpoint that
    refuses unknown fields) none are sent, and a request that needs one is refused here."""
    body: dict = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens,
                  "temperature": params.temperature, "top_p": params.top_p}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if not extensions:
        check_plain(params)
        if params.allowed_token_ids:
            # OpenAI's spelling of "only these tokens": a +100 bias
            body["logit_bias"] = {str(t): 100 for t in params.allowed_token_ids}
        return body
    extra: dict = {"return_token_ids": True}
    if params.ignore_eos:
        extra["ignore_eos"] = True
    if params.allowed_token_ids:
        extra["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.structured is not None:
        extra["structured_outputs"] = {STRUCTURED_FIELDS[params.structured.kind]: params.structured.value}
    if priority:
        extra["priority"] = priority
    body["extra_body"] = extra
    return body


def check_plain(params: SamplingParams) -> None:
    """Refuse what a plain OpenAI endpoint (no extensions) cannot do."""
    for name, needed in (("ignore_eos", params.ignore_eos), ("structured", params.structured is not None)):
        if needed:
            raise RequestError(f"{name}: this endpoint is used without extensions (option extensions=False)")


_MISSING = object()


def finish_reason(reason: str | None, params: SamplingParams, token_ids: Sequence[int], eos_ids: frozenset[int],
                  stop_reason: object = _MISSING) -> str:
    """An OpenAI finish reason in the protocol's terms: length, stop (a stop string) or eos.

    OpenAI says "stop" for both a stop string and the end of sequence. vLLM's ``stop_reason``
    tells them apart (a string: the stop string); without it, a request with no stop strings
    ended at EOS, and one with some ended at EOS if its last token is one. Other reasons
    (``content_filter``) pass through."""
    if reason == "length":
        return "length"
    if reason != "stop":
        return str(reason)
    if stop_reason is not _MISSING:
        return "stop" if isinstance(stop_reason, str) else "eos"
    if not params.stop or (token_ids and token_ids[-1] in eos_ids):
        return "eos"
    return "stop"


# --- retries and limits -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how late a failed attempt is tried again."""

    max_retries: int = 3
    base_delay: float = 0.5
    max_delay: float = 30.0

    def __post_init__(self):
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {self.max_retries!r}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ValueError(f"retry delays must satisfy 0 <= base ({self.base_delay}) <= max ({self.max_delay})")

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds before retry number ``retry`` (0: the first): doubling from ``base_delay``,
        at least what the server asked for (Retry-After), at most ``max_delay``."""
        return min(self.max_delay, max(self.base_delay * 2 ** retry, retry_after or 0.0))


def retryable(exc: BaseException) -> bool:
    """A failure another attempt may not have: no connection, a timeout, 408, 429 or 5xx.
    Other 4xx are the request's own fault and fail it at once."""
    if isinstance(exc, openai.APIConnectionError):  # includes timeouts
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 429) or exc.status_code >= 500
    return False


def retry_after(exc: BaseException) -> float | None:
    """The seconds a 429 or 503 response asked the client to wait (Retry-After), if any."""
    response = getattr(exc, "response", None)
    try:
        return float(response.headers["retry-after"]) if response is not None else None
    except (KeyError, ValueError):  # absent, or an HTTP date: the backoff decides
        return None


def describe(exc: BaseException) -> str:
    """What went wrong, in the server's words where it gave some."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        return f"HTTP {exc.status_code}: {body.get('message') or exc.message}"
    return f"{type(exc).__name__}: {exc}"


class TokenBucket:
    """At most ``rate`` requests a second on average, in bursts of at most ``burst``.

    ``reserve`` takes a token at once, going into debt when there is none, and says how
    long to wait before using it: waiting requests are served in the order they came."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate_limit must be a positive number of requests per second, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(1.0, self.rate)
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take one token; the seconds until it may be used (0: now)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate) - 1
            self._stamp = now
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class Endpoint:
    """One base URL's limits, shared by every engine of this process that sends there."""

    def __init__(self, base_url: str, max_concurrency: int, rate_limit: float | None):
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
        self.base_url, self.max_concurrency, self.rate_limit = base_url, max_concurrency, rate_limit
        self.slots = asyncio.Semaphore(max_concurrency)  # used on the shared loop only
        self.bucket = TokenBucket(rate_limit) if rate_limit else None

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the endpoint's concurrent requests, started no faster than its rate."""
        async with self.slots:
            # Rate after the slot: a request that waited for a slot must not start in a burst.
            if self.bucket is not None and (wait := self.bucket.reserve()) > 0:
                await asyncio.sleep(wait)
            yield


_endpoints: dict[str, Endpoint] = {}
_endpoints_lock = threading.Lock()


def endpoint(base_url: str, max_concurrency: int, rate_limit: float | None) -> Endpoint:
    """The process's limits for ``base_url``: the first engine to use it sets them."""
    with _endpoints_lock:
        found = _endpoints.get(base_url)
        if found is None:
            found = _endpoints[base_url] = Endpoint(base_url, max_concurrency, rate_limit)
        elif (found.max_concurrency, found.rate_limit) != (max_concurrency, rate_limit):
            logger.warning("endpoint %s: keeping max_concurrency=%s, rate_limit=%s set by an earlier engine "
                           "(asked: %s, %s)", base_url, found.max_concurrency, found.rate_limit,
                           max_concurrency, rate_limit)
        return found


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def shared_loop() -> asyncio.AbstractEventLoop:
    """The event loop every remote engine of this process runs its requests on (one thread
    that only waits on sockets), started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="daskllm-remote", daemon=True).start()
        return _loop


class EndpointUnavailable(ConnectionError):
    """The endpoint (and the fallback, if any) kept failing after every retry."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where an attempt goes: an endpoint, the model's name there, and a client for it."""

    base_url: str
    model: str
    client: openai.AsyncOpenAI
    endpoint: Endpoint


@dataclass(slots=True)
class Call:
    """One request, checked and ready to send."""

    ids: list[int]  # the prompt's token ids, as the local tokenizer gives them
    wire: str | list[int]  # the prompt as sent
    params: SamplingParams
    priority: int = 0
    on_text: TokenCallback | None = None
    prefill: bool = False
    delivered: bool = False  # text went to on_text: no retry may send it again


@dataclass(slots=True)
class Answer:
    """What an endpoint returned for a call."""

    text: str
    reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    stop_reason: object = _MISSING
    usage: object = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class RemoteEngine(BatchingEngine):
    """An LLM served by an OpenAI-compatible endpoint, with the local tokenizer of ``model``."""

    OPTIONS = ("base_url", "api_key", "api_key_env", "remote_model", "max_concurrency", "rate_limit", "timeout",
               "max_retries", "retry_delay", "fallback_model", "fallback_base_url", "extensions", "send_text",
               "warm_prefixes", "block_size")

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, base_url: str | None = None,
                 api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY", remote_model: str | None = None,
                 max_concurrency: int = 64, rate_limit: float | None = None, timeout: float = 600.0,
                 max_retries: int = 3, retry_delay: float = 0.5, fallback_model: str | None = None,
                 fallback_base_url: str | None = None, extensions: bool = True, send_text: bool = False,
                 warm_prefixes: bool = True, block_size: int | None = None):
        if not base_url:
            raise ValueError(f"the openai backend needs the endpoint: options base_url='http://HOST:PORT/v1' "
                             f"(model {model!r})")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.name = name or models.model_name(model)
        self.block_size = block_size or config.get("engine.block-size")
        self.tokenizer_path = models.resolve(model)
        self._load_tokenizer(self.tokenizer_path)  # the tokenizer only: the weights stay at the endpoint
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.tokenizer_path)
        self.vocab_size = max(hf_config.vocab_size, len(self.tokenizer))
        eos = getattr(hf_config, "eos_token_id", None)
        self._eos = frozenset((eos if isinstance(eos, list) else [eos] if eos is not None else [])
                              + ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []))

        self.base_url = base_url.rstrip("/")
        self.remote_model = remote_model or self.name
        self.retry = RetryPolicy(max_retries, retry_delay, max(30.0, retry_delay))
        self.timeout, self.extensions, self.send_text = timeout, extensions, send_text
        self.warm_prefixes = warm_prefixes
        key = api_key or os.environ.get(api_key_env) or "EMPTY"  # a server without keys ignores it

        def target(url: str, remote: str) -> Target:
            client = openai.AsyncOpenAI(base_url=url, api_key=key, timeout=timeout, max_retries=0)  # retries: ours
            return Target(url, remote, client, endpoint(url, max_concurrency, rate_limit))

        self._targets = [target(self.base_url, self.remote_model)]
        if fallback_model or fallback_base_url:
            self._targets.append(target((fallback_base_url or base_url).rstrip("/"), fallback_model or self.remote_model))
        # The result store keys results by `path` and `device`: by the endpoint and its model,
        # and not at all when an answer may come from the fallback (another model).
        self.path = self.tokenizer_path if len(self._targets) == 1 else None
        self.device = f"{self.remote_model}@{self.base_url}"

        self._loop = shared_loop()
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._pending: dict[str, tuple[Future, Future]] = {}  # request id -> (caller's future, its task)
        self._busy_since: float | None = None
        self._closed = False
        close_at_exit(self)

    def __repr__(self) -> str:
        return f"<RemoteEngine {self.name!r} at {self.base_url} ({self.remote_model})>"

    # --- the Engine protocol ---------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_text: TokenCallback | None = None, priority: int = 0) -> Future[Completion]:
        call = self._prepare(prompt, params)
        call.on_text, call.priority = on_text, priority
        return self._start(call)

    def _prepare(self, prompt: Prompt, params: SamplingParams | None) -> Call:
        params = check_params(params)
        ids = encode_prompt(prompt, self.tokenize, self.vocab_size)
        if not self.extensions:
            check_plain(params)  # at submit, as every engine refuses a bad request
        wire: str | list[int] = prompt if isinstance(prompt, str) else ids
        if self.send_text and not isinstance(wire, str):
            wire = self.detokenize(ids)
        return Call(ids, wire, params)

    def _start_all(self, prepared: list[Call], priority: int = 0) -> list[Future]:
        for call in prepared:
            call.priority = priority
        return [self._start(call) for call in prepared]

    def submit_prefill(self, prompt: Prompt) -> Future[PrefillHandle]:
        """Send the prefix for one token, so the server's prefix cache holds it; the handle
        claims no blocks (what the server keeps is its own). With ``warm_prefixes=False``
        nothing is sent."""
        call = self._prepare(prompt, SamplingParams(max_tokens=1))
        if self.warm_prefixes:
            call.prefill = True
            return self._start(call)
        future: Future = Future()
        future.set_result(PrefillHandle(self.name, len(call.ids), 0, self.block_size, ()))
        return future

    def stats(self) -> EngineStats:
        """Counters of this engine's requests. ``running``: at the endpoint now; ``waiting``: for
        a slot, the rate limit or a retry; ``max_batch_size``: most at the endpoint at once;
        ``busy_seconds``: wall time with at least one at the endpoint. Tokens are the server's
        counts (its usage), cached ones those it reports."""
        with self._lock:
            stats = dataclasses.replace(self._stats)
            stats.waiting = len(self._pending) - stats.running
            if self._busy_since is not None:
                stats.busy_seconds += time.perf_counter() - self._busy_since
            return stats

    def cache_state(self) -> CacheState:
        """Empty: the prefix cache is the server's, and placement cannot see it."""
        return CacheState(self.name, self.block_size, 0, 0, frozenset())

    def reset_prefix_cache(self) -> bool:
        return False  # the server's cache: not ours to reset

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
        for future, task in pending:
            _settle(future, error=EngineClosed(f"engine {self.name!r} was closed"))
            task.cancel()
        for t in self._targets:
            try:
                asyncio.run_coroutine_threadsafe(t.client.close(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - closing anyway: sockets go with the process
                logger.debug("engine %s: closing the client of %s failed", self.name, t.base_url, exc_info=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests ------------------------------------------------------------------------

    def _start(self, call: Call) -> Future:
        request_id = f"{self.name}-{next(_request_ids)}"
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineClosed(f"engine {self.name!r} is closed")
            self._stats.requests_submitted += 1
            task = asyncio.run_coroutine_threadsafe(self._run(request_id, call, future), self._loop)
            self._pending[request_id] = (future, task)
        # Cancelling the caller's future cancels the coroutine, which closes its HTTP request.
        future.add_done_callback(lambda f: f.cancelled() and task.cancel())
        return future

    async def _run(self, request_id: str, call: Call, future: Future) -> None:
        try:
            answer = await self._answer(call)
            result = self._result(request_id, call, answer)
        except asyncio.CancelledError:
            self._finish(request_id, "requests_cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - a failed request (or its callback) fails alone
            self._finish(request_id, "requests_failed")
            _settle(future, error=exc)
            return
        self._finish(request_id, "requests_finished", answer, result)
        _settle(future, result)

    async def _answer(self, call: Call) -> Answer:
        """The first endpoint's answer, else the fallback's."""
        failures = []
        for target in self._targets:
            try:
                return await self._attempts(target, call)
            except EndpointUnavailable as exc:
                failures.append(exc)
                if call.delivered:  # part of the text went out: another model cannot continue it
                    break
        if len(failures) == 1:
            raise failures[0]
        raise EndpointUnavailable("; and the fallback: ".join(map(str, failures))) from failures[-1]

    async def _attempts(self, target: Target, call: Call) -> Answer:
        for attempt in itertools.count():
            try:
                async with target.endpoint.slot():
                    self._count_running(+1)
                    try:
                        return await self._send(target, call)
                    finally:
                        self._count_running(-1)
            except asyncio.CancelledError:
                raise
            except openai.APIStatusError as exc:
                if not retryable(exc):
                    raise RequestError(f"{target.base_url} ({target.model}) refused the request: {describe(exc)}") \
                        from None
                failure: Exception = exc
            except openai.APIConnectionError as exc:
                failure = exc
            if call.delivered or attempt >= self.retry.max_retries:
                raise EndpointUnavailable(f"{target.base_url} ({target.model}): {describe(failure)} "
                                          f"after {attempt + 1} attempt(s)") from failure
            await asyncio.sleep(self.retry.delay(attempt, retry_after(failure)))
        raise AssertionError("unreachable")

    async def _send(self, target: Target, call: Call) -> Answer:
        body = request_body(call.wire, call.params, target.model, priority=call.priority, extensions=self.extensions)
        if call.on_text is None:
            response = await target.client.completions.create(**body)
            choice = response.choices[0]
            logprobs = choice.logprobs
            return Answer(choice.text, choice.finish_reason, getattr(choice, "token_ids", None),
                          getattr(choice, "prompt_token_ids", None), _stop_reason(choice), response.usage,
                          logprobs.token_logprobs if logprobs else None, logprobs.top_logprobs if logprobs else None)
        stream = await target.client.completions.create(**body, stream=True, stream_options={"include_usage": True})
        answer = Answer("", None)
        parts: list[str] = []
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    answer.usage = chunk.usage
                for choice in chunk.choices:
                    if choice.text:
                        call.delivered = True
                        call.on_text(choice.text)
                        parts.append(choice.text)
                    _extend(answer, choice)
        finally:
            await stream.close()
        answer.text = "".join(parts)
        return answer

    def _result(self, request_id: str, call: Call, answer: Answer) -> Completion | PrefillHandle:
        details = getattr(answer.usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", None) or 0)
        if call.prefill:
            return PrefillHandle(self.name, len(call.ids), cached, self.block_size, ())
        # Token ids are a vLLM extension; without them, the local tokenizer's reading of the text.
        token_ids = answer.token_ids if answer.token_ids is not None else \
            self.tokenize(answer.text, add_special_tokens=False)
        prompt_ids = list(answer.prompt_token_ids) if answer.prompt_token_ids else call.ids
        reason = finish_reason(answer.reason, call.params, token_ids, self._eos, answer.stop_reason)
        top = None
        if answer.top_logprobs is not None and call.params.logprobs:
            top = [self._top_ids(step) for step in answer.top_logprobs]
        return Completion(request_id, prompt_ids, list(token_ids), answer.text, reason, cached,
                          list(answer.logprobs) if answer.logprobs is not None else None, top)

    def _top_ids(self, step: dict[str, float] | None) -> dict[int, float]:
        """OpenAI names the likeliest tokens by their text; ids by the local tokenizer (vLLM's
        ``token_id:N`` spelling as is), skipping a text that is not one token."""
        out: dict[int, float] = {}
        for text, logprob in (step or {}).items():
            if text.startswith("token_id:") and text[9:].isdigit():
                out[int(text[9:])] = logprob
            elif len(ids := self.tokenize(text, add_special_tokens=False)) == 1:
                out[ids[0]] = logprob
        return out

    # --- counters --------------------------------------------------------------------------

    def _count_running(self, delta: int) -> None:
        with self._lock:
            s = self._stats
            s.running += delta
            now = time.perf_counter()
            if delta > 0 and s.running == 1:
                self._busy_since = now
            elif delta < 0 and s.running == 0 and self._busy_since is not None:
                s.busy_seconds += now - self._busy_since
                self._busy_since = None
            s.max_batch_size = max(s.max_batch_size, s.running)

    def _finish(self, request_id: str, counter: str, answer: Answer | None = None, result=None) -> None:
        with self._lock:
            self._pending.pop(request_id, None)
            s = self._stats
            setattr(s, counter, getattr(s, counter) + 1)
            if answer is None:
                return
            usage = answer.usage
            prompt = getattr(usage, "prompt_tokens", None)
            if prompt is None:
                prompt = result.num_tokens if isinstance(result, PrefillHandle) else result.num_prompt_tokens
            cached = result.num_cached_tokens
            s.prefill_tokens_cached += cached
            s.prefill_tokens_computed += max(0, prompt - cached)
            completion = getattr(usage, "completion_tokens", None)
            if completion is None:
                completion = 1 if isinstance(result, PrefillHandle) else len(result.token_ids)
            s.decode_tokens += completion


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve a caller's future unless it was cancelled, or already failed by close()."""
    try:
        if future.set_running_or_notify_cancel():
            future.set_exception(error) if error is not None else future.set_result(result)
    except (RuntimeError, InvalidStateError):  # already resolved
        pass


def _stop_reason(choice) -> object:
    extra = getattr(choice, "model_extra", None) or {}
    return extra.get("stop_reason", _MISSING)


def _extend(answer: Answer, choice) -> None:
    """Add one streamed chunk's choice to the answer."""
    if choice.finish_reason:
        answer.reason = choice.finish_reason
        answer.stop_reason = _stop_reason(choice)
    if (ids := getattr(choice, "token_ids", None)) is not None:
        answer.token_ids = (answer.token_ids or []) + list(ids)
    if (prompt_ids := getattr(choice, "prompt_token_ids", None)) is not None:
        answer.prompt_token_ids = list(prompt_ids)
    if choice.logprobs is not None:
        answer.logprobs = (answer.logprobs or []) + list(choice.logprobs.token_logprobs or ())
        answer.top_logprobs = (answer.top_logprobs or []) + list(choice.logprobs.top_logprobs or ())
