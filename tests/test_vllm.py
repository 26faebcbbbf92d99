"""The vLLM backend: choosing it, its errors, its translations, and a real engine's features.

The engine itself runs the whole Engine-protocol suite (tests/test_engine_protocol.py, its
vllm half) on vLLM's CPU build in .venv-vllm (``make test-vllm``), and
tests/test_vllm_cluster.py runs everything above the engine on vLLM workers. Here: choosing
the backend, the clear errors where vLLM cannot run, the translations between our types and
vLLM's (pure functions, tested with plain values), dummy-weight recipes, and (marker
``vllm``, on the session's real engine) what the protocol suite does not cover: constrained
output through vLLM's structured outputs, logprobs, KV events as cache state, and the
tokens against the torch engine's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import pytest

from daskllm import models
from daskllm.engines import EngineSpec, SamplingParams, StructuredOutput
from daskllm.engines.kv_cache import block_hashes
from daskllm.engines.vllm import KVEventTranslator, PrefixShadow, finish_reason, sampling_kwargs, unavailable_reason
from helpers import wait_for

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


# --- a real vLLM engine (marker vllm: make test-vllm) -----------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "year": {"type": "integer", "minimum": 0, "maximum": 3000}},
          "required": ["name", "year"], "additionalProperties": False}
QUESTIONS = [f"Question {i}: what is {i} + {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def vllm_engine(vllm_engines):
    engine = vllm_engines["main"]
    assert engine.reset_prefix_cache()
    return engine


@pytest.fixture(scope="module")
def torch_engine(tiny_model_dir):
    from daskllm.engines.torch_engine import TorchEngine

    with TorchEngine(str(tiny_model_dir), name="tiny", kv_cache_tokens=4096, device="cpu") as engine:
        yield engine


def _both(vllm_engine, torch_engine, prompts, params):
    return [e.generate(prompts, params) for e in (vllm_engine, torch_engine)]


@pytest.mark.vllm
@pytest.mark.parametrize("constraint", [StructuredOutput.json_schema(PERSON),
                                        StructuredOutput.choice(["red", "green", "dark purple"]),
                                        StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,4}")],
                         ids=["json_schema", "choice", "regex"])
def test_structured_outputs_give_the_torch_engine_s_greedy_tokens(vllm_engine, torch_engine, constraint):
    """Both engines mask with llguidance over the same grammar, so greedy constrained decoding
    picks the same tokens; seeded sampling stays inside the grammar."""
    params = SamplingParams(max_tokens=32, structured=constraint)
    ours, theirs = _both(vllm_engine, torch_engine, QUESTIONS, params)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs] == ["eos"] * len(QUESTIONS)
    sampled = vllm_engine.generate(QUESTIONS, params.replace(temperature=1.0, seed=3))
    for c in ours + sampled:
        if constraint.kind == "json_schema":
            obj = json.loads(c.text)
            assert list(obj) == ["name", "year"] and len(obj["name"]) <= 8 and 0 <= obj["year"] <= 3000
        elif constraint.kind == "choice":
            assert c.text in ("red", "green", "dark purple")
        else:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text), c.text


@pytest.mark.vllm
def test_required_tool_calls_follow_the_tools_schemas(vllm_engine, torch_engine):
    """``tool_choice: required`` over two tools is JSON-schema output of a list of calls (the
    serve routes build it so): the same tokens on both engines, each call valid."""
    from daskllm.serve.tools import tools_of

    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = tools_of([{"type": "function", "function": {"name": name, "parameters": city}}
                      for name in ("weather", "time")], "required", False)  # one call: random weights ramble
    params = SamplingParams(max_tokens=96, structured=StructuredOutput.json_schema(tools.schema()))
    ours, theirs = _both(vllm_engine, torch_engine, QUESTIONS[:4], params)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for c in ours:
        calls = json.loads(c.text)
        assert calls and all(call["name"] in ("weather", "time") and set(call["parameters"]) == {"city"}
                             for call in calls), c.text


@pytest.mark.vllm
def test_logprobs_are_the_torch_engine_s(vllm_engine, torch_engine):
    """Chosen and top-k log-probabilities of the processed distribution: numerically the torch
    engine's (within float32 rounding), for greedy and masked requests; asking changes no token."""
    for params in (SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=1, allowed_token_ids=(100, 200, 300), logprobs=2)):
        ours, theirs = _both(vllm_engine, torch_engine, QUESTIONS[:4], params)
        plain = vllm_engine.generate(QUESTIONS[:4], params.replace(logprobs=None))
        for a, b, p in zip(ours, theirs, plain):
            assert a.token_ids == b.token_ids == p.token_ids and p.logprobs is None
            assert len(a.logprobs) == len(a.top_logprobs) == len(a.token_ids)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
            for top_a, top_b, chosen in zip(a.top_logprobs, b.top_logprobs, a.token_ids):
                assert chosen in top_a
                assert set(top_a) - {chosen} == set(top_b) - {chosen}
                assert all(top_a[t] == pytest.approx(top_b[t], abs=1e-3) for t in top_b if t in top_a)


@pytest.mark.vllm
def test_kv_events_are_the_cache_state_placement_reads(vllm_engine):
    """cache_state() is built from vLLM's own KV-cache events, in our block hashes: a prompt's
    full blocks appear once it ran, a prefill handle names them, a reset clears them all."""
    bs = vllm_engine.block_size
    prompt = list(range(1000, 1000 + 3 * bs + 5))
    assert vllm_engine.reset_prefix_cache()
    assert not vllm_engine.cache_state().resident_hashes
    handle = vllm_engine.prefill(prompt)
    assert handle.block_hashes == tuple(block_hashes(prompt, bs))[:3]
    wait_for(lambda: set(handle.block_hashes) <= vllm_engine.cache_state().resident_hashes, 10,
             what="the prefilled blocks reported by KV events", interval=0.02)
    done = vllm_engine.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=60)
    assert done.num_cached_tokens == 3 * bs
    assert vllm_engine.reset_prefix_cache()
    assert not vllm_engine.cache_state().resident_hashes
    assert vllm_engine.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=60) \
        .num_cached_tokens == 0
