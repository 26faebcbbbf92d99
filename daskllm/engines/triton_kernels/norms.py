"""RMSNorm, alone or fused with the residual add before it, and SiLU x up.

RMSNorm is one program per row, one fixed-size reduction, so a row's bits do not depend on the
others (SiLU x up, elementwise, takes a program per row and tile of ``SILU_BLOCK`` columns). The
fused kernels round where the eager torch code rounds (a 16-bit op computes in float32 and
rounds its result), so fusing them changes no bits: the add is rounded to h's dtype before it
is normalised, and SiLU is rounded before its product with up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from daskllm.engines.triton_kernels._launch import launch
from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN

SILU_BLOCK = 1024  # most columns of one SiLU x up program: elementwise, so it changes no bits


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to dtype, held in float32: the value a torch op in dtype produces."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rstd(x, n, eps):
    """1 / RMS of a row x (float32, zeros past its n columns): one fixed-size reduction."""
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def _scale(x, rstd, w, dtype: tl.constexpr):
    """As transformers: normalise, round to dtype, then scale. A product of two 16-bit floats is
    exact in float32: rounding it once is the 16-bit product."""
    return _round(_round(x * rstd, dtype) * w, dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = _rstd(x, n, eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + cols, _scale(x, rstd, w, dtype).to(dtype), mask=ok)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, stride_h, stride_d, stride_out, n, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    delta = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    # The sum of two 16-bit floats rounded to float32, then to 16 bits, is the correctly rounded sum.
    h = _round(h + delta, h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)
    rstd = _rstd(h, n, eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + cols, _scale(h, rstd, w, dtype).to(dtype), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr,
                     WIDEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    # As torch's CUDA SiLU: expf and an IEEE division (tl.exp and "/" are approximate on a GPU;
    # the interpreter has no libdevice).
    if WIDEN:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    dtype = out_ptr.dtype.element_ty
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dtype)
    tl.store(out_ptr + row * stride_out + cols, _round(silu * up, dtype).to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., H], one fixed-order reduction per row."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    launch(_rms_norm_kernel, (flat.shape[0],), flat, weight, out, flat.stride(0), out.stride(0), flat.shape[1], eps,
                                       BLOCK=triton.next_power_of_2(flat.shape[1]),
                                       num_warps=4)
    return out.view_as(x)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it in one launch: h [n, H] += delta in place
    (rounded to h's dtype), then (h, RMSNorm(h)), the norm bit for bit ``rms_norm``'s."""
    if h.stride(1) != 1 or delta.stride(1) != 1:
        raise ValueError("add_rms_norm needs unit column strides")
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    launch(_add_rms_norm_kernel, (h.shape[0],), h, delta, weight, out, h.stride(0), delta.stride(0), out.stride(0),
                                        h.shape[1], eps, BLOCK=triton.next_power_of_2(h.shape[1]),
                                        num_warps=4)  # as rms_norm: the same reduction
    return h, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of gate_up [n, 2I] (gate, then up, in each row) in one launch, rounded
    where torch rounds: SiLU computed in float32 and rounded to the dtype, then the product."""
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs a unit column stride")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    launch(_silu_mul_kernel, (n, triton.cdiv(inter, block)), gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                     BLOCK=block, WIDEN=_WIDEN,
                                                     num_warps=4)
    return out
