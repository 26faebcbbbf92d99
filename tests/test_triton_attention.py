"""The paged attention kernel's chunked online softmax, under Triton's interpreter (``TRITON_INTERPRET=1``).

A query row's bits must not depend on how the step is tiled or run: a decode tile or a prefill
tile, in-program or split over the context, its chunk of the prompt starting anywhere, other
rows beside it. ``tl.dot`` is a sum over K in index order here (tests/triton_interpreter.py), so
these checks compare the kernels' own reductions; whether a GPU's MMA instructions agree across
tile sizes is what ``self_check`` and ``bench/gpu_kernel_bits.py`` check on the GPU. Contexts of
a few hundred keys cross several chunks by making ``chunk_keys`` small (two key tiles).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# Before Triton is imported: it reads the switch once (as tests/test_triton_kernels.py does).
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

CHUNK = 128  # chunk_keys for the tests: two KV_TILEs, so 300 keys make three chunks
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (heads, kv_heads, head_dim, block_size): a group and head size powers of two, then neither. The
# second alone takes every path (rows of a tile past the last group masked, head columns masked,
# a block table of small blocks), so the first, the larger, is in the slow tier.
SHAPES = pytest.mark.parametrize("shape", [pytest.param((8, 2, 32, 16), marks=pytest.mark.slow), (6, 2, 24, 8)],
                                 ids=["gqa4-d32-bs16", "gqa3-d24-bs8"])


@pytest.fixture(scope="module")
def attn():
    """daskllm.engines.triton_kernels.attention under the interpreter as tests/triton_interpreter.py patches it."""
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1")
    from tests.triton_interpreter import kernel_check_interpreter

    with kernel_check_interpreter():
        from daskllm.engines.triton_kernels import attention

        yield attention


class Case:
    """A cache of random keys and values for sequences of ``contexts`` keys, their block tables
    shuffled, and query rows for each sequence's last ``queries`` positions."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, contexts: tuple[int, ...],
                 queries: tuple[int, ...], seed: int = 0):
        self.heads, self.kv_heads, self.head_dim, self.block = shape
        gen = torch.Generator().manual_seed(seed)
        width = math.ceil(max(contexts) / self.block)
        n_blocks = width * len(contexts) + 1
        cache = (n_blocks, self.kv_heads, self.block, self.head_dim)
        self.k, self.v = (torch.randn(cache, generator=gen).to(dtype) for _ in range(2))
        self.tables = torch.randperm(n_blocks, generator=gen)[:width * len(contexts)].view(len(contexts), -1).int()
        self.rows = [(s, pos) for s, (n, m) in enumerate(zip(contexts, queries)) for pos in range(n - m, n)]
        self.q = torch.randn(len(self.rows), self.heads, self.head_dim, generator=gen).to(dtype)
        self.group = self.heads // self.kv_heads

    def tiles(self, per_tile: int, offset: int = 0) -> list[tuple[int, int, int, int]]:
        """Each sequence's query rows in tiles of ``per_tile`` positions, the first ``offset`` short
        (so its tiles, and the chunk of the prompt they belong to, start elsewhere)."""
        tiles = []
        for s in sorted({s for s, _ in self.rows}):
            rows = [i for i, (t, _) in enumerate(self.rows) if t == s]
            cuts = sorted({0, len(rows), *range(offset % per_tile or per_tile, len(rows), per_tile)})
            tiles += [(s, rows[a], b - a, self.rows[rows[a]][1]) for a, b in zip(cuts, cuts[1:])]
        return tiles

    def run(self, attn, tiles: list, **kw) -> torch.Tensor:
        return attn.paged_attention(self.q, self.k, self.v, torch.tensor(tiles, dtype=torch.int32), self.tables,
                                    **{"chunk_keys": CHUNK, **kw})

    def reference(self) -> torch.Tensor:
        """Torch's softmax attention in float32, row by row."""
        out = torch.empty(self.q.shape)
        for i, (s, pos) in enumerate(self.rows):
            keys, vals = ((c[self.tables[s].long()].transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)
                           [:, :pos + 1].float().repeat_interleave(self.group, 0)) for c in (self.k, self.v))
            scores = torch.einsum("hd,hkd->hk", self.q[i].float(), keys) / self.head_dim ** 0.5
            out[i] = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), vals)
        return out


@DTYPES
@SHAPES
def test_matches_a_float32_softmax_over_several_chunks(attn, dtype, shape):
    case = Case(shape, dtype, contexts=(300, 45), queries=(40, 3))  # 300 keys: chunks 0..2; 45: one
    out = case.run(attn, case.tiles(attn.positions_per_tile(case.group)))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.03, "rtol": 0.03}
    torch.testing.assert_close(out.float(), case.reference(), **tol)


def _step(attn, shape) -> tuple[Case, list, torch.Tensor]:
    """Positions 250..299 of a sequence, across the chunk boundary at 256 (a tile reaching chunk 2
    adds its empty state to its rows before 256), and 160..169 of another, in prefill tiles; one
    KV head (the accuracy test has two)."""
    heads, kv_heads, head_dim, block = shape
    case = Case((heads // kv_heads, 1, head_dim, block), torch.bfloat16, contexts=(300, 170), queries=(50, 10))
    prefill = case.tiles(attn.positions_per_tile(case.group))
    return case, prefill, case.run(attn, prefill)


@pytest.mark.bits
@SHAPES
def test_a_rows_bits_do_not_depend_on_the_split_or_the_tiling(attn, shape):
    case, prefill, want = _step(attn, shape)
    runs = {
        "split, fewer programs than chunks": case.run(attn, prefill, split_chunks=2),
        "split, more programs than chunks": case.run(attn, prefill, split_chunks=5),
        "tiles starting 7 positions later": case.run(attn, case.tiles(attn.positions_per_tile(case.group), offset=7)),
        "tiles in reverse order": case.run(attn, prefill[::-1]),
    }
    for name, got in runs.items():
        assert torch.equal(got, want), name


@pytest.mark.bits
@SHAPES
def test_a_decodes_bits_are_its_rows_in_a_prefill_tile(attn, shape):
    """Decodes of a few rows (by the chunk boundary, at a tile's edge, a context's last), in
    decode tiles, split, in tiles of the prefill's rows, and one alone in its step."""
    case, prefill, want = _step(attn, shape)
    picks = [case.rows.index(r) for r in ((0, 255), (0, 256), (0, 281), (0, 299), (1, 169))]
    decode = [(case.rows[i][0], i, 1, case.rows[i][1]) for i in picks]
    runs = {
        "decode tiles": case.run(attn, decode, tile_rows=attn.DECODE_ROWS),
        "decode tiles, split": case.run(attn, decode, tile_rows=attn.DECODE_ROWS, split_chunks=2),
        "decode tiles of the prefill's rows": case.run(attn, decode),
    }
    for name, got in runs.items():
        assert torch.equal(got[picks], want[picks]), name
    i = picks[0]
    alone = attn.paged_attention(case.q[i:i + 1].contiguous(), case.k, case.v,
                                 torch.tensor([[0, 0, 1, 255]], dtype=torch.int32), case.tables[:1],
                                 tile_rows=attn.DECODE_ROWS, chunk_keys=CHUNK)
    assert torch.equal(alone[0], want[i])


@pytest.mark.bits
def test_a_steps_decode_and_prefill_tiles_can_be_two_calls_into_one_output(attn):
    """As the backend runs a mixed step: sequence 1's rows as decodes (decode tiles, split), then
    sequence 0's in prefill tiles, into the same ``out``: every row as one call gives it."""
    case, prefill, want = _step(attn, (8, 2, 32, 16))
    decode = [(1, i, 1, pos) for i, (s, pos) in enumerate(case.rows) if s == 1]
    out = case.run(attn, decode, tile_rows=attn.DECODE_ROWS, split_chunks=2)
    assert case.run(attn, [t for t in prefill if t[0] == 0], out=out) is out
    assert torch.equal(out, want)
    with pytest.raises(ValueError):
        case.run(attn, prefill, out=out.float())


@pytest.mark.bits
def test_padding_tiles_compute_and_write_nothing(attn):
    """Tiles of 0 rows (a CUDA graph's padding), even ones naming rows and positions of real
    sequences, leave their rows as they were, in-program and split, and change no other row."""
    case = Case((8, 2, 32, 16), torch.float32, contexts=(200,), queries=(6,))
    real = [(0, 0, 4, 194)]  # rows 4 and 5 are in no tile
    padding = [(0, 4, 0, 198), (0, 0, 0, 0), (0, 5, 0, 199)]
    want = case.run(attn, real)
    for split in (0, 3):
        got = case.run(attn, padding[:2] + real + padding[2:], split_chunks=split, out=torch.full_like(case.q, 7.0))
        assert torch.equal(got[:4], want[:4]) and bool((got[4:] == 7.0).all()), split
        assert bool((case.run(attn, padding, split_chunks=split, out=torch.full_like(case.q, 7.0)) == 7.0).all()), split


@pytest.mark.bits
def test_self_check_finds_every_path_equal_under_the_interpreter(attn):
    result = attn.self_check("cpu", torch.bfloat16, heads=8, kv_heads=1, head_dim=16, block_size=8,
                             contexts=(1, 140), chunk_keys=CHUNK)  # a group of 8: 16 positions a tile
    assert {k: v for k, v in result.items() if k != "layout"} == {"decode_tile": True, "split": True,
                                                                   "split_decode_tile": True}
    assert result["layout"] == attn.AttentionLayout(decode_rows=attn.DECODE_ROWS, split=True)


def test_layout_constants_and_arguments(attn):
    assert attn.CHUNK_KEYS % attn.KV_TILE == 0
    assert [attn.positions_per_tile(g) for g in (1, 3, 4, 8)] == [128, 42, 32, 16]
    assert attn.positions_per_tile(4, attn.DECODE_ROWS) == 4
    case = Case((8, 2, 32, 16), torch.float32, contexts=(20,), queries=(1,))
    for bad in ({"tile_rows": 48}, {"tile_rows": 8}, {"chunk_keys": 96}):
        with pytest.raises(ValueError):
            case.run(attn, [(0, 0, 1, 19)], **bad)
