"""Rotary embeddings for q and k and the KV-cache write, in one launch per layer.

A program per token row, its q and k heads one [heads, d] tile (the rotary tables' row read
once for all of them), its v heads copied into the cache beside. Each value is rounded where transformers' ``x * cos + rotate_half(x) * sin`` rounds in the
model's dtype (each product, then their sum), and the optional per-head RMSNorm (Qwen3's q_norm
and k_norm) is ``rms_norm``'s arithmetic (each head's sum of squares one reduction over d, as a
row's in ``rms_norm``), so the fused step computes the unfused one's bits.
Nothing depends on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from daskllm.engines.triton_kernels._launch import launch
from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN
from daskllm.engines.triton_kernels.norms import _round, _scale


@triton.jit
def _mul(a, b, WIDEN: tl.constexpr):
    """a * b (float32) rounded on its own, as torch's separate multiply: never contracted with
    the add after it into an FMA, as a GPU compile may do to a plain multiply. PTX's ``mul.rn``,
    not libdevice's ``mul_rn``, which Triton links flushing subnormals to zero."""
    if WIDEN:
        p = a * b
    else:
        p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return p


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr,
                           stride_qkv, stride_cos, stride_sin, stride_q, stride_kb, stride_kh, stride_kr,
                           stride_vb, stride_vh, stride_vr, heads, kv_heads, head_dim, block_size, eps,
                           HEADS_P2: tl.constexpr, KV_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                           QK_NORM: tl.constexpr, WIDEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_P2)[:, None]  # q heads, then k heads: one [heads, d] tile
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < head_dim
    ok = (head < heads + kv_heads) & d_ok
    is_q = head < heads
    half = head_dim // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)  # the column rotate_half brings to d
    src = qkv_ptr + row * stride_qkv + head * head_dim
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    if QK_NORM:
        w = tl.where(is_q, tl.load(qn_ptr + d, mask=d_ok, other=0.0),
                     tl.load(kn_ptr + d, mask=d_ok, other=0.0)).to(tl.float32)
        wp = tl.where(is_q, tl.load(qn_ptr + partner, mask=d_ok, other=0.0),
                      tl.load(kn_ptr + partner, mask=d_ok, other=0.0)).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]  # each head's, as _rstd's
        x, xp = _scale(x, rstd, w, dtype), _scale(xp, rstd, wp, dtype)
    pos = tl.load(pos_ptr + row)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    rotated = tl.where(first, xp * -1.0, xp)  # not -xp: Triton's minus is 0 - x, +0.0 for +0.0 where torch's is -0.0
    out = _round(_round(_mul(x, c, WIDEN), dtype) + _round(_mul(rotated, s, WIDEN), dtype), dtype)
    tl.store(q_ptr + row * stride_q + head * head_dim + d, out.to(dtype), mask=ok & is_q)
    slot = tl.load(slot_ptr + row)
    block, offset = slot // block_size, slot % block_size
    kv_head = (head - heads).to(tl.int64)  # negative for a q head: its cache stores are masked off
    tl.store(k_ptr + block * stride_kb + kv_head * stride_kh + offset * stride_kr + d, out.to(dtype),
             mask=ok & (head >= heads))
    v_head = tl.arange(0, KV_P2)[:, None]
    v_ok = (v_head < kv_heads) & d_ok
    v = tl.load(qkv_ptr + row * stride_qkv + (heads + kv_heads + v_head) * head_dim + d, mask=v_ok)
    tl.store(v_ptr + block * stride_vb + v_head.to(tl.int64) * stride_vh + offset * stride_vr + d, v, mask=v_ok)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, *, q_norm: torch.Tensor | None = None,
                   k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Rotate q and k of qkv [n, (heads + 2 kv_heads) * d] at ``positions`` (cos, sin:
    [max_positions, d] in the model's dtype), after a per-head RMSNorm where q_norm and k_norm
    are given; write k and v into one layer's cache [blocks, kv_heads, block_size, d] (any
    strides) at ``slots`` (block * block_size + row); return q [n, heads, d], contiguous."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_and_cache takes both q_norm and k_norm, or neither")
    if head_dim % 2 or qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 \
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("rope_and_cache needs an even head_dim and unit strides along it")
    if not qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError("rope_and_cache computes in one dtype: qkv's, the rope tables' and the cache's")
    n = qkv.shape[0]
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    norms = (q_norm, k_norm) if q_norm is not None else (qkv, qkv)  # unread without QK_NORM
    launch(_rope_and_cache_kernel, (n,),
        qkv, positions, cos, sin, slots, q, k_cache, v_cache, *norms,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        num_heads, num_kv_heads, head_dim, k_cache.shape[2], eps,
        HEADS_P2=triton.next_power_of_2(num_heads + num_kv_heads), KV_P2=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), QK_NORM=q_norm is not None, WIDEN=_WIDEN,
        num_warps=4)
    return q
