"""The embedded torch engine: continuous batching over a prefix-cached, paged KV cache.

One background thread per engine runs steps. Requests submitted from any thread (Dask
tasks running on the worker) land in an inbox and join the running batch at the next
step; finished ones leave it. Serves CPU workers and tests; GPU workers can run it too,
though there the vLLM engine is the production backend.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future

import torch

from daskllm import config, models
from daskllm.engines.detok import TextStream
from daskllm.engines.grammar import Grammars, advance, allowed
from daskllm.engines.kv_cache import BlockManager
from daskllm.engines.lifecycle import close_at_exit
from daskllm.engines.llama import LlamaModel, StepInput
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
from daskllm.engines.sampling import logprobs, make_generator, sample
from daskllm.engines.scheduler import Scheduler, Sequence

logger = logging.getLogger(__name__)
_request_ids = itertools.count()


class TorchEngine(BatchingEngine):
    """A resident model with continuous batching and a prefix cache (the Engine protocol)."""

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, block_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, num_threads: int | None = None):
        path = models.resolve(model)
        self.name = name or models.model_name(model)
        self.path = path
        self.block_size = block_size or config.get("engine.block-size")
        kv_cache_tokens = kv_cache_tokens or config.get("engine.kv-cache-tokens")
        max_num_seqs = max_num_seqs or config.get("engine.max-num-seqs")
        max_num_batched_tokens = max_num_batched_tokens or config.get("engine.max-num-batched-tokens")
        num_threads = num_threads or config.get("engine.num-threads")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _resolve_dtype(dtype or config.get("engine.dtype"), device)

        self.model = LlamaModel(path, device=device, dtype=dtype)
        self.max_model_len = self.model.config.max_model_len
        self._load_tokenizer(path)
        num_blocks = kv_cache_tokens // self.block_size
        if num_blocks < 1:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens} holds no block of {self.block_size} tokens")
        self.model.allocate_cache(num_blocks, self.block_size)
        self._blocks = BlockManager(num_blocks, self.block_size)
        self._scheduler = Scheduler(self._blocks, max_num_seqs, max(max_num_batched_tokens, max_num_seqs),
                                    copy_rows=self.model.copy_rows)
        self._eos = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self._eos.add(self.tokenizer.eos_token_id)

        self._grammars: Grammars | None = None  # built on the first constrained request (about a second)
        self._grammars_lock = threading.Lock()

        self._stats = EngineStats(cache_blocks_total=num_blocks)
        self._inbox: deque[Sequence] = deque()
        self._wakeup = threading.Condition()
        self._state = threading.Lock()  # guards scheduler/cache bookkeeping against readers
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"daskllm-engine-{self.name}", daemon=True)
        self._thread.start()
        close_at_exit(self)

    def __repr__(self) -> str:
        return f"<TorchEngine {self.name!r} on {self.model.device}, {self._blocks.num_blocks} blocks>"

    # --- the Engine protocol -------------------------------------------------------------

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

    def submit_prefill(self, prompt: Prompt) -> Future[PrefillHandle]:
        """Warm the cache with ``prompt``: its full blocks, and its partly filled last block."""
        ids = self._encode(prompt)
        if len(ids) > self.max_model_len:
            raise RequestError(f"prefix has {len(ids)} tokens; model {self.name!r} holds at most {self.max_model_len}")
        self._check_fits(len(ids))
        seq = Sequence(f"{self.name}-prefill-{next(_request_ids)}", ids, len(ids), SamplingParams(),
                       Future(), prefill_only=True)
        future = self._enqueue([seq])[0]
        handle: Future[PrefillHandle] = Future()

        def done(f: Future):
            if f.cancelled():
                handle.cancel()
            elif f.exception() is not None:
                handle.set_exception(f.exception())
            else:
                handle.set_result(dataclasses.replace(f.result(), num_tokens=len(ids)))

        future.add_done_callback(done)
        return handle

    def stats(self) -> EngineStats:
        with self._state:
            s = dataclasses.replace(self._stats)
            s.running = len(self._scheduler.running)
            s.waiting = len(self._scheduler.waiting) + len(self._inbox)
            s.cache_blocks_used = self._blocks.num_used
            s.evicted_blocks = self._blocks.evicted_blocks
            s.preemptions = self._scheduler.preemptions
            s.prefill_tokens_cached = self._scheduler.cached_tokens
        return s

    def cache_state(self) -> CacheState:
        with self._state:
            return CacheState(self.name, self.block_size, self._blocks.num_blocks, self._blocks.num_used,
                              self._blocks.resident_hashes())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no request is using (vLLM has the same call)."""
        with self._state:
            return self._blocks.reset()

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._state:
            pending = list(self._inbox) + list(self._scheduler.waiting) + self._scheduler.running
            self._inbox.clear()
        for seq in pending:
            self._fail(seq, EngineClosed(f"engine {self.name!r} was closed"))
        self.model.k_cache = self.model.v_cache = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests --------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.tokenize, self.model.config.vocab_size)

    def _check_fits(self, num_tokens: int) -> None:
        capacity = self._blocks.num_blocks * self.block_size
        if num_tokens > capacity:
            raise RequestError(f"request needs {num_tokens} tokens of KV cache; engine {self.name!r} holds {capacity}")

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
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self._eos)
            return self._grammars

    def _decode_generated(self, token_ids: SequenceABC[int]) -> str:
        return self.detokenize([t for t in token_ids if t not in self._eos])

    # --- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._closed and not self._inbox and not self._scheduler.has_work():
                    self._wakeup.wait()
                if self._closed:
                    return
                with self._state:
                    self._scheduler.add(self._inbox)
                    self._inbox.clear()
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the loop must survive anything a step does
                logger.exception("engine %s: step failed", self.name)

    def _step(self) -> None:
        with self._state:
            for seq in [s for s in (*self._scheduler.running, *self._scheduler.waiting) if s.future.cancelled()]:
                self._scheduler.finish(seq)
                self._stats.requests_cancelled += 1
            try:
                step = self._scheduler.schedule()
            except RuntimeError as exc:  # a request that can never fit (submit() should rule it out)
                step, error = [], exc
            else:
                error = None
            if not step:
                if self._scheduler.has_work():  # no progress possible: fail one request rather than spin
                    seq = self._scheduler.waiting[0] if self._scheduler.waiting else self._scheduler.running[-1]
                    self._fail(seq, error or RuntimeError(f"request {seq.request_id} could not be scheduled"))
                return
        start = time.perf_counter()
        try:
            logits = self._forward(step)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            logger.exception("engine %s: forward pass failed", self.name)
            with self._state:
                for seq, _ in step:
                    self._fail(seq, exc)
            return
        with self._state:
            self._postprocess(step, logits)
            self._stats.steps += 1
            self._stats.batched_sequences += len(step)
            self._stats.max_batch_size = max(self._stats.max_batch_size, len(step))
            self._stats.busy_seconds += time.perf_counter() - start

    def _forward(self, step: list[tuple[Sequence, int]]) -> torch.Tensor | None:
        bs = self.block_size
        input_ids, positions, slots, seqs, logit_rows = [], [], [], [], []
        for seq, n in step:
            if n == 0:
                continue
            first = seq.num_computed
            row = len(input_ids)
            input_ids += seq.token_ids[first:first + n]
            positions += range(first, first + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(first, first + n)]
            seqs.append((row, n, first, seq.block_table))
            if first + n == len(seq.token_ids) and not seq.prefill_only:
                logit_rows.append(row + n - 1)
        if not input_ids:
            return None
        device = self.model.device
        return self.model.forward(StepInput(
            torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
            torch.tensor(slots, device=device), seqs, logit_rows)).cpu()

    def _postprocess(self, step: list[tuple[Sequence, int]], logits: torch.Tensor | None) -> None:
        row = 0
        for seq, n in step:
            prompt_part = max(0, min(n, seq.num_prompt_tokens - seq.num_computed))
            self._stats.prefill_tokens_computed += prompt_part
            seq.num_computed += n
            self._scheduler.register_computed_blocks(seq)
            if seq.num_computed < len(seq.token_ids):
                continue  # a long prompt, prefilled in chunks
            if seq.prefill_only:
                self._scheduler.keep_partial_tail(seq)
                self._complete(seq, PrefillHandle(self.name, len(seq.token_ids), seq.num_cached or 0,
                                                  self.block_size, tuple(seq.block_hashes)))
                continue
            try:
                mask = None if seq.matcher is None else allowed(seq.matcher, logits.shape[-1])
                token = sample(logits[row], seq.params, seq.generator, mask)
                if seq.params.logprobs is not None:
                    chosen, top = logprobs(logits[row], seq.params, token, mask)
                    seq.logprobs = (seq.logprobs or []) + [chosen]
                    seq.top_logprobs = (seq.top_logprobs or []) + [top]
                self._append_token(seq, token)
            except Exception as exc:  # noqa: BLE001 - e.g. a user's on_text callback raised
                self._fail(seq, exc)
            row += 1

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
        self._scheduler.finish(seq)
        self._stats.requests_finished += 1
        if seq.future.set_running_or_notify_cancel():
            seq.future.set_result(result)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self._scheduler.finish(seq)
        self._stats.requests_failed += 1
        if not seq.future.done() and seq.future.set_running_or_notify_cancel():
            seq.future.set_exception(exc)


def _resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)
