"""Paged attention, batch-invariant.

Queries in tiles of ``BLOCK_Q`` positions of one sequence (a decode is a tile of one), the query
heads of a KV head packed into the tile's rows; keys read through the block table in tiles of
``KV_TILE`` in position order, with an online softmax in float32. Key tiles past a row's
position add exact zeros, so a row's result is the same whatever tile it sits in or however far
that tile's loop runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN

BLOCK_Q = 16  # query positions per attention tile (a decode uses one of them)
KV_TILE = 32  # keys per step of the attention loop


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, tables_ptr,
                            stride_qn, stride_qh, stride_kb, stride_kh, stride_kr,
                            stride_on, stride_oh, stride_table, block_size, scale,
                            GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                            D_P2: tl.constexpr, BLOCK_Q: tl.constexpr, KV_TILE: tl.constexpr,
                            PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    n_rows = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)
    # Tile rows: (query head within the KV group, query position).
    r = tl.arange(0, GROUP_P2 * BLOCK_Q)
    head = r // BLOCK_Q
    qi = r % BLOCK_Q
    valid = (head < GROUP) & (qi < n_rows)
    pos = pos0 + qi
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    q_rows = (row0 + qi).to(tl.int64) * stride_qn + (kv_head * GROUP + head) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    m = tl.full((GROUP_P2 * BLOCK_Q,), -1.0e30, tl.float32)
    l = tl.zeros((GROUP_P2 * BLOCK_Q,), tl.float32)
    acc = tl.zeros((GROUP_P2 * BLOCK_Q, D_P2), tl.float32)
    last = pos0 + n_rows - 1
    for t in range(0, last // KV_TILE + 1):
        keys = t * KV_TILE + tl.arange(0, KV_TILE)
        k_ok = keys <= last
        block = tl.load(tables_ptr + seq * stride_table + keys // block_size, mask=k_ok, other=0).to(tl.int64)
        base = block * stride_kb + kv_head * stride_kh + (keys % block_size) * stride_kr
        k = tl.load(k_ptr + base[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        p = p.to(v.dtype)  # 16-bit operands for the tensor cores, as flash attention does
        if WIDEN:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    o_rows = (row0 + qi).to(tl.int64) * stride_on + (kv_head * GROUP + head) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: torch.Tensor,
                    tables: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [N, H, d] over one layer's cache [blocks, Hkv, block_size, d].

    ``tiles`` [T, 4] int32 rows are (sequence, first row of q, rows, position of the first
    row), at most ``BLOCK_Q`` rows of one sequence each; ``tables`` [S, W] int32 holds each
    sequence's cache blocks. Every row of q must be in one tile.
    """
    n, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    grid = (tiles.shape[0], kv_heads)
    _paged_attention_kernel[grid](q, k_cache, v_cache, out, tiles, tables,
                                  q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                  out.stride(0), out.stride(1), tables.stride(0), block_size, head_dim ** -0.5,
                                  GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim,
                                  D_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=BLOCK_Q, KV_TILE=KV_TILE,
                                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDEN=_WIDEN, num_warps=4,
                                  num_stages=2)
    return out
