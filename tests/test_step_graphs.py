"""CUDA-graph steps (engines/cuda_graphs.py), run on CPU under Triton's interpreter.

On CPU nothing is captured: a bucket's step runs eagerly through the same fixed buffers, with
the same padding (tokens writing into the scratch block, tiles without rows, logit rows
gathering row 0) that a replay would see. So these tests check that a padded bucket's logits
have the eager step's bits, which is what a replay on a GPU must give too.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import BLOCK, _Seq, forward_step, step_lists

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported, as in test_triton_kernels.py
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="TRITON_INTERPRET is not 1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A two-layer Llama (the interpreter runs a program at a time) on the Triton backend, cache allocated."""
    from daskllm.engines.llama import LlamaModel
    from tests.helpers import write_micro_llama
    from tests.triton_interpreter import kernel_check_interpreter

    path = write_micro_llama(tmp_path_factory.mktemp("micro"))
    with kernel_check_interpreter():
        m = LlamaModel(path, dtype=torch.bfloat16, backend="triton")
        m.allocate_cache(40, BLOCK)
        yield m


def test_buckets_follow_the_step_shape():
    from daskllm.engines.cuda_graphs import Bucket, buckets

    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert Bucket(8, 8, 0, 0, 0).decode and not Bucket(16, 8, 9, 8, 0).decode


@pytest.mark.bits
def test_a_padded_decode_bucket_gives_the_eager_logits(model):
    from daskllm.engines.cuda_graphs import StepGraphs

    graphs = StepGraphs(model, max_seqs=8, max_tokens=64)
    assert [b.tokens for b in graphs.decode] == [1, 2, 4, 8]
    assert [b.tokens for b in graphs.mixed] == [16, 24, 32, 48, 64]
    seqs = [_Seq(10 + i, 17 + 9 * i, 6 * i, 512) for i in range(3)]
    for s in seqs:
        s.ids.append(42)
    forward_step(model, [(s, 0, len(s.ids) - 1) for s in seqs])
    ids, positions, slots, step, rows = step_lists([(s, len(s.ids) - 1, 1) for s in seqs])
    tiles = model.backend.step_tiles(step)
    bucket = graphs.bucket(len(ids), len(step), True, len(tiles[0]), len(tiles[1]), len(rows))
    assert bucket.decode and bucket.tokens == 4
    logits = graphs.run(bucket, ids, positions, slots, tiles, [s[3] for s in step], rows).clone()
    eager = forward_step(model, [(s, len(s.ids) - 1, 1) for s in seqs])  # rewrites the same K/V
    assert logits.shape == (3, 512)
    for i, s in enumerate(seqs):
        assert torch.equal(logits[i], eager[id(s)]), i


@pytest.mark.bits
def test_a_padded_mixed_bucket_gives_the_eager_logits(model):
    """Two prompts' chunks (one on a cached prefix) and a decode in one step of 31 tokens: bucket 32."""
    from daskllm.engines.cuda_graphs import StepGraphs

    graphs = StepGraphs(model, max_seqs=8, max_tokens=64)
    a, b, c = _Seq(1, 40, 0, 512), _Seq(2, 12, 10, 512), _Seq(3, 9, 20, 512)
    forward_step(model, [(a, 0, 20), (c, 0, 8)])  # a's first 20 tokens and c's prompt are cached
    parts = [(a, 20, 20), (b, 0, 10), (c, 8, 1)]
    ids, positions, slots, step, rows = step_lists(parts)
    tiles = model.backend.step_tiles(step)
    assert len(ids) == 31 and len(tiles[0]) == 1
    bucket = graphs.bucket(len(ids), len(step), False, len(tiles[0]), len(tiles[1]), len(rows))
    assert not bucket.decode and bucket.tokens == 32
    logits = graphs.run(bucket, ids, positions, slots, tiles, [s[3] for s in step], rows).clone()
    eager = forward_step(model, parts)
    assert logits.shape == (3, 512)
    for i, (seq, _, _) in enumerate(parts):
        assert torch.equal(logits[i], eager[id(seq)]), i
    assert graphs.bucket(65, 2, False, 0, 3, 2) is None  # past the largest bucket: eager


@pytest.mark.bits
@pytest.mark.slow  # about 15 s under the interpreter
def test_prepare_compiles_first_then_keeps_the_paths_the_device_computes_exactly(model, monkeypatch):
    """TritonBackend.prepare, as an engine on a GPU calls it at load: inside compile_only (where the
    interpreter runs nothing) the checks and the walk only compile; then, for real, self_check sets
    the attention layout and every product's plan is verified. A device whose decode tiles round
    otherwise keeps decode tiles of the prefill tile's rows."""
    import functools

    from daskllm.engines import triton_kernels
    from daskllm.engines.cuda_graphs import StepGraphs

    backend = model.backend
    quick = functools.partial(triton_kernels.self_check, contexts=(1, 24), chunk_keys=64)  # small: the orchestration
    monkeypatch.setattr(backend.kernels, "self_check", quick)
    walked = []

    def walk():
        assert triton_kernels.compiling_only() and backend.layout.split  # the fast layout, compiled for
        walked.append(True)
        StepGraphs(model, max_seqs=4, max_tokens=32, capture=False).walk()

    products = [model.layers[0]["qkv"], model.lm_head]  # two of them: verifying each is slow here
    for product in products:
        product.checked = False
    result = backend.prepare(model.device, model.dtype, products, walk, workers=1)
    assert walked and not triton_kernels.compiling_only()
    assert result["decode_tile"] and result["split"] and backend.layout == result["layout"]
    assert backend.layout.decode_rows == triton_kernels.DECODE_ROWS and backend.layout.split
    assert all(p.checked for p in products)

    def differs(*args, **kwargs):
        checked = quick(*args, **kwargs)
        return {**checked, "decode_tile": False, "layout": triton_kernels.AttentionLayout(split=checked["split"])}

    monkeypatch.setattr(backend.kernels, "self_check", differs)
    backend.prepare(model.device, model.dtype, [], lambda: None, workers=1)
    assert backend.layout.decode_rows == triton_kernels.PREFILL_ROWS
    backend.layout = triton_kernels.AttentionLayout()  # the module's other tests plan with the default
