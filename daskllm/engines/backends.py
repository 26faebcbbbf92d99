"""How the Llama forward pass computes on a device: products, norms, rotary and cache writes, attention.

Greedy decoding must give the same tokens whether a request runs alone, batched with others,
or on top of a cached prefix. Float arithmetic is only reproducible if every number is
computed by the same sequence of operations, so no backend lets the rows of a step change a
row's reductions. Everything else in the forward pass is elementwise and needs no care; a
backend may fuse it (the residual add with the norm after it, SiLU x up, the rotary embedding
with the cache write) as long as it rounds where torch's separate operations round.

* :class:`CpuBackend`: projections are :class:`~daskllm.engines.invariant.Linear` (oneDNN's
  batch-invariant kernel); attention reads keys in tiles of one fixed length (``KEY_TILE_BLOCKS``
  cache blocks), in position order, with an online softmax: every reduction runs over the
  same length whatever the batch, and tiles past a query's position add exact zeros. Runs of
  tiles are computed by batched calls, which changes no result (see ``_attend``). It
  accumulates in float32 whatever the model's dtype.
* :class:`TritonBackend` (CUDA, or any device under ``TRITON_INTERPRET=1``): the kernels of
  :mod:`daskllm.engines.triton_kernels`, whose reduction order is fixed whatever the row
  count, with the fast paths (a product's small-row tiles, attention's decode tiles and split)
  kept only where the device gives them the same bits (:meth:`TritonBackend.prepare`).
  ``batch_invariant=False`` trades that for cuBLAS products (faster at large batches; greedy
  tokens may then depend on the batch); the fused kernels and attention are the same either way.

Both read the same KV cache layout: [block, KV head, row in block, d] per layer.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from daskllm import config, models
from daskllm.engines.invariant import Linear, pad_rows

logger = logging.getLogger(__name__)

PREFILL_TILE = 256  # CPU: query positions per attention call, bounding memory on long prompts
KEY_TILE_BLOCKS = 4  # CPU: cache blocks per key tile (64 keys with 16-token blocks): one fixed length


@dataclass(slots=True)
class StepInput:
    """The tokens of one engine step, flattened across sequences.

    ``seqs`` lists, per sequence, (first row in the flat batch, number of new tokens,
    tokens already in the cache before this step, block table).
    """

    input_ids: torch.Tensor  # [N] integers (int32 or int64)
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]: flat cache slot each new token's K/V goes to
    seqs: list[tuple[int, int, int, list[int]]]
    logit_rows: list[int]  # rows whose next-token logits are wanted


@dataclass(frozen=True, slots=True)
class Heads:
    """The attention shape of a model: query heads, KV heads, their size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class Backend(Protocol):
    name: str

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """A projection ``x -> x @ weight.T + bias`` with the weight prepared once."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next norm: ``h + delta`` (h's storage may be reused) and its RMSNorm."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection's output [N, 2I] (gate first)."""

    def tokens(self, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               block_size: int) -> object:
        """What every layer's rotary embedding and cache write of this step share (from the
        rotary tables [positions, d] and each new token's cache slot)."""

    def rope_and_cache(self, qkv: torch.Tensor, tokens, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: Heads,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        """From the fused QKV projection [N, (H + 2 Hkv) d]: q [N, H, d] rotated, with the
        rotated k and v written into one layer's cache (q_norm/k_norm: per-head RMSNorm first)."""

    def plan(self, step: StepInput, block_size: int) -> object:
        """What every layer's attention call of this step shares (tables, masks)."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan) -> torch.Tensor:
        """Causal attention of q [N, H, d] over one layer's cache, the step's K/V already written."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, in x's dtype: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(slots=True)
class _Tokens:
    """A step's rotary values and cache places, per new token, for torch's elementwise ops."""

    cos: torch.Tensor  # [N, 1, d]
    sin: torch.Tensor
    block: torch.Tensor  # [N]: the cache block each token's K/V goes to
    offset: torch.Tensor  # [N]: its row in that block


def select(device: torch.device, heads: Heads, *, batch_invariant: bool = True, kind: str | None = None) -> Backend:
    """The backend for a device and a model's attention shape: Triton kernels on CUDA, the CPU
    backend elsewhere; ``kind`` forces one ("cpu" or "triton")."""
    kind = kind or ("triton" if device.type == "cuda" else "cpu")
    if kind == "triton":
        return TritonBackend(heads, batch_invariant)
    if kind == "cpu":
        return CpuBackend(heads.num_heads // heads.num_kv_heads)
    raise ValueError(f"unknown engine backend {kind!r} (cpu or triton)")


# --- CPU ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    """One attention call of a step: its query rows in the flat batch and what every layer reuses."""

    rows: slice | list[int]
    b: int  # sequences
    t: int  # query positions per sequence
    m: int  # score rows per KV head: g * t padded (see invariant.pad_rows)
    spans: list[tuple[torch.Tensor, torch.Tensor | None, int]]  # runs of key tiles, in position order:
    # their blocks [B * n * KEY_TILE_BLOCKS], their mask [1, B, n, M, key tile], True where a key lies
    # past the row's position (None: no key does), and n, the tiles in the run


class CpuBackend:
    """oneDNN products and tiled attention: batch-invariant on CPU (module docstring)."""

    name = "cpu"

    def __init__(self, group: int):
        self.group = group  # query heads per KV head

    def linear(self, weight, bias=None):
        return Linear(weight, bias)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps):
        h = h + delta
        return h, rms_norm(h, weight, eps)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def tokens(self, positions, slots, cos, sin, block_size):
        return _Tokens(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), slots // block_size,
                       slots % block_size)

    def rope_and_cache(self, qkv, tokens: _Tokens, k_cache, v_cache, heads, q_norm, k_norm, eps):
        n, (h, hkv, d) = qkv.shape[0], (heads.num_heads, heads.num_kv_heads, heads.head_dim)
        if q_norm is not None:
            q = rope(rms_norm(qkv[:, :h * d].reshape(n, h, d), q_norm, eps), tokens.cos, tokens.sin)
            k = rope(rms_norm(qkv[:, h * d:(h + hkv) * d].reshape(n, hkv, d), k_norm, eps), tokens.cos, tokens.sin)
        else:  # q and k rotated by one call: their heads sit side by side in qkv
            qk = rope(qkv[:, :(h + hkv) * d].view(n, h + hkv, d), tokens.cos, tokens.sin)
            q, k = qk[:, :h], qk[:, h:]
        k_cache[tokens.block, :, tokens.offset] = k
        v_cache[tokens.block, :, tokens.offset] = qkv[:, (h + hkv) * d:].view(n, hkv, d)
        return q

    def plan(self, step: StepInput, block_size: int) -> list[_Group]:
        """The step's queries as attention calls: all decodes in one, each prefill in tiles."""
        groups = []
        decodes = [s for s in step.seqs if s[1] == 1]
        device = step.input_ids.device
        if decodes:
            rows = [s[0] for s in decodes]
            # A pure decode step (the common case) needs no gather of its query rows.
            index = slice(0, len(rows)) if rows == list(range(step.input_ids.shape[0])) else rows
            groups.append(_group(index, [[s[2]] for s in decodes], [s[3] for s in decodes], block_size, self.group,
                                 device))
        for start, count, cached, table in step.seqs:
            if count == 1:
                continue
            for t0 in range(0, count, PREFILL_TILE):
                t1 = min(count, t0 + PREFILL_TILE)
                groups.append(_group(slice(start + t0, start + t1), [list(range(cached + t0, cached + t1))],
                                     [table], block_size, self.group, device))
        return groups

    def attend(self, q, k_cache, v_cache, plan: list[_Group]):
        if len(plan) == 1 and plan[0].rows == slice(0, q.shape[0]):
            return _attend(q.view(plan[0].b, plan[0].t, *q.shape[1:]), k_cache, v_cache, plan[0]).view_as(q)
        out = torch.empty_like(q)  # the groups cover every row
        for grp in plan:
            out[grp.rows] = _attend(q[grp.rows].view(grp.b, grp.t, *q.shape[1:]), k_cache, v_cache, grp).flatten(0, 1)
        return out


SPAN_FLOATS = 1 << 17  # CPU: most scores held at once per KV head (512 KiB, cache-sized): tiles per call


def _group(rows, positions: list[list[int]], tables: list[list[int]], bs: int, g: int, device) -> _Group:
    """One attention call's key tiles (blocks and masks), for queries at ``positions`` [B][T]."""
    b, t = len(positions), len(positions[0])
    m = pad_rows(g * t)
    n_blocks = max(p[-1] for p in positions) // bs + 1
    n_blocks = -(-n_blocks // KEY_TILE_BLOCKS) * KEY_TILE_BLOCKS  # whole tiles: every tile has one length
    table = torch.tensor([blocks[:n_blocks] + [0] * (n_blocks - len(blocks[:n_blocks])) for blocks in tables],
                         dtype=torch.long, device=device)
    # Rows are (query head within its KV group, position), then padding rows that see key 0.
    row_pos = torch.tensor([p * g + [0] * (m - g * t) for p in positions], device=device).view(1, b, 1, m, 1)
    width = KEY_TILE_BLOCKS * bs
    lowest = min(p[0] for p in positions)
    # Tiles go in runs, each computed by one batched call (the run's length changes no result:
    # see _attend); a run's scores stay within SPAN_FLOATS per KV head.
    per_run = max(1, SPAN_FLOATS // (b * m * width))
    spans = []
    for first in range(0, n_blocks, per_run * KEY_TILE_BLOCKS):
        last = min(n_blocks, first + per_run * KEY_TILE_BLOCKS)
        n = (last - first) // KEY_TILE_BLOCKS
        key_pos = torch.arange(first * bs, last * bs, device=device).view(1, 1, n, 1, width)
        # A run every query row sees whole needs no mask (padding rows, discarded, may see more).
        masked = None if last * bs - 1 <= lowest else key_pos > row_pos
        spans.append((table[:, first:last].reshape(-1), masked, n))
    return _Group(rows, b, t, m, spans)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, grp: _Group) -> torch.Tensor:
    """Causal attention of queries ``q`` [B, T, H, d] over the cached K/V of ``grp``'s key tiles.

    The online softmax over key tiles, in position order. Per tile, the scores, the running
    maximum, the weights, their sum and their product with the values are each one elementwise
    operation or one product over one tile's fixed length, so a run of tiles computes them in
    one batched call with the same results as tile by tile (a running maximum is exact in any
    order); only the rescaled accumulation goes tile by tile, in order, where tiles past a row's
    position add exact zeros."""
    b, t, heads, d = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    g, m = heads // kv_heads, grp.m
    width = KEY_TILE_BLOCKS * bs
    # Everything is KV-head major, as the cache is stored (llama.allocate_cache): one head's
    # gathered blocks are then its key tiles, contiguous, with no copy after the gather.
    k_heads, v_heads = k_cache.transpose(0, 1), v_cache.transpose(0, 1)  # [Hkv, block, row, d]
    # Rows are (query head within its KV group, position): [Hkv, B, g*T -> M, d]
    rows = q.float().view(b, t, kv_heads, g, d).permute(2, 0, 3, 1, 4).reshape(kv_heads, b, g * t, d)
    rows = (F.pad(rows, (0, 0, 0, m - g * t)) * (1.0 / math.sqrt(d))).unsqueeze(2)  # [Hkv, B, 1, M, d]
    peak = rows.new_full((kv_heads, b, 1, m, 1), float("-inf"))
    total = rows.new_zeros((kv_heads, b, m, 1))
    acc = rows.new_zeros((kv_heads, b, m, d))
    for blocks, masked, n in grp.spans:
        keys = k_heads.index_select(1, blocks).view(kv_heads, b, n, width, d)
        values = v_heads.index_select(1, blocks).view(kv_heads, b, n, width, d)
        scores = torch.matmul(rows, keys.float().transpose(-1, -2))
        if masked is not None:
            scores.masked_fill_(masked, float("-inf"))
        peaks = torch.maximum(torch.cummax(scores.amax(dim=-1, keepdim=True), dim=2).values, peak)
        scales = torch.exp(torch.cat([peak, peaks[:, :, :-1]], dim=2) - peaks)  # 1 where a tile is all masked
        weights = scores.sub_(peaks).exp_()  # in place: the scores are not read again
        sums = weights.sum(dim=-1, keepdim=True)
        products = torch.matmul(weights, values.float())
        for i in range(n):  # in position order
            total = total * scales[:, :, i] + sums[:, :, i]
            acc = acc * scales[:, :, i] + products[:, :, i]
        peak = peaks[:, :, -1:]
    attn = (acc / total)[:, :, :g * t]
    return attn.view(kv_heads, b, g, t, d).permute(1, 3, 0, 2, 4).reshape(b, t, heads, d).to(q.dtype)


# --- Triton -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class PagedPlan:
    """A step's attention metadata for the paged kernel (see triton_kernels.attention).

    Tile rows are (sequence, first row of q, rows, position of the first row); a tile of no
    rows is padding. Decode tiles hold one position each and run the decode layout (and,
    when they are too few to fill the GPU, the split over the context); prefill tiles hold up
    to the prefill layout's positions each."""

    decode_tiles: torch.Tensor  # [Td, 4] int32
    prefill_tiles: torch.Tensor  # [Tp, 4] int32
    tables: torch.Tensor  # [S, W] int32: each sequence's cache blocks
    split_chunks: int = 0  # chunk programs per decode tile (0: one program walks the whole context)


class CublasLinear:
    """A projection by cuBLAS (``F.linear``): not batch-invariant."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class _TritonTokens:
    """A step's new tokens as the fused rotary kernel reads them."""

    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor  # the whole rotary tables [positions, d]
    sin: torch.Tensor


class TritonBackend:
    """The Triton kernels (module docstring); imported on first use, so CPU-only installs never need Triton."""

    name = "triton"

    def __init__(self, heads: Heads, batch_invariant: bool = True):
        # Compiled kernels are kept beside the built models (daskllm.models.cache-dir), so an
        # engine started again where that directory persists compiles nothing; a
        # TRITON_CACHE_DIR the user set wins. Triton reads it when it first compiles.
        os.environ.setdefault("TRITON_CACHE_DIR", str(models.cache_dir() / "triton"))
        from daskllm.engines import triton_kernels  # fail early, with Triton's own error, where it is missing

        self.kernels = triton_kernels
        self.batch_invariant = batch_invariant
        plans = config.get("engine.matmul-plans", None)
        #: Tuned tile plans by weight shape (daskllm.engine.matmul-plans), else the built-in ones.
        self.matmul_plans = triton_kernels.load_plans(plans) if batch_invariant and plans else {}
        self.heads = heads
        # Decode tiles of the prefill tile's rows and no split until check() finds the faster ones exact here.
        self.layout = triton_kernels.AttentionLayout()
        self.positions_per_tile = triton_kernels.positions_per_tile(heads.num_heads // heads.num_kv_heads,
                                                                    self.layout.prefill_rows)
        self.sms = 0  # the device's streaming multiprocessors: read at the first split decision

    def linear(self, weight, bias=None):
        if not self.batch_invariant:
            return CublasLinear(weight, bias)
        tuned = self.matmul_plans.get(self.kernels.plan_key(weight))
        if tuned is not None:
            try:
                return self.kernels.Product(weight, bias, tuned)
            except ValueError as error:  # a plan that could change a row's bits with the batch: not used
                logger.warning("daskllm.engine.matmul-plans: %s; the built-in plan serves instead", error)
        return self.kernels.Product(weight, bias)

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps):
        return self.kernels.add_rms_norm(h, delta, weight, eps)

    def silu_mul(self, gate_up):
        return self.kernels.silu_mul(gate_up)

    def tokens(self, positions, slots, cos, sin, block_size):
        return _TritonTokens(positions, slots, cos, sin)

    def rope_and_cache(self, qkv, tokens, k_cache, v_cache, heads, q_norm, k_norm, eps):
        return self.kernels.rope_and_cache(qkv, tokens.positions, tokens.cos, tokens.sin, tokens.slots, k_cache,
                                           v_cache, heads.num_heads, heads.num_kv_heads, heads.head_dim,
                                           q_norm=q_norm, k_norm=k_norm, eps=eps)

    # --- attention tiles ------------------------------------------------------------------------

    def step_tiles(self, seqs: list[tuple[int, int, int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """The step's decode tiles (a sequence with one new token) and prefill tiles, [T, 4] int32 each."""
        q_tile = self.positions_per_tile
        decode = [(i, start, 1, cached) for i, (start, count, cached, _) in enumerate(seqs) if count == 1]
        prefill = [(i, start + t0, min(q_tile, count - t0), cached + t0)
                   for i, (start, count, cached, _) in enumerate(seqs) if count > 1
                   for t0 in range(0, count, q_tile)]
        return (np.array(decode, dtype=np.int32).reshape(-1, 4), np.array(prefill, dtype=np.int32).reshape(-1, 4))

    def prefill_tile_capacity(self, tokens: int, max_seqs: int) -> int:
        """The most prefill tiles a step of ``tokens`` tokens can have (each prefill has 2+ tokens)."""
        return -(-tokens // self.positions_per_tile) + min(tokens // 2, max_seqs)

    def split_chunks(self, decode_tiles: int, max_context: int) -> int:
        """Programs per decode tile and KV head sharing its context's chunks, where (tile, KV head)
        programs alone are too few to fill the device (about two per SM); 0 where they are enough,
        or where the split is not exact here (``layout.split``). Either way a row gets the same bits."""
        if not self.sms:
            self.sms = torch.cuda.get_device_properties().multi_processor_count if torch.cuda.is_available() else 1
        programs = decode_tiles * self.heads.num_kv_heads
        chunks = -(-max_context // self.kernels.CHUNK_KEYS)
        if not self.layout.split or chunks < 2 or not 0 < programs < self.sms:
            return 0
        return min(chunks, -(-2 * self.sms // programs))

    # --- what this device computes exactly ----------------------------------------------------------

    def check(self, device: torch.device, dtype: torch.dtype) -> dict:
        """Which attention paths give the prefill tiles' bits on this device (``self_check``): the
        layout the steps then use. Every product's plan is verified by its first launch."""
        h = self.heads
        result = self.kernels.self_check(device, dtype, h.num_heads, h.num_kv_heads, h.head_dim)
        if not self.kernels.compiling_only():
            self.layout = result["layout"]
        return result

    def prepare(self, device: torch.device, dtype: torch.dtype, projections: Iterable, walk: Callable[[], None],
                workers: int) -> dict:
        """Compile every kernel the engine will launch, on ``workers`` threads at once rather than
        one at a time at first launch: the attention check's, every product config's (as their
        verification launches them) and those of the steps ``walk()`` runs, planned with the
        fastest layout. Then, for real: the attention layout this device computes exactly
        (:meth:`check`) and each product's verified plan."""
        self.layout = self.kernels.fast_layout(self.heads.num_heads // self.heads.num_kv_heads)
        products = [p for p in projections if isinstance(p, self.kernels.Product)]
        with self.kernels.compile_only(workers):
            self.check(device, dtype)
            for product in products:
                product.check()
            walk()
        result = self.check(device, dtype)
        for product in products:
            product.check()
        return result

    def plan(self, step: StepInput, block_size: int) -> PagedPlan:
        decode, prefill = self.step_tiles(step.seqs)
        width = max(len(s[3]) for s in step.seqs)
        tables = np.zeros((len(step.seqs), width), dtype=np.int32)
        for i, (_, _, _, table) in enumerate(step.seqs):
            tables[i, :len(table)] = table
        device = step.input_ids.device
        max_context = max(s[2] + s[1] for s in step.seqs)
        return PagedPlan(torch.from_numpy(decode).to(device), torch.from_numpy(prefill).to(device),
                         torch.from_numpy(tables).to(device), self.split_chunks(len(decode), max_context))

    def attend(self, q, k_cache, v_cache, plan: PagedPlan):
        out = torch.empty_like(q)
        layout = self.layout
        if plan.decode_tiles.shape[0]:
            self.kernels.paged_attention(q, k_cache, v_cache, plan.decode_tiles, plan.tables, out=out,
                                         tile_rows=layout.decode_rows, split_chunks=plan.split_chunks)
        if plan.prefill_tiles.shape[0]:
            self.kernels.paged_attention(q, k_cache, v_cache, plan.prefill_tiles, plan.tables, out=out,
                                         tile_rows=layout.prefill_rows)
        return out
