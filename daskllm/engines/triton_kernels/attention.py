"""Paged attention, batch-invariant, with flash-attention tiles and the context split into chunks.

A tile holds query positions of one sequence (a decode is a tile of one), the query heads of a
KV head packed into its rows: ``positions_per_tile(group, rows)`` positions of ``group`` heads.
Keys are read through the block table in tiles of ``KV_TILE`` in position order, and the
context is cut at fixed ``CHUNK_KEYS`` boundaries: within a chunk an online softmax in float32
runs from a fresh state, and the chunks' states (max, sum, accumulator) are folded in chunk
order by :func:`_fold`. That sequence of operations is the same for a row whatever its tile,
so a row has the same bits

* in a prefill tile of ``PREFILL_ROWS`` rows or a decode tile of ``DECODE_ROWS`` (where the
  two MMA instructions agree: :func:`self_check`), alone or among others, in a chunk of the
  prompt starting anywhere: key tiles and chunks past a row's position add exact zeros (the
  max unchanged, the rescale exactly 1);
* whether one program folds its chunks or ``split_chunks`` programs write each chunk's state
  to a workspace that a second kernel folds (decode of few sequences, to fill the SMs): both
  run the same helpers, compiled with ``enable_fp_fusion=False`` so that no multiply-add is
  contracted differently in the two kernels; the fused ones are explicit ``tl.fma``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN
from daskllm.engines.triton_kernels._launch import launch

PREFILL_ROWS = 128  # rows of a prefill tile: one K/V tile read for all of them, Hopper's wgmma
DECODE_ROWS = 16  # rows of a decode tile (one position's heads, mma.sync), where self_check allows
KV_TILE = 64  # keys per step of the online softmax, on every path (the steps are part of the reduction)
CHUNK_KEYS = 512  # keys per chunk (a multiple of KV_TILE): decode splits the context at these boundaries
_LOG2E = 1.4426950408889634


def positions_per_tile(group: int, rows: int = PREFILL_ROWS) -> int:
    """Query positions a tile of ``rows`` rows holds, each with the ``group`` query heads of one KV head."""
    return rows // group


@dataclass(frozen=True)
class AttentionLayout:
    """The tiles a backend plans with: prefill and mixed steps in tiles of ``prefill_rows``, decode
    steps in tiles of ``decode_rows``, split over the context only where ``split``."""

    prefill_rows: int = PREFILL_ROWS
    decode_rows: int = PREFILL_ROWS  # DECODE_ROWS once self_check finds its bits equal
    split: bool = False


def fast_layout(group: int) -> AttentionLayout:
    """The layout an engine tries first: decode tiles of DECODE_ROWS (at least one position's
    ``group`` heads) and the split, to be kept only where :func:`self_check` finds them exact."""
    return AttentionLayout(decode_rows=max(DECODE_ROWS, triton.next_power_of_2(group)), split=True)


def _launch(rows: int, dtype: torch.dtype) -> tuple[int, int]:
    """(num_warps, num_stages) of a tile shape, the same for the in-program and split kernels.

    Compiled for sm_90 (bfloat16): a 128-row tile with 8 warps holds the fold's state and a
    chunk's accumulator (two 128 x d float32 tiles) in 163 registers at d=64, 237 at d=128,
    with no spill (4 warps spill); a 16-row tile in 107 / 156 with 4. Float32 (``ieee`` dots on
    the FMA units, a dtype for checks) spills at 128 rows whatever the warps.
    """
    if rows <= 32:
        return 4, 3
    return 8, 2 if dtype == torch.float32 else 3


@triton.jit
def _tile_chunks(tiles_ptr, tile, CHUNK_KEYS: tl.constexpr):
    """A tile's (sequence, first row, rows, first position, chunks its last row reaches): no chunk for padding."""
    seq = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    n_rows = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)
    n_chunks = tl.where(n_rows > 0, (pos0 + n_rows - 1) // CHUNK_KEYS + 1, 0)
    return seq, row0, n_rows, pos0, n_chunks


@triton.jit
def _tile_rows(row0, n_rows, pos0, kv_head, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """Row r of a tile: position r // GROUP, query head r % GROUP of the KV head's group."""
    r = tl.arange(0, ROWS)
    qi = r // GROUP
    valid = (r < (ROWS // GROUP) * GROUP) & (qi < n_rows)
    return (row0 + qi).to(tl.int64), kv_head * GROUP + r % GROUP, valid, pos0 + qi


@triton.jit
def _empty_state(ROWS: tl.constexpr, D_P2: tl.constexpr):
    """The softmax state of no keys: folding it, or into it, changes nothing."""
    return (tl.full((ROWS,), -1.0e30, tl.float32), tl.zeros((ROWS,), tl.float32),
            tl.zeros((ROWS, D_P2), tl.float32))


@triton.jit
def _fold(m, l, acc, m_c, l_c, acc_c):
    """The state (m, l, acc) followed by a chunk's (m_c, l_c, acc_c): the one fold of every path."""
    m_new = tl.maximum(m, m_c)
    a = tl.where(m == m_new, 1.0, tl.exp2(m - m_new))  # exactly 1 for the state with the max
    b = tl.where(m_c == m_new, 1.0, tl.exp2(m_c - m_new))
    return m_new, tl.fma(l, a, l_c * b), tl.fma(acc, a[:, None], acc_c * b[:, None])


@triton.jit
def _chunk_state(q, k_ptr, v_ptr, table_ptr, kv_off, stride_kb, stride_kr, block_size, qk_scale, pos, last,
                 chunk, d, d_ok, ROWS: tl.constexpr, D_P2: tl.constexpr, KV_TILE: tl.constexpr,
                 CHUNK_KEYS: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """The online softmax over a chunk's keys up to the tile's ``last`` position, from the empty state;
    scores in log2 units (``qk_scale`` holds log2(e)).

    The sum of the weights is a product by ones: a ``tl.sum`` adds in the order of the tile's
    register layout, which differs between a 16-row and a 128-row tile; a dot adds as the
    weighted values' dot does (its 16 equal columns, one taken by an exact max).
    """
    m, _, acc = _empty_state(ROWS, D_P2)  # the sum is kept 16 wide, as the dot by ones gives it
    sums = tl.zeros((ROWS, 16), tl.float32)
    start = chunk * CHUNK_KEYS
    for t0 in range(start, tl.minimum(last + 1, start + CHUNK_KEYS), KV_TILE):
        keys = t0 + tl.arange(0, KV_TILE)
        k_ok = keys <= last
        block = tl.load(table_ptr + keys // block_size, mask=k_ok, other=0).to(tl.int64)
        base = kv_off + block * stride_kb + (keys % block_size) * stride_kr
        k = tl.load(k_ptr + base[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_new))  # exactly 1 where no key moved the max
        p = tl.exp2(s - m_new[:, None]).to(v.dtype)  # 16-bit operands for the tensor cores, as flash attention does
        if WIDEN:
            p, v = p.to(tl.float32), v.to(tl.float32)
        sums = tl.dot(p, tl.full((KV_TILE, 16), 1.0, p.dtype), sums * alpha[:, None], input_precision=PRECISION)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    return m, tl.max(sums, axis=1), acc


@triton.jit
def _store_rows(out_ptr, stride_on, stride_oh, rows, heads, valid, l, acc, d, d_ok):
    """The rows' attention, acc / l, into out [N, H, d]."""
    o = rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, tiles_ptr, tables_ptr,
                      stride_qn, stride_qh, stride_kb, stride_kh, stride_kr, stride_on, stride_oh, stride_table,
                      block_size, max_chunks, qk_scale,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, ROWS: tl.constexpr,
                      KV_TILE: tl.constexpr, CHUNK_KEYS: tl.constexpr, SPLIT: tl.constexpr,
                      PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """One program per (tile, KV head) folding every chunk, or with SPLIT per (tile, KV head, j)
    writing the states of chunks j, j + num_programs(2), ... to the workspace. The last tiles start
    first: a prompt's last tiles have the most keys, and the order changes no bits."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    first = 0
    if SPLIT:
        first = tl.program_id(2)
    seq, row0, n_rows, pos0, n_chunks = _tile_chunks(tiles_ptr, tile, CHUNK_KEYS)
    if first >= n_chunks:  # padding tiles, and split programs past the tile's last chunk
        return
    rows, heads, valid, pos = _tile_rows(row0, n_rows, pos0, kv_head, GROUP, ROWS)
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    last = pos0 + n_rows - 1
    table_ptr = tables_ptr + seq * stride_table
    kv_off = kv_head.to(tl.int64) * stride_kh
    if SPLIT:
        r = tl.arange(0, ROWS)
        for chunk in range(first, n_chunks, tl.num_programs(2)):
            m, l, acc = _chunk_state(q, k_ptr, v_ptr, table_ptr, kv_off, stride_kb, stride_kr, block_size, qk_scale,
                                     pos, last, chunk, d, d_ok, ROWS, D_P2, KV_TILE, CHUNK_KEYS, PRECISION, WIDEN)
            state = ((tile * tl.num_programs(1) + kv_head).to(tl.int64) * max_chunks + chunk) * ROWS + r
            tl.store(ws_m_ptr + state, m)
            tl.store(ws_l_ptr + state, l)
            tl.store(ws_acc_ptr + state[:, None] * D_P2 + d[None, :], acc)
    else:
        m, l, acc = _empty_state(ROWS, D_P2)
        for chunk in range(0, n_chunks):
            m_c, l_c, acc_c = _chunk_state(q, k_ptr, v_ptr, table_ptr, kv_off, stride_kb, stride_kr, block_size,
                                           qk_scale, pos, last, chunk, d, d_ok, ROWS, D_P2, KV_TILE, CHUNK_KEYS,
                                           PRECISION, WIDEN)
            m, l, acc = _fold(m, l, acc, m_c, l_c, acc_c)
        _store_rows(out_ptr, stride_on, stride_oh, rows, heads, valid, l, acc, d, d_ok)


@triton.jit
def _combine_paged_attention_kernel(out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, tiles_ptr, stride_on, stride_oh,
                                    max_chunks, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                                    ROWS: tl.constexpr, CHUNK_KEYS: tl.constexpr):
    """One program per (tile, KV head): the workspace's chunk states folded in chunk order, as
    _paged_attention_kernel folds them in one program."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, row0, n_rows, pos0, n_chunks = _tile_chunks(tiles_ptr, tile, CHUNK_KEYS)
    if n_chunks == 0:
        return
    rows, heads, valid, pos = _tile_rows(row0, n_rows, pos0, kv_head, GROUP, ROWS)
    d = tl.arange(0, D_P2)
    r = tl.arange(0, ROWS)
    m, l, acc = _empty_state(ROWS, D_P2)
    for chunk in range(0, n_chunks):
        state = ((tile * tl.num_programs(1) + kv_head).to(tl.int64) * max_chunks + chunk) * ROWS + r
        m_c = tl.load(ws_m_ptr + state)
        l_c = tl.load(ws_l_ptr + state)
        acc_c = tl.load(ws_acc_ptr + state[:, None] * D_P2 + d[None, :])
        m, l, acc = _fold(m, l, acc, m_c, l_c, acc_c)
    _store_rows(out_ptr, stride_on, stride_oh, rows, heads, valid, l, acc, d, d < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: torch.Tensor,
                    tables: torch.Tensor, *, tile_rows: int = PREFILL_ROWS, split_chunks: int = 0,
                    chunk_keys: int = CHUNK_KEYS, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [N, H, d] over one layer's cache [blocks, Hkv, block_size, d].

    ``tiles`` [T, 4] int32 rows are (sequence, first row of q, rows, position of the first
    row), at most ``positions_per_tile(H // Hkv, tile_rows)`` rows of one sequence each, or 0
    rows for a padding tile (nothing is computed or written for it); ``tables`` [S, W] int32
    holds each sequence's cache blocks. Only the tiles' rows of ``out`` (a new tensor like q
    by default) are written: a step's decode and prefill tiles can be two calls into one
    ``out``, each with its own ``tile_rows`` and ``split_chunks``. ``tile_rows``
    (DECODE_ROWS or PREFILL_ROWS) and ``split_chunks`` (0: each program folds its chunks; else
    that many programs per tile and KV head share the chunks, then a kernel folds them) leave a
    row's bits as they are wherever :func:`self_check` says so; ``chunk_keys`` does not (tests
    make it small to cross chunks with few keys). The split path allocates a float32 workspace
    of T x Hkv x ceil(W x block_size / chunk_keys) x tile_rows x (d' + 2), d' the head size
    rounded up to a power of two (at least 16).
    """
    n, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if tile_rows < 16 or tile_rows & (tile_rows - 1) or tile_rows < group:
        raise ValueError(f"tile_rows must be a power of two >= 16 and >= the group of {group}, not {tile_rows}")
    if chunk_keys % KV_TILE or chunk_keys <= 0:
        raise ValueError(f"chunk_keys must be a positive multiple of KV_TILE={KV_TILE}, not {chunk_keys}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}")
    n_tiles = tiles.shape[0]
    if n_tiles == 0:
        return out
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    max_chunks = triton.cdiv(tables.shape[1] * block_size, chunk_keys)
    num_warps, num_stages = _launch(tile_rows, q.dtype)
    ws_m = ws_l = ws_acc = out  # not read without SPLIT
    if split_chunks:
        states = n_tiles * kv_heads * max_chunks * tile_rows  # one state a chunk: the fold's order is fixed
        ws = torch.empty(states * (d_p2 + 2), device=q.device, dtype=torch.float32)
        ws_m, ws_l, ws_acc = ws[:states], ws[states:2 * states], ws[2 * states:]
    shape = dict(GROUP=group, HEAD_DIM=head_dim, D_P2=d_p2, ROWS=tile_rows, CHUNK_KEYS=chunk_keys)
    grid = (n_tiles, kv_heads, split_chunks) if split_chunks else (n_tiles, kv_heads)
    launch(_paged_attention_kernel, grid, q, k_cache, v_cache, out, ws_m, ws_l, ws_acc, tiles, tables,
                                  q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                  out.stride(0), out.stride(1), tables.stride(0), block_size, max_chunks,
                                  head_dim ** -0.5 * _LOG2E, **shape, KV_TILE=KV_TILE, SPLIT=split_chunks > 0,
                                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDEN=_WIDEN,
                                  num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    if split_chunks:
        launch(_combine_paged_attention_kernel, (n_tiles, kv_heads), out, ws_m, ws_l, ws_acc, tiles, out.stride(0),
                                                             out.stride(1), max_chunks, **shape, num_warps=num_warps,
                                                             enable_fp_fusion=False)
    return out


def self_check(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               block_size: int = 16, contexts: tuple[int, ...] = (1, 100, 512, 513, 1500, 2100), split_chunks: int = 3,
               chunk_keys: int = CHUNK_KEYS, seed: int = 0) -> dict:
    """Whether each fast path gives the prefill tiles' bits on this device, for the model's shapes.

    Whether wgmma (a 128-row tile on a Hopper) and mma.sync (16 rows) round alike is not
    documented, so the engine asks once at load. Random data: a sequence per context length
    (the default crosses up to four chunk boundaries), its last positions in prefill tiles of
    ``PREFILL_ROWS`` rows (the reference), then the same rows as decode tiles of ``DECODE_ROWS``
    (``"decode_tile"``), the prefill tiles split over the context (``"split"``), and decode
    tiles split (``"split_decode_tile"``), each True where every bit is equal; ``"layout"`` is
    the AttentionLayout those allow (decode tiles of PREFILL_ROWS rows where DECODE_ROWS differ).
    """
    gen = torch.Generator().manual_seed(seed)
    group = heads // kv_heads
    width = triton.cdiv(max(contexts), block_size)
    n_blocks = width * len(contexts)
    shape = (n_blocks, kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    tables = torch.randperm(n_blocks, generator=gen).view(len(contexts), width).to(device, torch.int32)
    per_tile = positions_per_tile(group)
    prefill, decode = [], []
    for s, n in enumerate(contexts):
        first = max(0, n - per_tile)
        prefill.append((s, len(decode), n - first, first))
        decode += [(s, len(decode) + i, 1, pos) for i, pos in enumerate(range(first, n))]
    q = torch.randn(len(decode), heads, head_dim, generator=gen).to(device, dtype)

    def attend(tiles: list, rows: int, split: int) -> torch.Tensor:
        t = torch.tensor(tiles, dtype=torch.int32, device=device)
        return paged_attention(q, k_cache, v_cache, t, tables, tile_rows=rows, split_chunks=split,
                               chunk_keys=chunk_keys)

    want = attend(prefill, PREFILL_ROWS, 0)
    decode_rows = fast_layout(group).decode_rows
    checks = {"decode_tile": torch.equal(attend(decode, decode_rows, 0), want),
              "split": torch.equal(attend(prefill, PREFILL_ROWS, split_chunks), want),
              "split_decode_tile": torch.equal(attend(decode, decode_rows, split_chunks), want)}
    layout = (AttentionLayout(decode_rows=decode_rows, split=checks["split_decode_tile"]) if checks["decode_tile"]
              else AttentionLayout(split=checks["split"]))
    return {**checks, "layout": layout}
