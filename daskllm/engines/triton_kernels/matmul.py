"""The projections' product, batch-invariant: ``F.linear(x, weight, bias)`` whose every row has the
same bits whatever the row count.

One tile configuration per dtype whatever the row count, each output element reduced over K in
the same order (no split-K), the approach of the "batch-invariant ops" work that vLLM adopted as
``VLLM_BATCH_INVARIANT``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN


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
