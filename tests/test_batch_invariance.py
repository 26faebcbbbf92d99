"""The machine property the engine's exactness rests on: its matrix products are batch-invariant.

Greedy decoding gives the same tokens alone, batched and on a cached prefix only if a row's
matrix product has the same bits whatever other rows share the call. ``invariant.Linear``
(the Llama and BERT engines' projections: a weight prepared once for oneDNN on CPU) runs
oneDNN at any row count from the floor ``min_rows`` probes on this CPU, and in calls of a
fixed row count where there is no small floor; ``linear`` (its fallback) always runs fixed-size
calls. All three are checked here, whichever the probe picked. If this fails on a machine, the
engine is not exact there, even though token-level tests rarely notice a last-bit difference (a
random model's top two logits are seldom that close): hence the forward-pass checks at the end,
which compare logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from daskllm.engines import invariant
from daskllm.engines.invariant import BLOCK_ROWS, ROW_MULTIPLE, Linear, in_blocks, linear, pad_rows
from tests.helpers import check_forward_invariance

pytestmark = pytest.mark.bits

MAX_ROWS = 70
# (K, N): the tiny model's projections (qkv, gate/up, down, lm head), smollm2's down projection
# (a lone row sums K = 1536 in another order on AVX-512 CPUs) and an odd shape
SHAPES = [(256, 384), (256, 1408), (704, 256), (256, 16384), (1536, 576), (96, 40)]


# 1 and 2 threads, and whatever this machine uses by default (what an engine here would use)
THREAD_COUNTS = sorted({1, 2, torch.get_num_threads()})


@pytest.fixture(params=THREAD_COUNTS, ids=lambda n: f"threads{n}")
def num_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_pad_rows():
    assert pad_rows(1) == ROW_MULTIPLE
    assert all(pad_rows(n) % ROW_MULTIPLE == 0 and pad_rows(n) >= n for n in range(1, 200))
    assert all(pad_rows(n) - n < ROW_MULTIPLE for n in range(ROW_MULTIPLE, 200))


def test_in_blocks_calls_the_product_with_exactly_block_rows():
    seen = []

    def product(rows):
        seen.append(rows.shape[0])
        return rows * 2

    for n in (1, BLOCK_ROWS - 1, BLOCK_ROWS, BLOCK_ROWS + 1, 3 * BLOCK_ROWS + 5):
        seen.clear()
        x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
        assert torch.equal(in_blocks(product, x), x * 2)
        assert seen == [BLOCK_ROWS] * -(-n // BLOCK_ROWS)


def _onednn_in_blocks(w, b=None):
    product = Linear(w, b)
    if not product.packed:
        pytest.skip("oneDNN does not run this dtype's products here")
    product.kernel = "onednn-blocks"
    return product


# The batch-invariant products: fixed-size calls (F.linear), a weight prepared once (oneDNN, at
# any row count or in fixed-size calls, as this CPU's probe chose), and oneDNN in fixed-size calls.
IMPLS = {
    "blocks": lambda w, b=None: (lambda x: linear(x, w, b)),
    "prepared": lambda w, b=None: Linear(w, b),
    "prepared-blocks": _onednn_in_blocks,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_linear_rows_are_bitwise_independent_of_row_count(k, n, num_threads, impl, dtype):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(MAX_ROWS, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    product = IMPLS[impl](w)
    full = product(x)
    assert full.shape == (MAX_ROWS, n)
    mismatched = []
    for rows in range(1, MAX_ROWS + 1):
        part = product(x[:rows])
        assert part.shape == (rows, n)
        if not torch.equal(part, full[:rows]):
            mismatched.append(rows)
        # the last rows, too: a row's bits depend neither on its neighbours nor on its index
        # (skipped for the wide lm-head shape, to keep the test fast)
        start = MAX_ROWS - rows
        if n <= 2048 and not torch.equal(product(x[start:]), full[start:]):
            mismatched.append(-rows)
    assert not mismatched, (f"{impl} {dtype} linear is not batch-invariant on this machine for K={k}, N={n}, "
                            f"{num_threads} threads; differing row counts (negative: trailing rows): "
                            f"{mismatched}")


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_with_bias_is_batch_invariant(num_threads, impl):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(MAX_ROWS, 256, generator=gen)
    w = torch.randn(384, 256, generator=gen) * 0.1
    b = torch.randn(384, generator=gen)
    product = IMPLS[impl](w, b)
    full = product(x)
    bad = [r for r in range(1, MAX_ROWS + 1) if not torch.equal(product(x[:r]), full[:r])]
    assert not bad


def test_prefill_sized_products_are_batch_invariant(num_threads):
    """A prefill step runs up to max-num-batched-tokens rows (2048 by default) through one product."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2048, 256, generator=gen)
    product = Linear(torch.randn(384, 256, generator=gen) * 0.1)
    full = product(x)
    bad = [r for r in (1, 3, 4, 127, 128, 129, 500, 1023, 2047) if not torch.equal(product(x[:r]), full[:r])]
    bad += [-r for r in (1, 5, 300) if not torch.equal(product(x[-r:]), full[-r:])]
    assert not bad


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_matches_f_linear_numerically(impl):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    b = torch.randn(32, generator=gen)
    torch.testing.assert_close(IMPLS[impl](w, b)(x), torch.nn.functional.linear(x, w, b))


def test_prepared_linear_uses_onednn_on_cpu():
    """The fast path is the one in use where oneDNN is (else the engine runs fixed-size calls)."""
    w = torch.randn(32, 64)
    assert Linear(w).packed == torch.backends.mkldnn.is_available()
    floor = invariant.min_rows(torch.float32)
    assert Linear(w).kernel == ("onednn" if floor else "onednn-blocks")
    assert Linear(w).min_rows == (floor or BLOCK_ROWS)
    assert Linear(w, pack=False).kernel == "blocks"
    assert Linear(w.double()).kernel == "blocks"  # float32 and bfloat16 only
    assert Linear(w.bfloat16()).packed == (torch.backends.mkldnn.is_available()
                                          and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_the_probe_finds_the_row_count_a_kernel_is_invariant_from(monkeypatch):
    """``min_rows`` on stand-in kernels: one that computes each row alone, one whose bits differ
    for a lone row (as AVX-512's float32 kernels at K = 1536), one whose bits change above 16
    rows (as AMX's bfloat16 kernels)."""
    monkeypatch.setattr(invariant, "_reorder", lambda w: w)
    by_row = lambda x, packed, bias: torch.stack([packed @ row for row in x])  # noqa: E731
    for kernel, floor in [(by_row, 1),
                          (lambda x, packed, bias: by_row(x, packed, bias) * (1 + 2 ** -20 * (x.shape[0] == 1)), 2),
                          (lambda x, packed, bias: by_row(x, packed, bias) * (1 + 2 ** -20 * (x.shape[0] > 16)), None)]:
        monkeypatch.setattr(invariant, "_onednn_product", kernel)
        assert invariant.min_rows.__wrapped__(torch.float32) == floor


# --- the whole forward pass, in float32 and bfloat16 (tests/helpers.py: check_forward_invariance;
# test_triton_kernels.py runs the same check on the GPU backend's kernels) ------------------------


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny_model(tiny_model_dir, request):
    from daskllm.engines.llama import LlamaModel

    return LlamaModel(tiny_model_dir, dtype=request.param)


def test_forward_logits_are_batch_invariant(tiny_model, num_threads):
    check_forward_invariance(tiny_model)


@pytest.mark.parametrize("positions", [
    [[700]],  # one decode at a long context
    [[5], [300], [97]],  # decodes at different lengths, batched
    [list(range(260, 300))],  # a prefill chunk deep into its prompt
], ids=["decode", "decodes", "prefill-chunk"])
def test_cpu_attention_is_the_same_in_runs_of_tiles_as_tile_by_tile(positions, monkeypatch):
    """The CPU backend computes runs of key tiles in batched calls; its results must be the bits
    of taking the tiles one at a time (and close to a float64 reference)."""
    from daskllm.engines import backends

    torch.manual_seed(0)
    bs, kv_heads, g, d = 16, 3, 3, 64
    blocks = 64
    k_cache, v_cache = torch.randn(blocks, kv_heads, bs, d), torch.randn(blocks, kv_heads, bs, d)
    tables = [list(torch.randperm(blocks)[:48].tolist()) for _ in positions]
    q = torch.randn(len(positions), len(positions[0]), kv_heads * g, d)

    def attend():
        grp = backends._group(slice(None), positions, tables, bs, g, "cpu")
        return backends._attend(q, k_cache, v_cache, grp), len(grp.spans)

    together, runs = attend()
    monkeypatch.setattr(backends, "SPAN_FLOATS", 1)  # one tile per call
    alone, tiles = attend()
    assert runs < tiles
    assert torch.equal(together, alone)
    # float64 reference: plain causal softmax attention over each query's keys
    for i, (pos, table) in enumerate(zip(positions, tables)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(max(pos) + 1)])
        keys = k_cache.permute(0, 2, 1, 3).reshape(-1, kv_heads, d)[slots].double()
        values = v_cache.permute(0, 2, 1, 3).reshape(-1, kv_heads, d)[slots].double()
        for j, p in enumerate(pos):
            for h in range(kv_heads * g):
                s = keys[:p + 1, h // g] @ q[i, j, h].double() / d ** 0.5
                ref = torch.softmax(s, 0) @ values[:p + 1, h // g]
                torch.testing.assert_close(together[i, j, h].double(), ref, rtol=1e-4, atol=1e-5)
