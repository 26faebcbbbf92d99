"""The embedded torch engine: continuous batching over a prefix-cached, paged KV cache.

One background thread per engine runs steps. Requests submitted from any thread (Dask
tasks running on the worker) land in an inbox and join the running batch at the next
step; finished ones leave it. Serves CPU workers and tests; GPU workers can run it too,
though there the vLLM engine is the production backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from daskllm import config, models
from daskllm.engines import compute, sizing
from daskllm.engines.cuda_graphs import StepGraphs
from daskllm.engines.kv_cache import BlockManager
from daskllm.engines.llama import LlamaModel, StepInput
from daskllm.engines.protocol import CacheState, EngineStats, PrefillHandle, RequestError
from daskllm.engines.scheduler import Scheduler, Sequence
from daskllm.engines.stepping import SteppingEngine

# On CPU a step of 256 prompt tokens is as efficient per token as one of 2,048 (smollm2, 2
# threads: bench/prefill_profile.py --step-tokens) and takes about a second at a 4K context.
CPU_PREFILL_CHUNK = 256
CPU_LONG_PREFILL = 1024

logger = logging.getLogger(__name__)


class TorchEngine(SteppingEngine):
    """A resident model with continuous batching and a prefix cache (the Engine protocol)."""

    def __init__(self, model: str | os.PathLike, *, name: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, block_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, num_threads: int | None = None,
                 batch_invariant: bool | None = None, cuda_graphs: bool | None = None, backend: str | None = None,
                 prefill_chunk_tokens: int | str | None = None, long_prefill_tokens: int | str | None = None,
                 gpu_memory_utilization: float | None = None):
        phases = _Phases()
        path = models.resolve(model)
        phases.done("recipe")  # a recipe is built into the model cache once
        self.name = name or models.model_name(model)
        self.path = path
        self.block_size = block_size or config.get("engine.block-size")
        num_threads = num_threads or config.get("engine.num-threads")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _resolve_dtype(dtype or config.get("engine.dtype"), device)
        # CPU work goes to the process's compute thread (engines/compute.py); a GPU's stays on
        # this engine's threads, where its CUDA graphs are captured and replayed.
        on_cpu = torch.device(device).type == "cpu"
        self._compute = compute.run if on_cpu else _inline
        # Limits that follow the device (engines/sizing.py): a GPU batches wider.
        max_num_seqs = sizing.limit(max_num_seqs, "max-num-seqs", on_cpu)
        max_num_batched_tokens = sizing.limit(max_num_batched_tokens, "max-num-batched-tokens", on_cpu)
        kv_cache_tokens = sizing.limit(kv_cache_tokens, "kv-cache-tokens", on_cpu)
        if num_threads:
            compute.set_num_threads(int(num_threads))

        if batch_invariant is None:
            batch_invariant = config.get("engine.batch-invariant", True)
        allocated = 0 if on_cpu else torch.cuda.memory_allocated(device)
        self.model = self._compute(LlamaModel, path, device=device, dtype=dtype,
                                   batch_invariant=bool(batch_invariant), backend=backend)
        if kv_cache_tokens == "auto":  # a GPU's: what its memory holds beside the weights
            weights = torch.cuda.memory_allocated(device) - allocated
            kv_cache_tokens = self._kv_cache_tokens_for_memory(
                weights, max_num_batched_tokens, max_num_seqs,
                sizing.gpu_memory_utilization(gpu_memory_utilization))
        self.max_model_len = self.model.config.max_model_len
        self.vocab_size = self.model.config.vocab_size
        self._load_tokenizer(path)
        num_blocks = kv_cache_tokens // self.block_size
        if num_blocks < 1:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens} holds no block of {self.block_size} tokens")
        phases.done("model")  # weights read (or drawn) and prepared, the tokenizer loaded
        self._compute(self.model.allocate_cache, num_blocks, self.block_size)
        phases.done("kv_cache")
        self._blocks = BlockManager(num_blocks, self.block_size)
        self._scheduler = Scheduler(self._blocks, max_num_seqs, max(max_num_batched_tokens, max_num_seqs),
                                    copy_rows=self.model.copy_rows,
                                    prefill_chunk=_auto(prefill_chunk_tokens, "prefill-chunk-tokens",
                                                        CPU_PREFILL_CHUNK if on_cpu else None),
                                    long_prefill=_auto(long_prefill_tokens, "long-prefill-tokens",
                                                       CPU_LONG_PREFILL if on_cpu else None),
                                    context_cost=self.model.context_cost if on_cpu else None)
        if cuda_graphs is None:
            cuda_graphs = config.get("engine.cuda-graphs", True)
        self._graphs = None
        step_tokens = max(max_num_batched_tokens, max_num_seqs)
        if self.model.device.type == "cuda" and self.model.backend.name == "triton":
            #: What the device was found to compute exactly (the attention paths; backends.TritonBackend.check).
            self.kernel_check = self.model.backend.prepare(
                self.model.device, self.model.dtype, self.model.projections(),
                lambda: StepGraphs(self.model, max_num_seqs, step_tokens, capture=False).walk(),
                min(8, os.cpu_count() or 1))
            phases.done("kernels")  # compiled in parallel (or read from Triton's cache), checked on the device
            if cuda_graphs:
                self._graphs = StepGraphs(self.model, max_num_seqs, step_tokens)
        phases.done("cuda_graphs")  # the steps captured
        #: Seconds each part of loading took (bench/engine_startup.py reports them).
        self.load_phases = phases.seconds
        eos = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._start_loop(eos, EngineStats(cache_blocks_total=num_blocks))

    def _kv_cache_tokens_for_memory(self, weights: int, step_tokens: int, step_seqs: int, utilization: float) -> int:
        c, device = self.model.config, self.model.device
        free, total = torch.cuda.mem_get_info(device)
        memory = sizing.DeviceMemory(total=total, free=free, weights=weights)
        dtype_bytes = torch.empty((), dtype=self.model.dtype).element_size()
        activations = sizing.step_activation_bytes(
            c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.vocab_size,
            max(step_tokens, step_seqs), step_seqs, dtype_bytes)
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes  # K and V, every layer
        tokens = sizing.kv_cache_tokens_for(memory, utilization=utilization, activations=activations,
                                            bytes_per_token=per_token, block_size=self.block_size)
        if tokens < self.block_size:
            raise ValueError(sizing.no_room(self.name, memory, utilization, activations))
        logger.info("engine %r: KV cache of %d tokens (%.1f GiB) from gpu-memory-utilization %s", self.name, tokens,
                    tokens * per_token / (1 << 30), utilization)
        return tokens

    def __repr__(self) -> str:
        return (f"<TorchEngine {self.name!r} on {self.model.device} ({str(self.model.dtype).removeprefix('torch.')}), "
                f"{self._blocks.num_blocks} blocks>")

    # --- the Engine protocol (the rest is SteppingEngine's) ------------------------------------

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

    # --- SteppingEngine's hooks ------------------------------------------------------------------

    def _check_fits(self, num_tokens: int) -> None:
        capacity = self._blocks.num_blocks * self.block_size
        if num_tokens > capacity:
            raise RequestError(f"request needs {num_tokens} tokens of KV cache; engine {self.name!r} holds {capacity}")

    def _has_work(self) -> bool:
        return self._scheduler.has_work()

    def _admit(self, arrived: list[Sequence]) -> None:
        self._scheduler.add(arrived)

    def _release(self, seq: Sequence) -> None:
        self._scheduler.finish(seq)

    def _queued(self) -> list[Sequence]:
        return list(self._scheduler.waiting) + self._scheduler.running

    def _free_resources(self) -> None:
        self.model.k_cache = self.model.v_cache = None
        self._graphs = None

    # --- the step ---------------------------------------------------------------------------------

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
            choices = self._compute(self._forward, step)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            logger.exception("engine %s: forward pass failed", self.name)
            with self._state:
                for seq, _ in step:
                    self._fail(seq, exc)
            return
        with self._state:
            self._postprocess(step, choices)
            self._stats.record_step(len(step), time.perf_counter() - start, all(n == 1 for _, n in step))

    def _forward(self, step: list[tuple[Sequence, int]]) -> list[int | torch.Tensor]:
        """Run the step; per sequence that gets a next token, in step order, the token itself
        (greedy, chosen on the device) or its row of logits (on the CPU, for the rules of
        :meth:`_choose`)."""
        bs = self.block_size
        input_ids, positions, slots, seqs, choosers = [], [], [], [], []
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
                choosers.append((row + n - 1, seq))
        if not input_ids:
            return []
        logit_rows = [row for row, _ in choosers]
        bucket = None
        if self._graphs is not None:
            tiles = self.model.backend.step_tiles(seqs)
            decode = len(seqs) == len(input_ids)
            bucket = self._graphs.bucket(len(input_ids), len(seqs), decode, len(tiles[0]), len(tiles[1]),
                                         len(logit_rows))
        if bucket is not None:
            logits = self._graphs.run(bucket, input_ids, positions, slots, tiles, [s[3] for s in seqs], logit_rows)
            if bucket.decode and len(choosers) < len(seqs):  # a prompt's last token, prefilled alone: no token wanted
                logits = logits[logit_rows]
        else:
            def as_tensor(values):  # int32, as the graphs' buffers: the kernels compiled for those serve here too
                return torch.tensor(values, dtype=torch.int32, device=self.model.device)

            logits = self.model.forward(StepInput(as_tensor(input_ids), as_tensor(positions), as_tensor(slots), seqs,
                                                  logit_rows))
        return _choices(logits, [seq for _, seq in choosers])

    def _postprocess(self, step: list[tuple[Sequence, int]], choices: list[int | torch.Tensor]) -> None:
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
            choice = choices[row]
            if isinstance(choice, int):
                self._accept(seq, choice)
            else:
                self._choose(seq, choice)
            row += 1


def _choices(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | torch.Tensor]:
    """Greedy tokens of plain greedy requests, taken on the logits' device, and the CPU logits
    rows of the rest (grammars, sampling, log-probabilities, allowed tokens): one transfer each."""
    plain = [s.matcher is None and s.params.greedy and s.params.logprobs is None and not s.params.allowed_token_ids
             for s in seqs]
    out: list[int | torch.Tensor] = [0] * len(seqs)
    if any(plain):
        for i, token in enumerate(logits.argmax(dim=-1).tolist()):
            out[i] = token
    if not all(plain):
        rest = [i for i, p in enumerate(plain) if not p]
        for i, row in zip(rest, logits[rest].cpu()):
            out[i] = row
    return out


class _Phases:
    """Wall time between marks: {phase: seconds}."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def _inline(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _auto(value: int | str | None, key: str, device_default: int | None) -> int | None:
    """A scheduling limit: the argument, else ``engine.<key>``; ``auto``: the device's default;
    null or 0: none."""
    if value is None:
        value = config.get(f"engine.{key}", "auto")
    if value == "auto":
        return device_default
    return int(value) if value else None


def _resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)
