"""What every local engine does the same way around its model steps.

Requests submitted from any thread (Dask tasks running on the worker) land in an inbox;
one background thread takes them in and runs steps, each step computing new tokens for
many sequences together. Whatever computes the step (the torch forward pass, llama.cpp),
each chosen token goes through the same rules here: sampling and log-probabilities,
grammar, end of sequence, stop strings, length, streamed text, and the request's future.
A subclass says how to take requests in (``_admit``), what one step is (``_step``), and
what to give back when a sequence leaves (``_release``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future

import torch

from daskllm.engines.detok import TextStream
from daskllm.engines.grammar import Grammars, advance, allowed
from daskllm.engines.lifecycle import close_at_exit
from daskllm.engines.protocol import (
    BatchingEngine,
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
from daskllm.engines.sampling import logprobs, make_generator, sample
from daskllm.engines.scheduler import Sequence

logger = logging.getLogger(__name__)
_request_ids = itertools.count()


class SteppingEngine(BatchingEngine):
    """A model stepped by one background thread (the Engine protocol, less the step itself)."""

    name: str
    max_model_len: int
    vocab_size: int

    def _start_loop(self, eos: Iterable[int], stats: EngineStats) -> None:
        """Start serving; call at the end of ``__init__`` once the model is loaded."""
        self._eos = set(eos)
        self._stats = stats
        self._grammars: Grammars | None = None  # built on the first constrained request (about a second)
        self._grammars_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._wakeup = threading.Condition()
        self._state = threading.Lock()  # guards the step's bookkeeping against readers
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"daskllm-engine-{self.name}", daemon=True)
        self._thread.start()
        close_at_exit(self)

    # --- what a subclass provides ---------------------------------------------------------------

    def _check_fits(self, num_tokens: int) -> None:
        """RequestError if a sequence of ``num_tokens`` can never fit in the KV cache."""
        raise NotImplementedError

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _admit(self, arrived: list[Sequence]) -> None:
        """Queue sequences that just arrived (called under ``_state``)."""
        raise NotImplementedError

    def _step(self) -> None:
        """Run one step; a sequence's chosen tokens go to :meth:`_choose`."""
        raise NotImplementedError

    def _release(self, seq: Sequence) -> None:
        """A sequence leaves (finished, failed or cancelled): give back what it holds."""
        raise NotImplementedError

    def _queued(self) -> list[Sequence]:
        """Every sequence waiting or running, for close()."""
        raise NotImplementedError

    def _free_resources(self) -> None:
        """After close(): drop the model's memory."""

    # --- the Engine protocol --------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_text: TokenCallback | None = None, priority: int = 0) -> Future[Completion]:
        seq = self._sequence(prompt, params, on_text)
        seq.priority = priority
        return self._enqueue([seq])[0]

    def _prepare(self, prompt: Prompt, params: SamplingParams | None) -> Sequence:
        return self._sequence(prompt, params)

    def _start_all(self, prepared: list[Sequence], priority: int = 0) -> list[Future]:
        for seq in prepared:
            seq.priority = priority
        return self._enqueue(prepared)  # one step sees them all

    def submit_prefill(self, prompt: Prompt) -> Future[PrefillHandle]:
        """Warm the cache with ``prompt``; the step completes the sequence with a PrefillHandle."""
        ids = self._encode(prompt)
        if len(ids) > self.max_model_len:
            raise RequestError(f"prefix has {len(ids)} tokens; model {self.name!r} holds at most {self.max_model_len}")
        self._check_fits(len(ids))
        seq = Sequence(f"{self.name}-prefill-{next(_request_ids)}", ids, len(ids), SamplingParams(),
                       Future(), prefill_only=True)
        return self._enqueue([seq])[0]

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._state:
            pending = list(self._inbox) + self._queued()
            self._inbox.clear()
        for seq in pending:
            self._fail(seq, EngineClosed(f"engine {self.name!r} was closed"))
        self._free_resources()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests --------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.tokenize, self.vocab_size)

    def _sequence(self, prompt: Prompt, params: SamplingParams | None, on_text: TokenCallback | None = None):
        params = check_params(params)
        ids = self._encode(prompt)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; model {self.name!r} holds at most "
                               f"{self.max_model_len} (including at least one generated token)")
        self._check_fits(min(len(ids) + params.max_tokens, self.max_model_len))
        seq = Sequence(f"{self.name}-{next(_request_ids)}", ids, len(ids), params, Future(), on_text=on_text,
                       generator=make_generator(params))
        if params.structured is not None:
            seq.matcher = self._grammar_set().matcher(params.structured)
        if on_text is not None or params.stop:
            seq.text = TextStream(self._decode_generated, params.stop)
        return seq

    def _enqueue(self, seqs: list[Sequence]) -> list[Future]:
        with self._wakeup:
            if self._closed:
                raise EngineClosed(f"engine {self.name!r} is closed")
            self._inbox.extend(seqs)
            self._stats.requests_submitted += len(seqs)
            self._wakeup.notify()
        return [s.future for s in seqs]

    def _grammar_set(self) -> Grammars:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self._eos)
            return self._grammars

    def _decode_generated(self, token_ids: SequenceABC[int]) -> str:
        return self.detokenize([t for t in token_ids if t not in self._eos])

    # --- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not self._inbox and not self._has_work():
                    self._wakeup.wait()
                if self._closed:
                    return
                with self._state:
                    self._admit(list(self._inbox))
                    self._inbox.clear()
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the loop must survive anything a step does
                logger.exception("engine %s: step failed", self.name)

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Pick ``seq``'s next token from its row of logits and append it (under ``_state``)."""
        try:
            mask = None if seq.matcher is None else allowed(seq.matcher, logits.shape[-1])
            token = sample(logits, seq.params, seq.generator, mask)
            if seq.params.logprobs is not None:
                chosen, top = logprobs(logits, seq.params, token, mask)
                seq.logprobs = (seq.logprobs or []) + [chosen]
                seq.top_logprobs = (seq.top_logprobs or []) + [top]
            self._append_token(seq, token)
        except Exception as exc:  # noqa: BLE001 - e.g. a user's on_text callback raised
            self._fail(seq, exc)

    def _accept(self, seq: Sequence, token: int) -> None:
        """Append a token chosen elsewhere (greedy, on the model's device) under ``_state``."""
        try:
            self._append_token(seq, token)
        except Exception as exc:  # noqa: BLE001 - e.g. a user's on_text callback raised
            self._fail(seq, exc)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        self._stats.decode_tokens += 1
        reason = None
        if token in self._eos and not seq.params.ignore_eos:
            reason = "eos"
        elif seq.matcher is not None:
            advance(seq.matcher, token)
            if seq.matcher.is_stopped():  # the grammar is complete: EOS is all that could follow,
                reason = "eos"  # so it ends here, as vLLM's does when it samples that EOS
        if seq.text is not None:
            delta = seq.text.update(seq.generated)
            if seq.text.stopped:
                reason = "stop"
            elif reason is not None:
                delta += seq.text.flush()
            if delta and seq.on_text is not None:
                seq.on_text(delta)
        if reason is None and (seq.num_generated >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
            if seq.text is not None and (rest := seq.text.flush()) and seq.on_text is not None:
                seq.on_text(rest)
        if reason is not None:
            text = seq.text.text if seq.text is not None else self._decode_generated(seq.generated)
            self._complete(seq, Completion(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.generated,
                                           text, reason, seq.num_cached or 0, seq.logprobs,
                                           seq.top_logprobs))

    def _complete(self, seq: Sequence, result) -> None:
        self._release(seq)
        self._stats.requests_finished += 1
        if seq.future.set_running_or_notify_cancel():
            seq.future.set_result(result)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self._release(seq)
        self._stats.requests_failed += 1
        if not seq.future.done() and seq.future.set_running_or_notify_cancel():
            seq.future.set_exception(exc)
