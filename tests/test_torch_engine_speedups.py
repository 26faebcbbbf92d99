"""The torch engine's forward pass on architectures the ``tiny`` recipe does not exercise.

Small random Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (with q/k norms) checkpoints, written
by transformers: the paged forward pass gives transformers' logits (prefill, then decodes
over the cache), and a decode row has the same bits alone, batched with other decodes and
a prefill, and computed as the last row of a prefill.
"""

from __future__ import annotations

import pytest
import torch

from daskllm.engines.llama import LlamaModel, StepInput

BLOCK = 16
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    if request.param == "qwen3":
        config = transformers.Qwen3Config(**SIZES, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # biases and norm weights are zeros/ones at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path)
    return path, model


def _step(model, parts):
    """One step over ``parts`` = [(ids, table, first, n)]; returns the logits of each part's last row."""
    ids, positions, slots, seqs, rows = [], [], [], [], []
    for tokens, table, first, n in parts:
        row = len(ids)
        ids += tokens[first:first + n]
        positions += range(first, first + n)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + n)]
        seqs.append((row, n, first, table))
        rows.append(row + n - 1)
    return model.forward(StepInput(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), seqs, rows))


def test_forward_matches_transformers(checkpoint):
    path, reference = checkpoint
    model = LlamaModel(path)
    model.allocate_cache(16, BLOCK)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    table = [0, 1, 2]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    got = [_step(model, [(tokens, table, 0, 30)])[0]]
    got += [_step(model, [(tokens, table, p, 1)])[0] for p in range(30, 40)]  # decodes over the cache
    torch.testing.assert_close(torch.stack(got), expected[29:], atol=1e-4, rtol=1e-4)


@pytest.mark.bits
def test_decode_rows_are_batch_invariant(checkpoint):
    path, _ = checkpoint
    model = LlamaModel(path)
    gen = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (38, 21, 50))
    ta, tb, tc = [0, 1, 2], [3, 4], [5, 6, 7, 8]

    model.allocate_cache(16, BLOCK)
    _step(model, [(a, ta, 0, 37)])
    alone = _step(model, [(a, ta, 37, 1)])[0]
    model.allocate_cache(16, BLOCK)
    _step(model, [(b, tb, 0, 20), (a, ta, 0, 37)])
    batched = _step(model, [(b, tb, 20, 1), (c, tc, 0, 50), (a, ta, 37, 1)])[2]
    model.allocate_cache(16, BLOCK)
    prefilled = _step(model, [(a, ta, 0, 38)])[0]
    assert torch.equal(alone, batched), "decode logits change when batched"
    assert torch.equal(alone, prefilled), "a decode and a prefill disagree on the same position"
