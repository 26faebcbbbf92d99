"""Triton kernels of the torch engine on a GPU, batch-invariant by construction.

A row's result must not depend on the other rows of the step, or greedy tokens would depend
on what a request was batched with. cuBLAS and torch's reductions choose their kernels, and
so their reduction order, by the number of rows; these kernels do not:

* :func:`matmul`: one tile configuration per dtype whatever the row count, each output
  element reduced over K in the same order (no split-K), the approach of the
  "batch-invariant ops" work that vLLM adopted as ``VLLM_BATCH_INVARIANT``.
* :func:`rms_norm`: one program per row, one fixed-size reduction.
* :func:`paged_attention`: queries in tiles of ``BLOCK_Q`` positions of one sequence (a
  decode is a tile of one), the query heads of a KV head packed into the tile's rows; keys
  read through the block table in tiles of ``KV_TILE`` in position order, with an online
  softmax in float32. Key tiles past a row's position add exact zeros, so a row's result is
  the same whatever tile it sits in or however far that tile's loop runs.

Every constant that shapes a reduction (tile sizes, warps) is fixed here: changing one
changes the bits. The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors, which is
how the CPU test suite checks them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_Q = 16  # query positions per attention tile (a decode uses one of them)
KV_TILE = 32  # keys per step of the attention loop
# Triton's interpreter holds bfloat16 as raw uint16 and computes nothing on it: under it,
# 16-bit operands are widened to float32 before any arithmetic (the GPU code is unchanged).
_WIDEN = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class _MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    precision: str  # tl.dot's input_precision: "ieee" keeps float32 products float32


_MATMUL_CONFIGS = {
    torch.bfloat16: _MatmulConfig(128, 128, 64, 8, 3, "tf32"),
    torch.float16: _MatmulConfig(128, 128, 64, 8, 3, "tf32"),
    torch.float32: _MatmulConfig(64, 64, 32, 4, 3, "ieee"),
}
_GROUP_M = 8  # tiles sharing a column block run together (L2 reuse); order does not change bits


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_ok[:, None], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K], weight [N, K], every row batch-invariant."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = _MATMUL_CONFIGS[x.dtype]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](x, weight, out, bias if bias is not None else out, m, n, k,
                         x.stride(0), x.stride(1), weight.stride(1), weight.stride(0), out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         GROUP_M=_GROUP_M, PRECISION=cfg.precision, WIDEN=_WIDEN, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)  # as transformers: norm, cast, scale
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # A product of two 16-bit floats is exact in float32: rounding it once is the 16-bit product.
    tl.store(out_ptr + row * stride_out + cols, (normed.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., H], one fixed-order reduction per row."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    _rms_norm_kernel[(flat.shape[0],)](flat, weight, out, flat.stride(0), out.stride(0), flat.shape[1], eps,
                                       BLOCK=triton.next_power_of_2(flat.shape[1]), num_warps=4)
    return out.view_as(x)


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
