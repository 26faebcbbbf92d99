"""The machine property the engine's exactness rests on: its matrix products are batch-invariant.

Greedy decoding gives the same tokens alone, batched and on a cached prefix only if a row's
matrix product has the same bits whatever other rows share the call. ``invariant.Linear``
(the Llama engine's projections: a weight prepared once for oneDNN on CPU) relies on the
kernel for that; ``linear`` (its fallback, and the BERT engine's) pads the row count to a
multiple of ``ROW_MULTIPLE``. Both are checked here. If this fails on a machine, the engine
is not exact there, even though token-level tests rarely notice a last-bit difference (a
random model's top two logits are seldom that close): hence the forward-pass checks at the end,
which compare logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from daskllm.engines.invariant import ROW_MULTIPLE, Linear, linear, pad_rows

MAX_ROWS = 70
# (K, N): the tiny model's projections (qkv, gate/up, down, lm head) and an odd shape
SHAPES = [(256, 384), (256, 1408), (704, 256), (256, 16384), (96, 40)]


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


# The two batch-invariant products: padded rows, and a weight prepared once (oneDNN on CPU).
IMPLS = {
    "padded": lambda w, b=None: (lambda x: linear(x, w, b)),
    "prepared": lambda w, b=None: Linear(w, b),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_linear_rows_are_bitwise_independent_of_row_count(k, n, num_threads, impl):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(MAX_ROWS, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.1
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
    assert not mismatched, (f"{impl} linear is not batch-invariant on this machine for K={k}, N={n}, "
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
    """The fast path is the one in use where oneDNN is (else the engine silently pads rows)."""
    w = torch.randn(32, 64)
    assert Linear(w).packed == torch.backends.mkldnn.is_available()
    assert not Linear(w, pack=False).packed
    assert not Linear(w.double()).packed  # float32 only: other dtypes pad rows


# --- the whole forward pass ------------------------------------------------------------------
#
# Tokens are too coarse to see a last-bit difference (a random model's top logits are rarely
# that close), so the forward pass itself is checked: the logits of one sequence must have
# the same bits alone, batched with other sequences (prefills and decodes of other lengths),
# prefilled in chunks, and on top of K/V cached by an earlier step.

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from daskllm.engines.llama import LlamaModel

    return LlamaModel(tiny_model_dir)


class _Seq:
    def __init__(self, seed: int, length: int, first_block: int):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, 16000, (length,), generator=gen).tolist()
        self.table = list(range(first_block, first_block + -(-(length + 1) // BLOCK)))


def _step(model, parts):
    """One forward step over ``parts`` = [(seq, first, n)]; returns {seq: logits of its last row}."""
    from daskllm.engines.llama import StepInput

    ids, positions, slots, seqs, rows = [], [], [], [], []
    for seq, first, n in parts:
        row = len(ids)
        ids += seq.ids[first:first + n]
        positions += range(first, first + n)
        slots += [seq.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + n)]
        seqs.append((row, n, first, seq.table))
        rows.append(row + n - 1)
    logits = model.forward(StepInput(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), seqs, rows))
    return {id(seq): logits[i] for i, (seq, _, _) in enumerate(parts)}


def test_forward_logits_are_batch_invariant(tiny_model, num_threads):
    model = tiny_model
    a = _Seq(1, 37, 0)   # the sequence under test: 37 prompt tokens, then decodes at 37
    b = _Seq(2, 20, 10)
    c = _Seq(3, 5, 20)
    d = _Seq(4, 9, 25)
    e = _Seq(5, 70, 30)  # a longer context: more key chunks in a batched decode
    a.ids.append(123)    # the token decoded at position 37

    def fresh():
        model.allocate_cache(40, BLOCK)

    # prefill of a's prompt: logits of its last prompt token
    fresh()
    alone = _step(model, [(a, 0, 37)])[id(a)]
    fresh()
    batched = _step(model, [(b, 0, 20), (a, 0, 37), (c, 0, 5)])[id(a)]
    fresh()
    _step(model, [(a, 0, 16)])
    _step(model, [(a, 16, 16), (b, 0, 3)])
    chunked = _step(model, [(a, 32, 5)])[id(a)]
    fresh()
    _step(model, [(e, 0, 70), (a, 0, 32)])
    on_cache = _step(model, [(a, 32, 5), (d, 0, 9)])[id(a)]
    assert torch.equal(alone, batched), "prefill logits change when batched with other prompts"
    assert torch.equal(alone, chunked), "prefill logits change when the prompt is prefilled in chunks"
    assert torch.equal(alone, on_cache), "prefill logits change on top of a cached prefix"

    # decode of a's next token, alone and among other decodes and a prefill
    fresh()
    _step(model, [(a, 0, 37)])
    decode_alone = _step(model, [(a, 37, 1)])[id(a)]
    fresh()
    _step(model, [(a, 0, 37), (b, 0, 20), (c, 0, 5), (e, 0, 70)])
    decode_batched = _step(model, [(b, 19, 1), (a, 37, 1), (d, 0, 9), (c, 4, 1), (e, 69, 1)])[id(a)]
    assert torch.equal(decode_alone, decode_batched), "decode logits change when batched"
    # and a decode equals the same position computed as the last token of a prefill
    fresh()
    prefill_38 = _step(model, [(a, 0, 38)])[id(a)]
    assert torch.equal(decode_alone, prefill_38), "a decode step and a prefill disagree on the same position"
