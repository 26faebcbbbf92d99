"""The fused Triton kernels between a Llama layer's products, under Triton's interpreter
(``TRITON_INTERPRET=1``): each against the eager torch code it replaces, bit for bit.

``add_rms_norm`` (the residual add and the norm after it), ``silu_mul`` and ``rope_and_cache``
(rotary embeddings for q and k, with Qwen3's per-head norms, and the KV-cache write) round where
torch rounds, so the fused step gives the unfused one's bits. Where a comparison on CPU cannot
be bit for bit, its comment says why. The interpreter widens 16-bit operands to float32 and
rounds back to nearest even (``norms._round``), so bfloat16 runs check the GPU's rounding points.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

# Before Triton is imported: it reads the switch once (as in tests/test_triton_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = pytest.mark.bits


@pytest.fixture(scope="module")
def tk():
    """The fused kernels, imported under the interpreter as tests/triton_interpreter.py patches it."""
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1")
    from tests.triton_interpreter import kernel_check_interpreter

    with kernel_check_interpreter():
        from daskllm.engines.triton_kernels import norms, rotary

        yield SimpleNamespace(rms_norm=norms.rms_norm, add_rms_norm=norms.add_rms_norm, silu_mul=norms.silu_mul,
                              rope_and_cache=rotary.rope_and_cache)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
ULPS = 4  # the most float32 ulps apart a comparison that cannot be bit for bit on CPU is here (its comment: why)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance of two float32 tensors in units in the last place (same signs)."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@DTYPES
@pytest.mark.parametrize("hidden", [48, 72, 96])
def test_add_rms_norm_rounds_the_sum_then_normalises_it(tk, dtype, hidden):
    from daskllm.engines.backends import rms_norm

    gen = torch.Generator().manual_seed(hidden)
    buf = torch.randn(7, hidden + 5, generator=gen).to(dtype)
    h = buf[:, :hidden]  # rows strided, as delta's below
    delta = torch.randn(7, 2 * hidden, generator=gen).to(dtype)[:, hidden:]
    w = torch.randn(hidden, generator=gen).to(dtype)
    before = buf.clone()
    want = h + delta
    got, normed = tk.add_rms_norm(h, delta, w, 1e-5)
    assert got is h and _same_bits(h, want)  # in place, rounded as torch's add
    assert _same_bits(buf[:, hidden:], before[:, hidden:])
    assert _same_bits(normed, tk.rms_norm(want, w, 1e-5))
    eager = rms_norm(want, w, 1e-5)
    # The sum of squares is added in another order than torch's mean (numpy's sum of the row
    # padded to a power of two): the variance differs in its last float32 bits, and so the row.
    # Rounded to bfloat16 the difference vanishes unless a value lies within it of a rounding
    # boundary (about 1 in 2^15 values; none in these rows).
    assert _same_bits(normed, eager) if dtype == torch.bfloat16 else _ulps(normed, eager) <= ULPS
    # A row alone gives the bits it has in the batch.
    alone = before[3:4, :hidden].clone()
    assert _same_bits(tk.add_rms_norm(alone, delta[3:4], w, 1e-5)[1], normed[3:4])
    assert _same_bits(alone, h[3:4])


@DTYPES
@pytest.mark.parametrize("inter", [40, 1100])  # 1100: two programs a row (norms.SILU_BLOCK), the second masked
def test_silu_mul_rounds_silu_then_the_product(tk, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter + 8, generator=gen) * 4).to(dtype)[:, :2 * inter]  # rows strided
    gate, up = gate_up.chunk(2, dim=-1)
    out = tk.silu_mul(gate_up)
    # The interpreter's exp is numpy's: with it, torch's rounding points give the kernel's bits.
    g = gate.float().numpy()
    assert _same_bits(out, torch.from_numpy(g / (1 + np.exp(-g))).to(dtype) * up)
    eager = F.silu(gate) * up
    # torch's CPU exp (SLEEF's, vectorised) and numpy's differ in float32's last bits; rounded to
    # bfloat16, as for the norm above, not in these rows.
    assert _same_bits(out, eager) if dtype == torch.bfloat16 else _ulps(out, eager) <= ULPS
    assert _same_bits(tk.silu_mul(gate_up[2:3]), out[2:3])


def _rope_tables(positions: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, d] as transformers makes them: float32 angles, cast to the dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq).repeat(1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _cache(kv_heads: int, blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, gen) -> torch.Tensor:
    """Two layers of KV cache laid out as LlamaModel.allocate_cache lays them out (stored [layer, KV
    head, block, row, d], seen [layer, block, KV head, row, d]); random, so a stray write shows."""
    return torch.randn(2, kv_heads, blocks, block_size, head_dim, generator=gen).to(dtype).transpose(1, 2)


@DTYPES
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(6, 2, 24, 8), (4, 4, 16, 16)],
                         ids=["gqa3-d24-bs8", "mha-d16-bs16"])
def test_rope_and_cache_matches_rope_and_the_cache_write(tk, dtype, qk_norm, heads, kv_heads, head_dim, block):
    from daskllm.engines.backends import rope

    gen = torch.Generator().manual_seed(heads * head_dim)
    n, blocks, eps = 4, 6, 1e-6  # the last block is the scratch block CUDA-graph padding rows write to
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    width = q_size + 2 * kv_size
    qkv = torch.randn(n, width + 3, generator=gen).to(dtype)[:, :width]  # rows strided
    qkv[torch.rand(qkv.shape, generator=gen) < 0.2] *= 0  # signed zeros: -x of rotate_half must be -0.0 for 0.0
    cos, sin = _rope_tables(64, head_dim, dtype)
    positions = torch.tensor([3, 0, 40, 63])
    slots = torch.tensor([2 * block + 3, (blocks - 1) * block + 1, block - 1, 3 * block + 2])
    norms = [torch.randn(head_dim, generator=gen).to(dtype) for _ in "qk"] if qk_norm else [None, None]
    k_cache, v_cache = (_cache(kv_heads, blocks, block, head_dim, dtype, gen) for _ in "kv")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = tk.rope_and_cache(qkv, positions, cos, sin, slots, k_cache[1], v_cache[1], heads, kv_heads, head_dim,
                          q_norm=norms[0], k_norm=norms[1], eps=eps)

    # The unfused step: per-head norms by the rms_norm kernel, then rope and index_put.
    q_in = qkv[:, :q_size].reshape(n, heads, head_dim)
    k_in = qkv[:, q_size:q_size + kv_size].reshape(n, kv_heads, head_dim)
    if qk_norm:
        q_in, k_in = tk.rms_norm(q_in, norms[0], eps), tk.rms_norm(k_in, norms[1], eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[1][slots // block, :, slots % block] = rope(k_in, c, s)
    want_v[1][slots // block, :, slots % block] = qkv[:, q_size + kv_size:].reshape(n, kv_heads, head_dim)
    assert q.shape == (n, heads, head_dim) and q.is_contiguous()
    assert _same_bits(q, rope(q_in, c, s))
    assert _same_bits(k_cache, want_k) and _same_bits(v_cache, want_v)  # both layers, every block and row

    # A row alone (here the one at a block's last row) gives the bits it has in the batch, in the same place.
    alone_k, alone_v = before_k.clone(), before_v.clone()
    alone = tk.rope_and_cache(qkv[2:3], positions[2:3], cos, sin, slots[2:3], alone_k[1], alone_v[1], heads,
                              kv_heads, head_dim, q_norm=norms[0], k_norm=norms[1], eps=eps)
    assert _same_bits(alone, q[2:3])
    b, r = slots[2] // block, slots[2] % block
    for got, batch, want in ((alone_k, k_cache, before_k.clone()), (alone_v, v_cache, before_v.clone())):
        want[1][b, :, r] = batch[1][b, :, r]
        assert _same_bits(got, want)
