"""The llama.cpp engine (backend ``llamacpp``) beyond the protocol suite it also passes
(tests/test_engine_protocol.py): prefix sharing inside one step, choosing it, loading GGUF
files, and a reference pipeline through a real cluster of llama.cpp workers.

It runs the shipped SmolLM2 GGUF file. Skipped where llama-cpp-python is not installed
(``make cpu``; CI installs it).
"""

from __future__ import annotations

import pytest

import daskllm
from daskllm import models
from daskllm.engines import EngineSpec, SamplingParams
from daskllm.engines.kv_cache import block_hashes
from daskllm.engines.llamacpp import unavailable_reason

pytestmark = pytest.mark.skipif(bool(unavailable_reason()), reason=str(unavailable_reason()))

TIMEOUT = 120
SYSTEM = ("You are a concise assistant for a public library. Answer in one short sentence, name the "
          "shelf or the service when you can, and never invent opening hours or prices.")
QUESTIONS = ["Where are the atlases?", "Can I renew a book online?", "Do you lend laptops?",
             "Where is the quiet reading room?", "How do I get a library card?", "Are there comics for teens?",
             "Can I print a document here?", "Where do I return books after hours?"]


@pytest.fixture(scope="module")
def engine():
    eng = EngineSpec(model="smollm2", backend="llamacpp").load(kv_cache_tokens=4096, num_threads=2)
    yield eng
    eng.close()


def _chats(engine, questions=QUESTIONS) -> list[str]:
    return [engine.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in questions]


def test_a_shared_system_prompt_is_computed_once_in_one_step(engine):
    prompts = _chats(engine)
    ids = [engine.tokenize(p) for p in prompts]
    shared = 0
    while all(i[shared] == ids[0][shared] for i in ids):
        shared += 1
    assert shared > 2 * engine.block_size
    engine.reset_prefix_cache()
    before = engine.stats()
    out = engine.generate(prompts, SamplingParams(max_tokens=4))
    after = engine.stats()
    # The first computes the shared blocks; the others wait one step and start from them.
    cached = (shared // engine.block_size) * engine.block_size
    assert [c.num_cached_tokens for c in out] == [0] + [cached] * (len(prompts) - 1)
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == sum(map(len, ids)) - cached * 7
    assert after.max_batch_size >= len(prompts) - 1


def test_finished_sequences_leave_the_context_and_their_prefixes_still_serve(engine):
    """Issue 55: llama.cpp attends over every cell up to the highest in use, masked or not, so
    prefixes kept in the context made a lone decode step cost 4x as much with 64 of them kept.
    Finished sequences' states go to host memory instead: the context holds only the running
    sequences' tokens, whatever the prefix cache holds, and a prompt still starts from them."""
    engine.reset_prefix_cache()
    prompts = _chats(engine)
    finished = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine._context_cells() == {}  # nothing running: no cells, however much is kept
    assert engine._kept_tokens > 0
    state = engine.cache_state()
    assert state.blocks_in_use == 0
    for c in finished:  # every prompt's full blocks are still there for the next request
        assert set(block_hashes(c.prompt_token_ids, engine.block_size)) <= state.resident_hashes

    # A lone request beside the kept prefixes: between steps, the context holds its cells only.
    seen = []
    lone = [100 + i for i in range(40)]  # shares no block with the chats
    engine.submit(lone, SamplingParams(max_tokens=8, ignore_eos=True),
                  on_text=lambda _: seen.append(engine._context_cells())).result(timeout=TIMEOUT)
    assert seen and all(len(cells) == 1 and max(cells.values()) <= len(lone) + 8 for cells in seen)
    assert engine._context_cells() == {}

    # A kept prefix is put back for a prompt that starts with it: its blocks are not recomputed,
    # and the tokens are those the same prompt got alone with nothing cached.
    engine.reset_prefix_cache()
    alone = engine.generate([prompts[0]], SamplingParams(max_tokens=8))[0]
    assert alone.num_cached_tokens == 0 and engine._context_cells() == {}
    again = engine.generate([prompts[0]], SamplingParams(max_tokens=8))[0]
    assert again.num_cached_tokens == (len(alone.prompt_token_ids) - 1) // engine.block_size * engine.block_size
    assert again.token_ids == alone.token_ids
    assert 0 < engine._kept_tokens <= engine.n_ctx
    engine.reset_prefix_cache()
    assert engine._kept_tokens == 0 and not engine.cache_state().resident_hashes


def test_auto_picks_llamacpp_for_gguf_models_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine auto may pick vLLM")
    assert EngineSpec(model="smollm2", backend="auto").resolved_backend() == "llamacpp"
    assert EngineSpec(model="tiny", backend="auto").resolved_backend() == "torch"  # no GGUF file
    # llama.cpp serves LLMs here; embedders stay on torch
    assert EngineSpec(model="all-MiniLM-L6-v2", kind="embed", backend="llamacpp").resolved_backend() == "torch"
    specs = EngineSpec.expand(["smollm2"], ["all-MiniLM-L6-v2"], backend="llamacpp")
    assert [s.backend for s in specs] == ["llamacpp", None]


def test_gguf_files_and_directories(tmp_path):
    shipped = models.resolve_gguf("smollm2")
    assert shipped.suffix == ".gguf" and shipped.is_file()
    one = tmp_path / "one"
    one.mkdir()
    (one / shipped.name).symlink_to(shipped)
    assert models.resolve_gguf(one) == shipped.resolve()
    assert models.resolve_gguf(one / shipped.name) == shipped.resolve()
    assert models.model_name(str(one / shipped.name)) == shipped.stem
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).symlink_to(shipped)
    with pytest.raises(models.ModelNotFoundError, match="2 .gguf files"):
        models.resolve_gguf(two)
    with pytest.raises(models.ModelNotFoundError, match="no GGUF file"):
        EngineSpec(model="tiny", backend="llamacpp").load()
    with pytest.raises(models.ModelNotFoundError, match="not a GGUF file"):
        models.resolve_gguf(tmp_path / "missing.gguf")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_reference_pipeline_through_a_cluster_of_llamacpp_workers(llm_cluster):
    from pipelines import registry
    from pipelines.data import Inputs
    from pipelines.ops import NAIVE, Lazy, plain

    from daskllm.worker import PLUGIN_NAME

    inputs = Inputs(["How do I renew a book?", "Where are the maps?", "Can I borrow a laptop?",
                     "What is interlibrary loan?"])
    pipelines = registry()

    async def engine_kind(dask_worker):
        plugin = dask_worker.plugins[PLUGIN_NAME]
        await plugin.loaded()
        return type(plugin.engines["llm"]["smollm2"]).__name__

    async def mean_batch(dask_worker):
        return dask_worker.plugins[PLUGIN_NAME].engines["llm"]["smollm2"].stats().mean_batch_size

    with llm_cluster(models=[{"model": "smollm2", "backend": "llamacpp"}], embedders=(), rerankers=(),
                     n_workers=2) as client:
        assert set(client.run(engine_kind).values()) == {"LlamaCppEngine"}
        for name in ("w2", "mapred"):
            build = lambda: pipelines[name](inputs, Lazy("smollm2", chat=True), max_tokens=8)  # noqa: E731
            with daskllm.usage() as usage:
                optimized = plain(daskllm.compute(build(), result_cache=False)[0])
            naive = plain(daskllm.compute(build(), **NAIVE)[0])
            # Not compared token for token: llama.cpp is not batch-invariant (docs/engine.md).
            for answers in (optimized, naive):
                assert len(answers) == len(inputs) and all(isinstance(a, str) and a.strip() for a in answers), name
            assert usage.executed["generate"] >= len(inputs)
            assert usage.decode_tokens > 0
        batches = client.run(mean_batch)
        assert max(batches.values()) > 1  # the engines batched requests of different tasks
