"""The GPU backend's Triton kernels, run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter executes each kernel program with numpy, so it checks the kernels' logic:
indexing through block tables, masking, tiles of every shape, the online softmax, padding
rows, and that a row's result does not depend on the rest of the step (with the same tile
shapes whatever the row count, it cannot). ``tl.dot`` is a sum over K in index order there
(tests/triton_interpreter.py), so those bits are the kernels' own on any host. The bits
a GPU computes are checked on a GPU by ``bench/gpu_check.sh``: greedy tokens
(``bench/gpu_engine.py``) and each kernel's rows (``bench/gpu_kernel_bits.py``). The
interpreter widens 16-bit operands to float32, so bfloat16 runs check the same logic, not
tensor-core rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check_forward_invariance, forward_step

# Before Triton is imported: it reads the switch once. Only Triton kernels notice it, and on a
# CPU machine only this module's run any.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tk():
    """daskllm.engines.triton_kernels, imported under the interpreter as tests/triton_interpreter.py
    patches it: its float products summed over K in order, so on any host a row's bits are the
    kernels' own, not the host BLAS's."""
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1")
    from tests.triton_interpreter import kernel_check_interpreter

    with kernel_check_interpreter():
        from daskllm.engines import triton_kernels

        yield triton_kernels


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.mark.bits
@DTYPES
def test_matmul_rows_do_not_depend_on_the_row_count(tk, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(140, 96, generator=gen).to(dtype)  # rows past one 128-row tile
    w = (torch.randn(80, 96, generator=gen) * 0.1).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype)
    full = tk.matmul(x, w, b)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()),
                               **({} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}))
    for rows in (1, 3, 16, 129):
        assert torch.equal(tk.matmul(x[:rows], w, b), full[:rows]), rows
        assert torch.equal(tk.matmul(x[-rows:], w, b), full[-rows:]), -rows
    assert tk.matmul(x[:0], w).shape == (0, 80)


@pytest.mark.bits
@DTYPES
def test_rms_norm_matches_transformers_formula_row_by_row(tk, dtype):
    from daskllm.engines.backends import rms_norm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 72, generator=gen).to(dtype)  # 72: not a power of two
    w = torch.randn(72, generator=gen).to(dtype)
    out = tk.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out.float(), rms_norm(x, w, 1e-5).float(), atol=1e-5 if dtype == torch.float32
                               else 0.02, rtol=1e-5 if dtype == torch.float32 else 0.02)
    assert torch.equal(tk.rms_norm(x[4:5], w, 1e-5), out[4:5])


def _reference_attention(q, k_cache, v_cache, table, pos):
    """Softmax attention of one query row q [H, d] at ``pos`` over its sequence's blocks."""
    heads, d = q.shape
    kv_heads = k_cache.shape[1]
    keys = torch.cat([k_cache[b] for b in table], dim=1)[:, :pos + 1].float().repeat_interleave(heads // kv_heads, 0)
    vals = torch.cat([v_cache[b] for b in table], dim=1)[:, :pos + 1].float().repeat_interleave(heads // kv_heads, 0)
    scores = (q.float().unsqueeze(1) @ keys.transpose(1, 2)).squeeze(1) / d ** 0.5
    return (torch.softmax(scores, -1).unsqueeze(1) @ vals).squeeze(1)


@pytest.mark.bits
@DTYPES
# A group, head size and block not powers of 2 take every path the powers of 2 do, and the masks: those of
# powers of 2 are in the slow tier.
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [pytest.param(8, 2, 32, 16, marks=pytest.mark.slow),
                                                           (6, 2, 24, 8)], ids=["gqa4-d32-bs16", "gqa3-d24-bs8"])
def test_paged_attention_matches_softmax_and_is_row_invariant(tk, dtype, heads, kv_heads, head_dim, block):
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(24, kv_heads, block, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(24, kv_heads, block, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[3, 1, 7, 9, 11, 13, 15], [2, 5, 0, 0, 0, 0, 0]], dtype=torch.int32)
    # Sequence 0 prefills positions 30..53 (two tiles: 16 + 8 rows), sequence 1 decodes at 19.
    q = torch.randn(25, heads, head_dim, generator=gen).to(dtype)
    tiles = torch.tensor([[0, 0, 16, 30], [0, 16, 8, 46], [1, 24, 1, 19]], dtype=torch.int32)
    out = tk.paged_attention(q, k_cache, v_cache, tiles, tables)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.03, "rtol": 0.03}
    for i in range(24):
        torch.testing.assert_close(out[i].float(), _reference_attention(q[i], k_cache, v_cache, tables[0], 30 + i),
                                   **tol)
    torch.testing.assert_close(out[24].float(), _reference_attention(q[24], k_cache, v_cache, tables[1], 19), **tol)
    # Row 5 (position 35): alone as a decode, and third in a tile of six, gives the same bits.
    alone = tk.paged_attention(q[5:6].contiguous(), k_cache, v_cache, torch.tensor([[0, 0, 1, 35]], dtype=torch.int32),
                               tables)
    among = tk.paged_attention(q[3:9].contiguous(), k_cache, v_cache, torch.tensor([[0, 0, 6, 33]], dtype=torch.int32),
                               tables)
    assert torch.equal(alone[0], out[5]) and torch.equal(among[2], out[5])


# --- the forward pass on the Triton backend ---------------------------------------------------------


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory):
    from tests.helpers import write_micro_llama

    return write_micro_llama(tmp_path_factory.mktemp("micro"))


@pytest.mark.bits
@pytest.mark.slow  # about 30 s under the interpreter: a dozen steps of every kernel
def test_triton_forward_is_batch_invariant(tk, micro_model_dir):
    """In bfloat16, the GPU default (float32 runs the same kernels with other constants: the
    kernel tests above cover both)."""
    from daskllm.engines.llama import LlamaModel

    model = LlamaModel(micro_model_dir, dtype=torch.bfloat16, backend="triton")
    assert model.backend.name == "triton"
    check_forward_invariance(model)


def test_triton_forward_matches_the_cpu_backend(tk, micro_model_dir):
    from daskllm.engines.llama import LlamaModel
    from tests.helpers import _Seq

    cpu, gpu = LlamaModel(micro_model_dir), LlamaModel(micro_model_dir, backend="triton")
    seqs = [_Seq(7, 40, 0, 512), _Seq(8, 20, 10, 512)]
    for model in (cpu, gpu):
        model.allocate_cache(20, 16)
    parts = [(seqs[0], 0, 40), (seqs[1], 0, 20)]
    want, got = forward_step(cpu, parts), forward_step(gpu, parts)
    for s in seqs:
        torch.testing.assert_close(got[id(s)], want[id(s)], atol=1e-4, rtol=1e-4)


def test_compiled_kernels_are_kept_beside_the_models(tk, tmp_path, monkeypatch):
    """The Triton backend points Triton's cache into daskllm.models.cache-dir (a second start
    where it persists compiles nothing), unless the user set TRITON_CACHE_DIR."""
    import dask
    import triton

    from daskllm.engines.backends import Heads, TritonBackend

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with dask.config.set({"daskllm.models.cache-dir": str(tmp_path)}):
        TritonBackend(Heads(4, 2, 16))
    assert triton.knobs.cache.dir == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    TritonBackend(Heads(4, 2, 16))
    assert triton.knobs.cache.dir == str(tmp_path / "mine")
