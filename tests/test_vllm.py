"""The vLLM backend, from the side a machine without a GPU can check.

The engine itself runs the whole Engine-protocol suite (tests/test_engine_protocol.py) where
a CUDA GPU and vllm are present, and bench/gpu_smoke.py runs it through the task graph.
Here: choosing the backend, the clear errors where vLLM cannot run, the translations
between our types and vLLM's (pure functions, tested with plain values), and dummy-weight
recipes, which the torch engine loads too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from daskllm import models
from daskllm.engines import EngineSpec, SamplingParams
from daskllm.engines.kv_cache import block_hashes
from daskllm.engines.vllm import KVEventTranslator, PrefixShadow, finish_reason, sampling_kwargs, unavailable_reason

torch = pytest.importorskip("torch")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a CUDA GPU")
no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                             reason="checks what happens where vllm is not installed (here it is)")


@no_vllm
def test_without_vllm_the_error_says_how_to_install_it(tiny_model_dir):
    reason = unavailable_reason()
    assert "not installed" in reason and "make vllm" in reason and "daskllm[vllm]" in reason
    assert EngineSpec(model="tiny", backend="vllm").resolved_backend() == "vllm"
    with pytest.raises(RuntimeError, match="make vllm"):
        EngineSpec(model=str(tiny_model_dir), backend="vllm").load()


@no_gpu
def test_on_cpu_auto_means_torch_and_vllm_serves_llms_only():
    """auto never picks vLLM without a CUDA GPU (docs/vllm.md says why); on CPU, embedders and
    rerankers stay on torch under the vllm backend."""
    assert EngineSpec(model="tiny", backend="auto").resolved_backend() == "torch"
    for kind in ("embed", "rerank"):
        assert EngineSpec(model="all-MiniLM-L6-v2", backend="vllm", kind=kind).resolved_backend() == "torch"


def test_backend_comes_from_the_config_unless_the_spec_names_one():
    import dask

    assert EngineSpec(model="tiny").resolved_backend() == "torch"
    with dask.config.set({"daskllm.engine.backend": "vllm"}):
        assert EngineSpec(model="tiny").resolved_backend() == "vllm"
        assert EngineSpec(model="tiny", backend="torch").resolved_backend() == "torch"
    with dask.config.set({"daskllm.engine.backend": "tpu"}), pytest.raises(ValueError, match="tpu"):
        EngineSpec(model="tiny").resolved_backend()
    with pytest.raises(ValueError, match="backend"):
        EngineSpec(model="tiny", backend="tensorrt")


def test_sampling_params_map_onto_vllm_keywords():
    greedy = sampling_kwargs(SamplingParams(max_tokens=7))
    assert greedy == {"max_tokens": 7, "temperature": 0.0, "top_p": 1.0, "seed": None, "ignore_eos": False,
                      "skip_special_tokens": True}
    full = sampling_kwargs(SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=5, stop=("\n", "END"),
                                          ignore_eos=True, allowed_token_ids=(10, 11)))
    assert full["stop"] == ["\n", "END"] and full["allowed_token_ids"] == [10, 11]
    assert (full["temperature"], full["top_p"], full["seed"], full["ignore_eos"]) == (0.7, 0.9, 5, True)


def test_finish_reasons_in_our_terms():
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", "END") == "stop"  # a stop string
    assert finish_reason("stop", None) == "eos"
    assert finish_reason("stop", 2) == "eos"  # vLLM names the EOS token id
    with pytest.raises(RuntimeError, match="abort"):
        finish_reason("abort", None)


def _stored(hashes, parent, tokens):
    return type("BlockStored", (), {"block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens})()


def _removed(hashes):
    return type("BlockRemoved", (), {"block_hashes": hashes})()


def test_kv_events_translate_to_the_hashes_tasks_carry():
    bs = 4
    prompt = list(range(100, 114))  # three full blocks and two tokens
    ours = block_hashes(prompt, bs)
    t = KVEventTranslator(bs)
    # vLLM stores the first two blocks in one event, the third (a later step) in another
    t.apply(_stored(["v1", "v2"], None, prompt[:8]))
    t.apply(_stored(["v3"], "v2", prompt[8:12]))
    assert t.resident() == set(ours)
    # a block whose parent was stored before we listened cannot be named: not claimed
    t.apply(_stored(["x2"], "x1", [1, 2, 3, 4]))
    assert t.resident() == set(ours)
    t.apply(_removed(["v3"]))
    assert t.resident() == set(ours[:2])
    # a branch off the first block
    t.apply(_stored(["w2"], "v1", [7, 7, 7, 7]))
    assert block_hashes(prompt[:4] + [7, 7, 7, 7], bs)[1] in t.resident()
    t.apply(type("AllBlocksCleared", (), {})())
    assert t.resident() == frozenset()


def test_prefix_shadow_keeps_the_most_recent_blocks():
    shadow = PrefixShadow(3)
    shadow.touch([1, 2, 3])
    shadow.touch([1])  # used again: now the newest
    shadow.touch([4])
    assert shadow.resident() == {1, 3, 4}
    shadow.clear()
    assert shadow.resident() == frozenset()


# --- dummy-weight recipes -------------------------------------------------------------------


def test_realistic_recipes_have_their_published_shapes():
    eight = models.RECIPES["llama-8b"]
    assert eight.dummy_weights
    assert 6.9e9 < eight.approx_params() < 7.2e9  # Llama-3-8B less 0.9B of vocabulary
    assert 0.95e9 < models.RECIPES["llama-1b"].approx_params() < 1.1e9


def test_dummy_recipe_builds_without_weights_and_loads_the_same_weights(tiny_model_dir, monkeypatch):
    """A dummy build of a recipe is the full build minus the weights file: engines draw the
    same tensors from the seed, so the torch engine generates the same tokens from both."""
    from daskllm.engines.torch_engine import TorchEngine

    dummy = dataclasses.replace(models.RECIPES["tiny"], name="tiny-dummy", dummy_weights=True)
    monkeypatch.setitem(models.RECIPES, "tiny-dummy", dummy)
    path = models.resolve("tiny-dummy")
    assert not list(path.glob("*.safetensors"))
    assert json.loads((path / models.DUMMY_MARKER).read_text())["recipe"] == "tiny-dummy"
    assert json.loads((path / "config.json").read_text())["hidden_size"] == dummy.hidden_size
    assert models.resolve("tiny-dummy") == path  # cached
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = ["def add(a, b):", "The quick brown fox"]
    outputs = []
    for name in ("tiny", "tiny-dummy"):
        with TorchEngine(name, kv_cache_tokens=1024, device="cpu") as engine:
            outputs.append([c.token_ids for c in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_vllm_engine_options_reach_the_engine_args():
    """The keyword names we pass exist in vLLM's AsyncEngineArgs (checked where vllm imports)."""
    vllm = pytest.importorskip("vllm", reason="vllm is not installed here")
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert {"model", "tokenizer", "served_model_name", "block_size", "enable_prefix_caching", "tensor_parallel_size",
            "gpu_memory_utilization", "dtype", "max_model_len", "seed", "enforce_eager", "load_format",
            "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_events_config"} <= fields
    assert vllm.SamplingParams(**sampling_kwargs(SamplingParams(max_tokens=3, stop=("x",), seed=1))).max_tokens == 3
