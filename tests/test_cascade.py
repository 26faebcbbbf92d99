"""Model cascades for filter (issue 20 item 9): the engines report the chosen tokens'
probabilities, and ``filter(cascade=...)`` answers confident rows with a cheap proxy model."""

from __future__ import annotations

import math

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch

import daskllm
from daskllm.engines import SamplingParams
from daskllm.prompts import tokenizer_for


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from daskllm.engines.torch_engine import TorchEngine

    with TorchEngine("tiny", kv_cache_tokens=2048, device="cpu") as engine:
        yield engine


PROMPTS = ["Is the sky green?\nAnswer yes or no:", "def add(a, b):", "Paris is in France. True?\nAnswer yes or no:"]


def test_a_constrained_answer_s_probability_is_its_share_of_the_allowed_tokens(tiny_engine):
    yes, no = tokenizer_for("tiny").answer_tokens(("yes",))[0], tokenizer_for("tiny").answer_tokens(("no",))[0]
    for prompt in PROMPTS:
        both = tiny_engine.generate([prompt], SamplingParams(max_tokens=1, allowed_token_ids=(yes, no),
                                                             logprobs=2))[0]
        p = math.exp(both.logprobs[0])
        assert 0.5 <= p <= 1.0  # greedy picks the likelier of two
        other = no if both.token_ids[0] == yes else yes
        # Forcing the other answer: its probability among the allowed tokens is what is left.
        top = both.top_logprobs[0]
        assert set(top) == {yes, no} and top[both.token_ids[0]] == both.logprobs[0]
        assert math.exp(top[yes]) + math.exp(top[no]) == pytest.approx(1.0)  # all the mass is yes or no
        alone = tiny_engine.generate([prompt], SamplingParams(max_tokens=1, allowed_token_ids=(other,),
                                                              logprobs=0))[0]
        assert alone.logprobs == [0.0] and alone.top_logprobs == [{}]  # the only allowed token: probability 1
        plain = tiny_engine.generate([prompt], SamplingParams(max_tokens=1, allowed_token_ids=(yes, no)))[0]
        assert plain.logprobs is None and plain.token_ids == both.token_ids  # asking changes no token


def test_the_torch_engine_s_logprobs_are_transformers_log_softmax(tiny_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)
    for c in tiny_engine.generate(PROMPTS, params):
        ids = list(c.prompt_token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 4
        for token, lp in zip(c.token_ids, c.logprobs):
            with torch.no_grad():
                logits = reference(torch.tensor([ids])).logits[0, -1].double()
            expected = torch.log_softmax(logits, -1)
            assert int(torch.argmax(expected)) == token
            assert lp == pytest.approx(float(expected[token]), abs=1e-3)
            best = torch.topk(expected, 3)
            assert c.top_logprobs[len(ids) - len(c.prompt_token_ids)] == pytest.approx(
                {int(i): float(v) for v, i in zip(best.values, best.indices)}, abs=1e-3)
            ids.append(token)


# --- thresholds (pure) ------------------------------------------------------------------------------


def test_learned_thresholds_meet_the_targets_on_the_sample():
    from daskllm.dataframe.cascade import answers, learn_thresholds

    rng = np.random.default_rng(0)
    labels = rng.random(400) < 0.5
    scores = np.clip(np.where(labels, 0.7, 0.3) + rng.normal(0, 0.2, 400), 0, 1)
    low, high = learn_thresholds(scores, labels, 0.9)
    assert 0 <= low <= high <= 1
    said = answers(scores, low, high, labels)
    by_proxy = (scores > high) | (scores < low)
    assert by_proxy.sum() > 100  # a useful proxy answers many rows
    assert labels[scores > high].mean() >= 0.9 and (~labels[scores < low]).mean() >= 0.9
    assert (said[~by_proxy] == labels[~by_proxy]).all()  # the rest is the oracle's
    _, strict_high = learn_thresholds(scores, labels, 0.99)
    assert strict_high >= high
    low_recall, _ = learn_thresholds(scores, labels, 0.5, target_recall=0.99)
    assert labels[scores < low_recall].sum() <= 0.01 * labels.sum()
    # An uninformative proxy answers nothing.
    flat = np.full(50, 0.5)
    low, high = learn_thresholds(flat, labels[:50], 0.9)
    assert not ((flat > high) | (flat < low)).any()


def test_cascade_options_are_checked():
    with pytest.raises(ValueError, match="target_precision"):
        daskllm.Cascade("tiny", "smollm2", target_precision=0)
    with pytest.raises(ValueError, match="thresholds"):
        daskllm.Cascade("tiny", "smollm2", thresholds=(0.8, 0.2))


# --- on a cluster ----------------------------------------------------------------------------------


def claims(n: int = 16) -> dd.DataFrame:
    facts = ["Paris is the capital of France", "Water boils at 100 degrees Celsius at sea level",
             "The sun orbits the earth", "Cats are a kind of fish", "Two plus two is four",
             "The Pacific is the largest ocean", "Ice is colder than steam", "Fish can climb trees"]
    return dd.from_pandas(pd.DataFrame({"claim": [f"{facts[i % len(facts)]} (note {i // len(facts)})"
                                                  for i in range(n)]}), npartitions=3)


PREDICATE = "Is this claim true? {claim}"


def test_cascade_filter_on_a_cluster(llm_cluster, smollm2_model_dir):
    ddf = claims()
    with llm_cluster(models=["tiny", "smollm2"], n_workers=2, threads_per_worker=4):
        oracle = ddf.llm.filter(PREDICATE, model="smollm2").compute()
        # Thresholds that trust the proxy with nothing: exactly the oracle's answers.
        forced = daskllm.Cascade(proxy="tiny", oracle="smollm2", thresholds=(0.0, 1.0))
        with daskllm.usage() as u:
            assert ddf.llm.filter(PREDICATE, cascade=forced).compute().equals(oracle)
        stats = u.operators["filter-cascade"]
        assert (stats["proxy_rows"], stats["oracle_rows"], stats["oracle_calls_saved"]) == (0, 16, 0)

        learned = daskllm.Cascade(proxy="tiny", oracle="smollm2", target_precision=0.9, sample_size=6, seed=1)
        with daskllm.usage() as u:
            out = ddf.llm.filter(PREDICATE, cascade=learned).compute()
        stats = u.operators["filter-cascade"]
        assert stats["rows"] == 16 and stats["proxy_rows"] + stats["oracle_rows"] == 16
        assert stats["distinct"] == 16 and stats["oracle_calls"] + stats["oracle_calls_saved"] == 16
        assert stats["sample_rows"] == 6 and stats["oracle_calls"] >= 6
        assert 0 <= stats["low"] <= stats["high"] <= 1
        # The oracle's calls are the sample and the unsure rows, each distinct prompt once.
        assert u.operators["filter-oracle"]["distinct"] == stats["oracle_calls"]
        # The same seed learns the same thresholds.
        with daskllm.usage() as again:
            assert ddf.llm.filter(PREDICATE, cascade=learned).compute().equals(out)
        assert (again.operators["filter-cascade"]["low"], again.operators["filter-cascade"]["high"]) == \
            (stats["low"], stats["high"])
