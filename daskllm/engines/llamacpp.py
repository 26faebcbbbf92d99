"""The llama.cpp engine: GGUF models at the CPU's speed, through llama-cpp-python's low-level API.

The shipped SmolLM2 weights are a Q4_1 GGUF file, llama.cpp's own format: its quantized
kernels decode one sequence about ten times faster than the float32 torch engine. This
engine adds what llama-cpp-python's high-level ``Llama`` class lacks:

* **Continuous batching.** One background thread runs steps (as the torch engine does):
  every running sequence's next token, and chunks of prompts being prefilled, go into one
  ``llama_batch`` and one ``llama_decode`` call. Sequences join and leave between steps.
  Each sequence is a llama.cpp sequence id (a *slot*) in one unified KV cache.
* **Prefix sharing.** A new prompt starts from the longest prefix a running slot holds
  (``llama_memory_seq_cp`` tags those cache cells with the new slot too: neither copied nor
  recomputed) or a finished sequence left behind. A finished sequence's cells leave the
  context: its KV state is copied to host memory (``llama_state_seq_get_data``) and restored
  into a new slot when a prompt starts with it (``llama_state_seq_set_data``, a copy of its
  rows, then the unmatched tail dropped). The context holds only running sequences because
  llama.cpp attends over every cell up to the highest one in use, masked or not: with 64
  finished sequences kept in the context (3,100 cells), a lone decode step took 27 ms
  instead of 7, and 300 ms with the cache full. Kept states hold at most kv-cache-tokens
  tokens, least recently used first out. Prefixes are found by the same block hash chains as
  the torch engine's paged cache, so ``cache_state()`` tells the placement plugin the same thing.
* **Sampling here**: logits come back to Python, and the same code as the torch engine's
  chooses the token (greedy, seeded temperature/top-p, ``allowed_token_ids``, grammars,
  log-probabilities), so requests behave alike on both.

Flash attention is on, with V kept in float32 so the kernel accumulates in float32. Its CPU
kernel still visits the cells a sequence does not own (masked), so every step costs in
proportion to the cells in use by all running sequences. What this backend cannot
promise is batch invariance: its matrix kernels are chosen by the number of rows in a pass,
and attention sums over cache cells in their order in the cache, so a greedy sequence decoded
among others can differ from the same sequence alone (docs/engine.md says how often).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
import os
import time
from collections import OrderedDict, deque

import numpy as np
import torch

from daskllm import config, models
from daskllm.engines import sizing
from daskllm.engines.kv_cache import ROOT_HASH, block_hashes, hash_block
from daskllm.engines.protocol import CacheState, EngineStats, PrefillHandle, RequestError
from daskllm.engines.scheduler import Sequence, queue_by_priority
from daskllm.engines.stepping import SteppingEngine

logger = logging.getLogger(__name__)

MAX_SLOTS = 256  # LLAMA_MAX_SEQ: sequence ids a context can hold; kept prefixes are numbered from here on
# Tokens per llama.cpp compute pass (its default). From 64 rows on, ggml's CPU matrix products
# round differently than below, so smaller passes (n_ubatch=32) make batched and lone greedy
# outputs agree more often (8 of 16 rather than 7 of 16 in one measurement: other differences
# remain), at about a third less prefill throughput.
UBATCH_ROWS = 512


def unavailable_reason() -> str | None:
    """Why this process cannot run llama.cpp engines, or None if it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); install it with: pip install 'daskllm[cpu]'"
    return None


def _llama_cpp():
    reason = unavailable_reason()
    if reason:
        raise ImportError(reason)
    import llama_cpp

    global _log_callback
    if _log_callback is None:  # llama.cpp logs every load to stderr: send it to logging instead
        @llama_cpp.llama_log_callback
        def _log_callback(level, text, _user_data):
            # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continued
            logger.log(logging.WARNING if level == 4 else logging.DEBUG, "%s", text.decode("utf-8", "replace").rstrip())

        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


_log_callback = None  # kept alive here: llama.cpp holds only its address


class _Batch:
    """A ``llama_batch`` over numpy arrays this object owns: filled in bulk, never freed by llama.cpp."""

    def __init__(self, llama_cpp, capacity: int):
        self._llama_cpp = llama_cpp
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self.seq_ptr = np.zeros(capacity, np.uintp)
        self._ids = np.arange(MAX_SLOTS, dtype=np.int32)  # each token's seq_id points at its slot's entry

    def fill(self, tokens: list[int], positions: list[int], slots: list[int], wants_logits: list[bool]):
        n = len(tokens)
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, positions, wants_logits
        self.seq_ptr[:n] = self._ids.ctypes.data + self._ids.itemsize * np.asarray(slots, dtype=np.uintp)
        lc = self._llama_cpp
        batch = lc.llama_batch()
        batch.n_tokens = n
        batch.token = self.token.ctypes.data_as(ctypes.POINTER(lc.llama_token))
        batch.embd = None
        batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos))
        batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = self.seq_ptr.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id)))
        batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        return batch


@dataclasses.dataclass
class _Kept:
    """A finished sequence's prefix, out of the context: its tokens and its KV state in host memory."""

    tokens: list[int]
    state: ctypes.Array  # llama_state_seq_get_data's bytes: the sequence's cells, every layer's K and V
    prefill: bool  # a prefill's: a prompt continuing its partly filled last block may start from all of it


class LlamaCppEngine(SteppingEngine):
    """A resident GGUF model on llama.cpp, with continuous batching and prefix sharing (the Engine protocol)."""

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, block_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, num_threads: int | None = None,
                 max_model_len: int | None = None, n_ubatch: int = UBATCH_ROWS, **ignored):
        if ignored:
            # Torch-engine settings (dtype, device) a worker passes to every local engine.
            logger.debug("llama.cpp engine %s ignores options %s", name or model, sorted(ignored))
        lc = self._lc = _llama_cpp()
        self.path = models.resolve_gguf(model)
        self.name = name or models.model_name(model)
        self.block_size = block_size or config.get("engine.block-size")
        kv_cache_tokens = sizing.limit(kv_cache_tokens, "kv-cache-tokens", on_cpu=True)
        self.max_num_seqs = min(sizing.limit(max_num_seqs, "max-num-seqs", on_cpu=True), MAX_SLOTS)
        self.max_num_batched_tokens = max(sizing.limit(max_num_batched_tokens, "max-num-batched-tokens", on_cpu=True),
                                          self.max_num_seqs)
        threads = int(num_threads or config.get("engine.num-threads") or os.cpu_count() or 1)

        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load the GGUF file {self.path}")
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = kv_cache_tokens
        ctx_params.n_batch = self.max_num_batched_tokens
        ctx_params.n_ubatch = min(n_ubatch, self.max_num_batched_tokens)
        ctx_params.n_seq_max = MAX_SLOTS
        # Logits come back for one token per running sequence at most: the buffer holds that many
        # rows, not n_batch (49,152 floats a row for SmolLM2; llama.cpp wants at least n_seq_max).
        ctx_params.n_outputs_max = MAX_SLOTS
        ctx_params.kv_unified = True  # one cache: slots share cells (seq_cp tags, never copies)
        # Flash attention: its CPU kernel skips the cells a sequence does not own, so kept prefixes
        # cost other sequences nothing. With float16 V it accumulates in float16; float32 V makes
        # it accumulate in float32 (and it was the fastest of the four layouts measured).
        ctx_params.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx_params.type_k = 1  # GGML_TYPE_F16
        ctx_params.type_v = 0  # GGML_TYPE_F32
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not create a context for {self.path} "
                             f"(kv_cache_tokens={kv_cache_tokens}: too much memory?)")
        self._memory = lc.llama_get_memory(self._ctx)
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.max_num_batched_tokens = lc.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        vocab = lc.llama_model_get_vocab(self._model)
        self.vocab_size = lc.llama_vocab_n_tokens(vocab)
        # a sequence's context: the model's, unless capped; a request the cache cannot hold is refused
        self.max_model_len = max_model_len or lc.llama_model_n_ctx_train(self._model)
        self._load_tokenizer(models.gguf_tokenizer_dir(self.path))
        eos = {lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab), self.tokenizer.eos_token_id} - {None, -1}
        self._batch = _Batch(lc, self.max_num_batched_tokens)
        self._cache_full = False  # a sequence was preempted: admit no more until one leaves

        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._slot_of: dict[Sequence, int] = {}
        self._free_slots = list(range(MAX_SLOTS - 1, -1, -1))
        # Resident prefixes, each under a key: a running sequence's slot id (< MAX_SLOTS: its cells
        # are in the context), or a kept prefix's id (>= MAX_SLOTS: its state is in host memory).
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self._kept_ids = itertools.count(MAX_SLOTS)
        self._kept_tokens = 0  # at most n_ctx
        self._source: dict[int, int] = {}  # slot -> the kept prefix it was restored from
        self._chains: dict[int, list[int]] = {}  # key -> hash chain of the full blocks it holds
        self._holders: dict[int, set[int]] = {}  # block hash -> keys holding it
        self._prefill_tails: dict[int, set[int]] = {}  # last full block's hash -> kept prefills continuing it
        self._cached_tokens = 0
        self._preemptions = 0
        self._evicted_blocks = 0
        self._start_loop(eos, EngineStats(cache_blocks_total=self.n_ctx // self.block_size))

    def __repr__(self) -> str:
        return f"<LlamaCppEngine {self.name!r} ({self.path.name}), {self.n_ctx} cache tokens>"

    # --- the Engine protocol (the rest is SteppingEngine's) ------------------------------------

    def stats(self) -> EngineStats:
        with self._state:
            s = dataclasses.replace(self._stats)
            s.running = len(self._running)
            s.waiting = len(self._waiting) + len(self._inbox)
            s.cache_blocks_used = self._blocks_in_use()
            s.prefill_tokens_cached = self._cached_tokens
            s.preemptions = self._preemptions
            s.evicted_blocks = self._evicted_blocks
        return s

    def cache_state(self) -> CacheState:
        with self._state:
            return CacheState(self.name, self.block_size, self.n_ctx // self.block_size, self._blocks_in_use(),
                              frozenset(self._holders))

    def _blocks_in_use(self) -> int:
        """Blocks that running sequences hold, shared ones once (kept prefixes are cached, not in use)."""
        held, partial = set(), 0
        for seq, slot in self._slot_of.items():
            held.update(self._chains.get(slot, ()))
            partial += seq.num_computed % self.block_size > 0
        return len(held) + partial

    def reset_prefix_cache(self) -> bool:
        """Forget every kept prefix (running sequences keep theirs)."""
        with self._state:
            for key in list(self._kept):
                self._drop_kept(key)
        return True

    def _context_cells(self) -> dict[int, int]:
        """Positions each slot holds in llama.cpp's context (its last + 1), for tests: read between steps."""
        pos_max = self._lc.llama_memory_seq_pos_max
        return {slot: n + 1 for slot in range(MAX_SLOTS) if (n := pos_max(self._memory, slot)) >= 0}

    # --- SteppingEngine's hooks ------------------------------------------------------------------

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.n_ctx:
            raise RequestError(f"request needs {num_tokens} tokens of KV cache; engine {self.name!r} holds {self.n_ctx}")

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def _admit(self, arrived: list[Sequence]) -> None:
        for seq in arrived:
            queue_by_priority(self._waiting, seq)

    def _queued(self) -> list[Sequence]:
        return list(self._waiting) + list(self._running)

    def _release(self, seq: Sequence) -> None:
        """A sequence leaves: its cells leave the context, its KV state kept as a prefix others can start from."""
        if seq in self._running:
            self._running.remove(seq)
            self._cache_full = False
        elif seq in self._waiting:
            self._waiting.remove(seq)
        slot = self._slot_of.pop(seq, None)
        if slot is not None:
            if not self._closed:
                self._keep(slot, seq.token_ids[:seq.num_computed], seq.prefill_only)
            self._evict(slot)

    def _free_resources(self) -> None:
        self._kept.clear()
        if self._ctx:
            self._lc.llama_free(self._ctx)
            self._lc.llama_model_free(self._model)
            self._ctx = self._model = None

    # --- slots and prefixes ---------------------------------------------------------------------

    def _evict(self, slot: int) -> None:
        """Free a running sequence's slot: its cells go, except those other slots share."""
        self._lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._forget_chain(slot)
        self._source.pop(slot, None)
        self._free_slots.append(slot)

    def _keep(self, slot: int, tokens: list[int], prefill: bool) -> None:
        """Copy a finishing slot's KV state to host memory, as a prefix later prompts can start from."""
        n, bs = len(tokens), self.block_size
        if (n < bs and not prefill) or n > self.n_ctx:
            return  # no full block a prompt could start from, or more than the kept prefixes may hold
        chain = self._chains.get(slot, [])
        candidates = set(self._holders.get(chain[-1], ()) if chain else self._prefill_tails.get(ROOT_HASH, ()))
        if slot in self._source:
            candidates.add(self._source[slot])
        for key in candidates & self._kept.keys():
            held = self._kept[key]
            if held.tokens[:n] == tokens and (not prefill or (held.prefill and len(held.tokens) == n)):
                self._kept.move_to_end(key)  # kept already (a prompt served from it, a prefix prefilled twice)
                return
            if len(held.tokens) < n and not held.prefill and tokens[:len(held.tokens)] == held.tokens:
                self._drop_kept(key)  # this one holds all of it and more (the next turn of a chat)
        size = self._lc.llama_state_seq_get_size(self._ctx, slot)
        state = (ctypes.c_uint8 * size)()
        if self._lc.llama_state_seq_get_data(self._ctx, state, size, slot) != size:
            logger.warning("engine %s: could not copy the KV state of slot %d; its prefix is not kept", self.name, slot)
            return
        while self._kept and self._kept_tokens + n > self.n_ctx:
            self._drop_kept(next(iter(self._kept)))
        key = next(self._kept_ids)
        self._kept[key] = _Kept(tokens, state, prefill)
        self._kept_tokens += n
        self._chains[key] = list(chain)
        for h in chain:
            self._holders.setdefault(h, set()).add(key)
        if prefill and n % bs:
            self._prefill_tails.setdefault(chain[-1] if chain else ROOT_HASH, set()).add(key)

    def _drop_kept(self, key: int) -> None:
        self._kept_tokens -= len(self._kept.pop(key).tokens)
        self._forget_chain(key)

    def _restore(self, key: int, slot: int, length: int) -> bool:
        """Put a kept prefix's first ``length`` tokens back into the context as ``slot``'s cells."""
        kept = self._kept[key]
        if not self._lc.llama_state_seq_set_data(self._ctx, kept.state, len(kept.state), slot):
            return False  # no run of free cells long enough: the prompt is computed instead
        if length < len(kept.tokens):
            self._lc.llama_memory_seq_rm(self._memory, slot, length, -1)
        self._kept.move_to_end(key)  # recently useful: dropped last
        self._source[slot] = key
        return True

    def _forget_chain(self, key: int) -> None:
        for parent in [p for p, tails in self._prefill_tails.items() if key in tails]:
            self._prefill_tails[parent].discard(key)
            if not self._prefill_tails[parent]:
                del self._prefill_tails[parent]
        for h in self._chains.pop(key, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[h]
                    self._evicted_blocks += 1

    def _next_blocks(self, slot: int, token_ids: list[int], num_computed: int) -> list[int]:
        """Hashes of the full blocks ``slot`` completes up to ``num_computed``, past those it has named."""
        chain = self._chains.get(slot, [])
        bs, parent, out = self.block_size, chain[-1] if chain else ROOT_HASH, []
        for idx in range(len(chain), num_computed // bs):
            parent = hash_block(parent, token_ids[idx * bs:(idx + 1) * bs])
            out.append(parent)
        return out

    def _register(self, slot: int, token_ids: list[int], num_computed: int) -> None:
        """Name the full blocks ``slot`` holds, so later prompts can start from them."""
        new = self._next_blocks(slot, token_ids, num_computed)
        self._chains.setdefault(slot, []).extend(new)
        for h in new:
            self._holders.setdefault(h, set()).add(slot)

    def _longest_prefix(self, token_ids: list[int], limit: int, chain: list[int]) -> tuple[int | None, int]:
        """The resident key sharing the longest prefix with ``token_ids[:limit]``, and its length.

        Whole blocks count, as in the torch engine's paged cache (the accounting and the
        placement plugin's hash chains are the same on both), plus the partly filled last
        block of a kept prefill that the prompt continues (the torch engine copies those rows)."""
        depth = 0
        while depth < len(chain) and chain[depth] in self._holders:
            depth += 1
        matched = depth * self.block_size
        parent = chain[depth - 1] if depth else ROOT_HASH
        for key in self._prefill_tails.get(parent, ()):
            held = self._kept[key].tokens
            if matched < len(held) <= limit and token_ids[matched:len(held)] == held[matched:]:
                return key, len(held)
        if depth == 0:
            return None, 0
        holders = self._holders[chain[depth - 1]]
        running = [key for key in holders if key < MAX_SLOTS]  # shared in place: no copy
        return running[0] if running else min(holders, key=lambda k: len(self._kept[k].tokens)), matched

    def _take_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def _start_from_prefix(self, seq: Sequence, slot: int, chain: list[int]) -> None:
        limit = len(seq.token_ids) if seq.prefill_only else len(seq.token_ids) - 1
        source, length = self._longest_prefix(seq.token_ids, limit, chain)
        if source is not None and length:
            if source < MAX_SLOTS:
                self._lc.llama_memory_seq_cp(self._memory, source, slot, 0, length)
            elif not self._restore(source, slot, length):
                length = 0
        seq.num_computed = length
        self._register(slot, seq.token_ids, length)
        if seq.num_cached is None:
            seq.num_cached = min(length, seq.num_prompt_tokens)
            self._cached_tokens += seq.num_cached

    # --- the step ----------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, new tokens) pairs; running ones first, then waiting ones by priority."""
        for seq in [s for s in (*self._running, *self._waiting) if s.future.cancelled()]:
            self._release(seq)
            self._stats.requests_cancelled += 1
        budget = self.max_num_batched_tokens
        step = []
        for seq in self._running:
            if budget <= 0:
                break
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            step.append((seq, n))
            budget -= n
        # Blocks this step computes: a waiting prompt whose next block is among them waits one
        # step and then shares it, rather than computing it a second time.
        computing = {h for seq, n in step for h in self._next_blocks(self._slot_of[seq], seq.token_ids,
                                                                     seq.num_computed + n)}
        deferred = []
        while self._waiting and not self._cache_full and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            limit = len(seq.token_ids) if seq.prefill_only else len(seq.token_ids) - 1
            chain = block_hashes(seq.token_ids, self.block_size, limit)
            depth = next((i for i, h in enumerate(chain) if h not in self._holders), len(chain))
            if depth < len(chain) and chain[depth] in computing:
                deferred.append(self._waiting.popleft())
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._waiting.popleft()
            self._slot_of[seq] = slot
            self._start_from_prefix(seq, slot, chain)
            self._running.append(seq)
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            computing.update(chain[seq.num_computed // self.block_size:(seq.num_computed + n) // self.block_size])
            step.append((seq, n))
            budget -= n
        self._waiting.extendleft(reversed(deferred))
        return step

    def _step(self) -> None:
        with self._state:
            step = self._schedule()
        work = [(seq, n) for seq, n in step if n]
        if not work:
            with self._state:
                for seq, _ in step:  # prefills served whole from the cache
                    self._finish_prefill(seq)
            return
        tokens, positions, slots, wants = [], [], [], []
        for seq, n in work:
            first = seq.num_computed
            tokens += seq.token_ids[first:first + n]
            positions += range(first, first + n)
            slots += [self._slot_of[seq]] * n
            wants += [False] * (n - 1) + [first + n == len(seq.token_ids) and not seq.prefill_only]
        start = time.perf_counter()
        rc = self._lc.llama_decode(self._ctx, self._batch.fill(tokens, positions, slots, wants))
        if rc == 1:  # no room in the cache for this step: make room, then try again
            with self._state:
                self._make_room()
            return
        if rc != 0:
            with self._state:
                for seq, _ in step:
                    slot = self._slot_of.pop(seq, None)
                    if slot is not None:
                        self._evict(slot)  # its cells may hold part of the failed step: not kept
                    self._fail(seq, RuntimeError(f"llama.cpp decode failed ({rc}) for request {seq.request_id}"))
            return
        n_out = sum(wants)
        logits = None
        if n_out:
            pointer = self._lc.llama_get_logits(self._ctx)
            logits = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(n_out, self.vocab_size)).copy())
        with self._state:
            row = 0
            for seq, n in step:
                prompt_part = max(0, min(n, seq.num_prompt_tokens - seq.num_computed))
                self._stats.prefill_tokens_computed += prompt_part
                seq.num_computed += n
                self._register(self._slot_of[seq], seq.token_ids, seq.num_computed)
                if seq.num_computed < len(seq.token_ids):
                    continue  # a long prompt, prefilled in chunks
                if seq.prefill_only:
                    self._finish_prefill(seq)
                    continue
                self._choose(seq, logits[row])
                row += 1
            self._stats.record_step(len(step), time.perf_counter() - start, all(n == 1 for _, n in step))

    def _finish_prefill(self, seq: Sequence) -> None:
        chain = tuple(self._chains.get(self._slot_of[seq], ()))
        self._complete(seq, PrefillHandle(self.name, len(seq.token_ids), seq.num_cached or 0, self.block_size, chain))

    def _make_room(self) -> None:
        """The cache is full of running sequences: recompute the newest later (kept prefixes hold no cells)."""
        if len(self._running) <= 1:
            seq = self._running[0] if self._running else self._waiting[0]
            self._fail(seq, RequestError(f"request {seq.request_id} does not fit in the KV cache of "
                                         f"engine {self.name!r} ({self.n_ctx} tokens)"))
            return
        victim = self._running.pop()
        self._evict(self._slot_of.pop(victim))
        victim.num_computed = 0
        self._waiting.appendleft(victim)
        self._preemptions += 1
        self._cache_full = True
