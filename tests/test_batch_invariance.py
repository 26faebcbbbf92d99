"""The machine property the engine's exactness rests on: its matrix products are batch-invariant.

Greedy decoding gives the same tokens alone, batched and on a cached prefix only if a row's
matrix product has the same bits whatever other rows share the call. ``invariant.Linear``
(the Llama and BERT engines' projections: a weight prepared once for oneDNN on CPU) runs
oneDNN at any row count from the floor ``min_rows`` probes on this CPU, and in calls of a
fixed row count where there is no small floor; ``linear`` (its fallback) always runs fixed-size
calls; bfloat16 widened to float32's path is what CPUs without oneDNN bfloat16 kernels run.
All of them are checked here, whichever the probe picked (``make test-baseline-cpu`` runs them
again with oneDNN held to AVX2). If this fails on a machine, the
engine is not exact there, even though token-level tests rarely notice a last-bit difference (a
random model's top two logits are seldom that close): hence the forward-pass checks at the end,
which compare logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

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
    path = invariant.path_for(w.dtype)
    if not path.packed:
        pytest.skip("oneDNN does not run this dtype's products here")
    return Linear(w, b, path=dataclasses.replace(path, kernel="onednn-blocks", min_rows=BLOCK_ROWS))


def _widened(w, b=None):
    """bfloat16 as a CPU without oneDNN bfloat16 kernels runs it (float32's path)."""
    return Linear(w, b, path=invariant.widened(w.dtype))


# The batch-invariant products: fixed-size calls (F.linear), a weight prepared once (oneDNN, at
# any row count or in fixed-size calls, as this CPU's probe chose), oneDNN in fixed-size calls,
# and bfloat16 widened to float32's path.
IMPLS = {
    "blocks": lambda w, b=None: (lambda x: linear(x, w, b)),
    "prepared": lambda w, b=None: Linear(w, b),
    "prepared-blocks": _onednn_in_blocks,
    "widened": _widened,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# each way with each dtype it applies to (only bfloat16 is widened), as "impl-dtype"
CASES = [pytest.param(impl, dtype, id=f"{impl}-{name}") for impl in IMPLS for name, dtype in DTYPES.items()
         if not (impl == "widened" and dtype == torch.float32)]


@pytest.mark.parametrize("impl,dtype", CASES)
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


@pytest.mark.parametrize("impl,dtype", CASES)
def test_linear_with_bias_is_batch_invariant(num_threads, impl, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(MAX_ROWS, 256, generator=gen).to(dtype)
    w = (torch.randn(384, 256, generator=gen) * 0.1).to(dtype)
    b = torch.randn(384, generator=gen).to(dtype)
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


@pytest.mark.parametrize("impl,dtype", CASES)
def test_linear_matches_f_linear_numerically(impl, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    w = torch.randn(32, 64, generator=gen).to(dtype)
    b = torch.randn(32, generator=gen).to(dtype)
    got = IMPLS[impl](w, b)(x)
    assert got.dtype == dtype
    # against float64 on the same (rounded) values: both sum exact products, in other orders
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7  # bfloat16: results rounded to 8 bits
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_the_path_is_oneDNN_where_it_computes_the_dtype():
    """The fast path is the one in use where oneDNN is; bfloat16 without oneDNN's bfloat16
    kernels (an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2) is widened to float32's path."""
    onednn = torch.backends.mkldnn.is_available()
    fp32 = invariant.path_for(torch.float32)
    floor = invariant.min_rows(torch.float32)
    assert (fp32.packed, fp32.compute) == (onednn, torch.float32)
    assert (fp32.kernel, fp32.min_rows) == (("onednn", floor) if floor else ("onednn-blocks", BLOCK_ROWS))
    bf16 = invariant.path_for(torch.bfloat16)
    if onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert bf16.compute == torch.bfloat16 and bf16.packed
    else:
        assert bf16 == invariant.widened(torch.bfloat16)
        assert "widened to float32" in str(bf16)
    assert invariant.path_for(torch.float64) == invariant.unpacked(torch.float64)  # float32 and bfloat16 only
    w = torch.randn(32, 64)
    assert Linear(w).path == fp32 and Linear(w.bfloat16()).path == bf16
    widened = Linear(w.bfloat16(), path=invariant.widened(torch.bfloat16))
    assert widened.path.compute == torch.float32 and widened(torch.randn(3, 64).bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32 products given a torch.bfloat16 weight"):
        Linear(w.bfloat16(), path=fp32)


def test_the_path_is_chosen_once_per_process_and_logged(caplog, monkeypatch):
    probes = []
    monkeypatch.setattr(invariant, "min_rows", lambda dtype: probes.append(dtype) or 2)
    monkeypatch.setattr(invariant, "_onednn_computes", lambda dtype: dtype == torch.float32)
    path_for = invariant.path_for.__wrapped__
    monkeypatch.setattr(invariant, "path_for", functools.cache(path_for))
    with caplog.at_level("INFO", logger="daskllm.engines.invariant"):
        for _ in range(3):
            bf16 = invariant.path_for(torch.bfloat16)
            invariant.path_for(torch.float32)
    assert bf16 == invariant.Path(torch.bfloat16, torch.float32, "onednn", 2)
    assert probes == [torch.float32]
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert [r.getMessage() for r in caplog.records] == [
        "batch-invariant float32 products: oneDNN on prepared weights, calls of at least 2 rows",
        "batch-invariant bfloat16 products: oneDNN on prepared weights, calls of at least 2 rows "
        "(widened to float32: oneDNN has no bfloat16 kernels on this CPU)"]


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
