"""The Engine protocol: one small typed interface every backend implements.

The embedded torch engine and the vLLM engine both implement it, and the same tests run
on both. Requests are text or token ids plus :class:`SamplingParams`; outputs are
:class:`Completion` objects that say how many prompt tokens came from the prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import llguidance

Prompt = str | Sequence[int]
TokenCallback = Callable[[str], None]


class EngineClosed(RuntimeError):
    """The engine was closed: requests still running fail with this, new ones are refused."""


class RequestError(ValueError):
    """A request was rejected; only that request fails, the engine keeps serving."""


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow: a JSON schema, a choice among strings, or a regex.

    ``spec`` is compact text (a JSON schema or a choice list as JSON, a regex as is), so equal
    constraints are equal, hash alike and travel as plain strings. It is checked
    here, where the request is built: a bad one raises a RequestError naming the field.
    """

    kind: str  # json_schema | choice | regex
    spec: str

    KINDS = ("json_schema", "choice", "regex")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise RequestError(f"structured: kind must be one of {self.KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(f"structured {self.kind}: spec must be text, got {type(self.spec).__name__}")
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise RequestError(f"structured {self.kind}: {error.strip()}")

    @classmethod
    def json_schema(cls, schema) -> StructuredOutput:
        """From a JSON schema (a dict or its JSON text) or a pydantic model class."""
        if hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise RequestError(f"schema: not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise RequestError(f"schema must be a JSON schema (dict) or a pydantic model, got {type(schema).__name__}")
        # JSON laid out as json.dumps writes it: free whitespace would let a model pad forever
        # (the loop vLLM's disable_any_whitespace exists for). A schema's own x-guidance wins.
        schema = {"x-guidance": JSON_LAYOUT, **schema}
        # Key order is kept: the output lists an object's properties in the schema's order.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices) -> StructuredOutput:
        if isinstance(choices, str) or not all(isinstance(c, str) and c for c in choices) or not choices:
            raise RequestError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(dict.fromkeys(choices))))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"regex must be a non-empty str, got {pattern!r}")
        return cls("regex", pattern)

    def grammar(self) -> str:
        """The llguidance grammar (vLLM's "guidance" backend reads the same)."""
        try:
            return llguidance.grammar_from(self.kind, self.spec)
        except ValueError as exc:
            raise RequestError(f"structured {self.kind}: {exc}") from None

    @property
    def value(self):
        """The spec as vLLM's StructuredOutputsParams takes it: a schema dict, a choice list, a regex."""
        return self.spec if self.kind == "regex" else json.loads(self.spec)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to decode. ``temperature=0`` is greedy; a seed makes sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Only these tokens may be generated (e.g. the first tokens of "yes" and "no"); () = any.
    allowed_token_ids: tuple[int, ...] = ()
    # A grammar the output follows (decoding is masked to it); None = free text.
    structured: StructuredOutput | None = None
    # Report each chosen token's log-probability under the distribution it was drawn from
    # (after allowed_token_ids masking, temperature and top-p): a filter's confidence. None:
    # off; 0: the chosen token's; k: also the k likeliest tokens' (as vLLM and OpenAI count).
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
            raise RequestError(f"allowed_token_ids must be token ids, got {self.allowed_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise RequestError(f"logprobs must be None or a non-negative integer, got {self.logprobs!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.structured is not None and self.ignore_eos:
            raise RequestError("structured: ignore_eos cannot be combined with a grammar (it ends where the "
                               "grammar is complete)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def deterministic(self) -> bool:
        """Same input, same output: greedy, or sampled with a fixed seed."""
        return self.greedy or self.seed is not None

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclass(slots=True)
class Completion:
    """The result of one generation request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop string), "eos", "length"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # Per generated token, its log-probability and the k likeliest tokens' (token id -> logprob),
    # when SamplingParams.logprobs asked for them.
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class PrefillHandle:
    """What a prefill-only request returns: small, picklable, never KV tensors.

    ``block_hashes`` is the chain of hashes of the full blocks now resident in the
    engine's cache; a later request whose prompt starts with those tokens reuses them.
    """

    model: str
    num_tokens: int
    num_cached_tokens: int  # tokens that were already cached before this prefill
    block_size: int
    block_hashes: tuple[int, ...]


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started, and gauges of its current state."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    decode_tokens: int = 0
    steps: int = 0
    batched_sequences: int = 0  # sum of sequences over steps: mean batch = this / steps
    max_batch_size: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0
    busy_seconds: float = 0.0
    # The fastest step in which every sequence decoded one token (0.0: none yet): a decode's
    # best time per token here, whatever the load (``busy_seconds / steps`` mixes in prefill
    # chunks and time lost to other threads).
    fastest_decode_step: float = 0.0
    # gauges
    running: int = 0
    waiting: int = 0
    cache_blocks_used: int = 0
    cache_blocks_total: int = 0

    def record_step(self, sequences: int, seconds: float, decode_only: bool) -> None:
        """Count a completed step of ``sequences`` that took ``seconds``; ``decode_only``: every
        sequence in it decoded one token."""
        self.steps += 1
        self.batched_sequences += sequences
        self.max_batch_size = max(self.max_batch_size, sequences)
        self.busy_seconds += seconds
        if decode_only and (self.fastest_decode_step == 0.0 or seconds < self.fastest_decode_step):
            self.fastest_decode_step = seconds

    @property
    def mean_batch_size(self) -> float:
        return self.batched_sequences / self.steps if self.steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the cache."""
        total = self.prefill_tokens_computed + self.prefill_tokens_cached
        return self.prefill_tokens_cached / total if total else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mean_batch_size"] = self.mean_batch_size
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d


@dataclass(frozen=True, slots=True)
class CacheState:
    """Which prefix blocks are resident: what the placement plugin mirrors."""

    model: str
    block_size: int
    num_blocks: int
    blocks_in_use: int
    resident_hashes: frozenset[int] = field(default_factory=frozenset)


@runtime_checkable
class Engine(Protocol):
    """One model, resident in one process, batching requests from many threads."""

    name: str
    block_size: int

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_text: TokenCallback | None = None, priority: int = 0) -> Future[Completion]:
        """Queue a generation; ``on_text`` receives text deltas as they are decoded. Waiting
        requests start in ``priority`` order, lower first (vLLM's convention), then in arrival order."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                 return_exceptions: bool = False) -> list[Completion]:
        """Generate for many prompts at once (they are batched together). A bad prompt fails alone:
        with ``return_exceptions`` its slot holds its error, else it is raised once the rest finish."""

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one generation as they are decoded."""

    def prefill(self, prompt: Prompt) -> PrefillHandle:
        """Warm the prefix cache with ``prompt`` and return a small handle."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, as the model's tokenizer gives them (``tokenizer(text).input_ids``)."""

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def stats(self) -> EngineStats: ...

    def cache_state(self) -> CacheState: ...

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes no request uses (for cold-start measurements)."""

    def close(self) -> None: ...


def encode_prompt(prompt: Prompt, tokenize: Callable[[str], list[int]], vocab_size: int) -> list[int]:
    """A prompt's token ids, or a RequestError that says what is wrong with it."""
    if isinstance(prompt, str):
        ids = tokenize(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), None)
        if bad is not None or not ids:
            raise RequestError(f"token ids must be a non-empty list of ints in [0, {vocab_size}); got {bad!r}")
    else:
        raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise RequestError("prompt is empty")
    return ids


def check_params(params: SamplingParams | None) -> SamplingParams:
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
    return params


class BatchingEngine:
    """What every backend builds the same way on its own ``submit``, ``submit_many`` and
    ``submit_prefill``: batched generation with per-prompt errors, streaming, prefill; and
    text from the model directory's Hugging Face tokenizer."""

    def _load_tokenizer(self, path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._fast = getattr(self.tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no Python per call

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(token_ids), skip_special_tokens=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def submit_many(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                    priority: int = 0) -> list[Future]:
        """Submit prompts together, so they join the same engine step. A bad prompt does not stop
        the others: its slot holds a future failed with a RequestError naming its position."""
        if isinstance(prompts, str):
            raise RequestError("submit_many() takes a list of prompts; use submit() for one")
        prepared, failed = [], {}
        for i, p in enumerate(prompts):
            try:
                prepared.append(self._prepare(p, params))
            except RequestError as exc:
                error = RequestError(f"prompt {i}: {exc}")
                error.__cause__ = exc  # the reason alone, for a caller that names its prompts otherwise
                failed[i] = failed_future(error)
        started = iter(self._start_all(prepared, priority))
        return [failed[i] if i in failed else next(started) for i in range(len(prompts))]

    def _prepare(self, prompt: Prompt, params: SamplingParams | None):
        """A checked request (RequestError if it is bad), not yet started."""
        raise NotImplementedError

    def _start_all(self, prepared: list, priority: int = 0) -> list[Future]:
        """Start checked requests, atomically where the engine can."""
        raise NotImplementedError

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_text: TokenCallback | None = None, priority: int = 0) -> Future[Completion]:
        raise NotImplementedError

    def submit_prefill(self, prompt: Prompt) -> Future[PrefillHandle]:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                 return_exceptions: bool = False) -> list[Completion]:
        """Generate for all prompts together. A bad prompt fails alone: with
        ``return_exceptions`` its slot holds the error, else it is raised once the rest finish."""
        return gather_requests(self.submit_many(prompts, params), return_exceptions=return_exceptions)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        deltas: queue.Queue = queue.Queue()
        future = self.submit(prompt, params, on_text=deltas.put)
        future.add_done_callback(lambda _: deltas.put(None))
        while (delta := deltas.get()) is not None:
            yield delta
        future.result()  # raise the request's error, if any

    def prefill(self, prompt: Prompt) -> PrefillHandle:
        return self.submit_prefill(prompt).result()


def gather_requests(futures: Sequence[Future], *, return_exceptions: bool = False) -> list:
    """The results of requests, in order, once all are done: a failed one holds its error with
    ``return_exceptions``, else the first error is raised."""
    results: list = []
    for f in futures:
        try:
            results.append(f.result())
        except Exception as exc:  # noqa: BLE001 - reported per request
            results.append(exc)
    if not return_exceptions:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results


def failed_future(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
