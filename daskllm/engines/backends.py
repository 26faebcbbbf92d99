"""How the Llama forward pass computes its reductions on a device: products, RMSNorm, attention.

Greedy decoding must give the same tokens whether a request runs alone, batched with others,
or on top of a cached prefix. Float arithmetic is only reproducible if every number is
computed by the same sequence of operations, so no backend lets the rows of a step change a
row's reductions. Everything else in the forward pass is elementwise and needs no care.

* :class:`CpuBackend`: projections are :class:`~daskllm.engines.invariant.Linear` (oneDNN's
  batch-invariant kernel); attention reads keys in tiles of one fixed length (``KEY_TILE_BLOCKS``
  cache blocks), in position order, with an online softmax: every reduction runs over the
  same length whatever the batch, and tiles past a query's position add exact zeros. Runs of
  tiles are computed by batched calls, which changes no result (see ``_attend``). It
  accumulates in float32 whatever the model's dtype.
* :class:`TritonBackend` (CUDA, or any device under ``TRITON_INTERPRET=1``): the kernels of
  :mod:`daskllm.engines.triton_kernels`, whose reduction order is fixed whatever the row
  count. ``batch_invariant=False`` trades that for cuBLAS and torch's own RMSNorm (faster
  products at large batches; greedy tokens may then depend on the batch); attention is the
  paged kernel either way.

Both read the same KV cache layout: [block, KV head, row in block, d] per layer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from daskllm import models
from daskllm.engines.invariant import Linear, pad_rows

PREFILL_TILE = 256  # CPU: query positions per attention call, bounding memory on long prompts
KEY_TILE_BLOCKS = 4  # CPU: cache blocks per key tile (64 keys with 16-token blocks): one fixed length


@dataclass(slots=True)
class StepInput:
    """The tokens of one engine step, flattened across sequences.

    ``seqs`` lists, per sequence, (first row in the flat batch, number of new tokens,
    tokens already in the cache before this step, block table).
    """

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long: flat cache slot each new token's K/V goes to
    seqs: list[tuple[int, int, int, list[int]]]
    logit_rows: list[int]  # rows whose next-token logits are wanted


class Backend(Protocol):
    name: str

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """A projection ``x -> x @ weight.T + bias`` with the weight prepared once."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def plan(self, step: StepInput, block_size: int) -> object:
        """What every layer's attention call of this step shares (tables, masks)."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan) -> torch.Tensor:
        """Causal attention of q [N, H, d] over one layer's cache, the step's K/V already written."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def select(device: torch.device, group: int, *, batch_invariant: bool = True, kind: str | None = None) -> Backend:
    """The backend for a device (``group``: query heads per KV head): Triton kernels on CUDA,
    the CPU backend elsewhere; ``kind`` forces one ("cpu" or "triton")."""
    kind = kind or ("triton" if device.type == "cuda" else "cpu")
    if kind == "triton":
        return TritonBackend(batch_invariant)
    if kind == "cpu":
        return CpuBackend(group)
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
    """A step's attention metadata for the paged kernel (see triton_kernels.paged_attention)."""

    tiles: torch.Tensor  # [T, 4] int32: sequence, first row, rows, first position
    tables: torch.Tensor  # [S, W] int32: each sequence's cache blocks


class TritonLinear:
    """A projection by ``product(x, weight, bias)``: the invariant Triton matmul, or F.linear."""

    __slots__ = ("weight", "bias", "product")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, product: Callable):
        self.weight, self.bias, self.product = weight, bias, product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class TritonBackend:
    """The Triton kernels (module docstring); imported on first use, so CPU-only installs never need Triton."""

    name = "triton"

    def __init__(self, batch_invariant: bool = True):
        # Compiled kernels are kept beside the built models (daskllm.models.cache-dir), so an
        # engine started again where that directory persists compiles nothing; a
        # TRITON_CACHE_DIR the user set wins. Triton reads it when it first compiles.
        os.environ.setdefault("TRITON_CACHE_DIR", str(models.cache_dir() / "triton"))
        from daskllm.engines import triton_kernels  # fail early, with Triton's own error, where it is missing

        self.kernels = triton_kernels
        self.batch_invariant = batch_invariant

    def linear(self, weight, bias=None):
        return TritonLinear(weight, bias, self.kernels.matmul if self.batch_invariant else F.linear)

    def rms_norm(self, x, weight, eps):
        if self.batch_invariant:
            return self.kernels.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def plan(self, step: StepInput, block_size: int) -> PagedPlan:
        q_tile = self.kernels.BLOCK_Q
        tiles = [(i, start + t0, min(q_tile, count - t0), cached + t0)
                 for i, (start, count, cached, _) in enumerate(step.seqs) for t0 in range(0, count, q_tile)]
        width = max(len(s[3]) for s in step.seqs)
        tables = np.zeros((len(step.seqs), width), dtype=np.int32)
        for i, (_, _, _, table) in enumerate(step.seqs):
            tables[i, :len(table)] = table
        device = step.input_ids.device
        return PagedPlan(torch.tensor(tiles, dtype=torch.int32).to(device), torch.from_numpy(tables).to(device))

    def attend(self, q, k_cache, v_cache, plan: PagedPlan):
        return self.kernels.paged_attention(q, k_cache, v_cache, plan.tiles, plan.tables)
