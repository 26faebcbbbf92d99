"""Exact tokens with the real model: daskllm sends the ids the model's tokenizer gives for the
whole prompt string, so its greedy answers are transformers' answers.

- For 100 prompts and 100 chats built from real questions (../shared/data when present, else
  questions generated from the stdlib corpus), the ids daskllm plans equal
  ``tokenizer(text).input_ids`` and ``apply_chat_template(..., tokenize=True)``.
- A prompt still waiting for an upstream output knows only ids that no continuation changes:
  they begin the whole string's ids whatever fills the slot.
- Through a 2-worker cluster, greedy answers (a chat, a plain prompt, and a prompt filled by an
  upstream answer) equal transformers' ``generate`` on the whole prompt string, and the
  optimized plan's equal the naive plan's.
"""

from __future__ import annotations

import pytest

import daskllm
from daskllm.plan.ir import Dyn
from daskllm.plan.items import PromptCall, items
from daskllm.runtime.submit import plan as lowered

MODEL = "smollm2"
SYSTEM = "You answer questions in one short sentence."
TEMPLATE = "Answer briefly.\nQuestion: {q}\nAnswer:"


def real_questions(n: int) -> list[str]:
    """``n`` real questions, from every set in ../shared/data when present (long multiple-choice
    prompts with line breaks included), else generated from the stdlib corpus."""
    from daskllm import datasets

    data_dir = datasets.default_data_dir()
    if data_dir is None:
        return list(datasets.stdlib_questions(n)["question"])
    sets = [list(datasets.load_questions(name, data_dir)["question"]) for name in ("hotpotqa", "parallelqa", "movies")]
    mixed = [q for group in zip(*sets) for q in group]
    return mixed[:n]


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model_dir)


@pytest.fixture(scope="module")
def questions(smollm2_model_dir) -> list[str]:
    return real_questions(100)


def _planned(node) -> list[PromptCall]:
    return items(lowered([node]).plan, node)


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def test_prompt_ids_are_the_tokenizers_ids_for_the_whole_string(tokenizer, questions):
    calls = _planned(daskllm.generate(daskllm.prompt(TEMPLATE, q=questions), model=MODEL))
    assert len(calls) == len(questions) == 100
    for question, call in zip(questions, calls):
        assert call.static
        assert list(call.known) == tokenizer(TEMPLATE.format(q=question)).input_ids, question


def test_chat_ids_are_the_chat_templates_ids(tokenizer, questions):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "{q}"}]
    calls = _planned(daskllm.generate(daskllm.chat(messages, q=questions), model=MODEL))
    for question, call in zip(questions, calls):
        expected = _chat_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        assert list(call.known) == expected, question


def test_a_chat_without_system_message_gets_the_templates_default(tokenizer, questions):
    calls = _planned(daskllm.generate(daskllm.chat([{"role": "user", "content": "{q}"}], q=questions[:5]),
                                      model=MODEL))
    for question, call in zip(questions, calls):
        assert list(call.known) == _chat_ids(tokenizer, [{"role": "user", "content": question}])
        assert "SmolLM" in tokenizer.decode(call.known)  # the template's own system prompt


def test_a_waiting_prompts_known_ids_begin_its_ids_whatever_fills_the_slot(tokenizer, questions):
    from daskllm.worker.execute import _tokens

    class Engine:  # what a worker's engine offers the task: its tokenizer
        @staticmethod
        def tokenize(text, add_special_tokens=True):
            return tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    upstream = daskllm.generate(daskllm.prompt("{q}", q=questions), model=MODEL)
    templates = ["Context: {a}\nQ: {q}\nA:", "Context:{a}", "Context:\n\n{a}", "Context: {a} ", "{a}"]
    for template in templates:
        calls = _planned(daskllm.generate(daskllm.prompt(template, a=upstream, q=questions), model=MODEL))
        for question, call in zip(questions, calls):
            assert not call.static
            for answer in (question, " " + question, "\n" + question, "x", "", "’s"):
                values = iter([answer])
                parts = [next(values) if isinstance(p, Dyn) else p for p in call.parts]
                whole = template.format(a=answer, q=question)
                ids = _tokens((call.special, parts), (), Engine)
                assert ids == tokenizer(whole).input_ids, (template, answer)
                assert list(call.known) == ids[:len(call.known)], (template, answer)


def test_shared_prefix_is_the_longest_common_token_prefix(tokenizer, questions):
    """Questions sharing their first words share ids beyond the template's text: the prefix
    pass plans on whole-string ids, not on the template's cut."""
    template = "You are a careful assistant. Answer every question briefly and precisely.\nQuestion: {q}\nAnswer:"
    asked = ["Which one is older, A or B?", "Which one is taller?"]
    plan = lowered([daskllm.generate(daskllm.prompt(template, q=asked), model=MODEL)]).plan
    (prefill,) = [n for n in plan if n.op == "prefill"]
    shared = prefill.params["tokens"]
    first, second = (tokenizer(template.format(q=q)).input_ids for q in asked)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert list(shared) == first[:common]
    assert len(shared) > len(tokenizer(template.split("{q}")[0]).input_ids)


@pytest.fixture(scope="module")
def client(llm_cluster, smollm2_model_dir):
    with llm_cluster(models=[MODEL], n_workers=2, threads_per_worker=4) as client:
        yield client


@pytest.mark.bits
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_answers_through_a_cluster_equal_transformers_generate(client, tokenizer, smollm2_model_dir, questions):
    import torch
    from transformers import LlamaForCausalLM

    asked = [q for q in questions if len(q) < 200][:4] + ["What is the capital of France?",
                                                          "Which Python module reads JSON files?"]
    chats = daskllm.generate(daskllm.chat([{"role": "user", "content": "{q}"}], q=asked), model=MODEL, max_tokens=12)
    plain = daskllm.generate(daskllm.prompt(TEMPLATE, q=asked[:3]), model=MODEL, max_tokens=8)
    followed = daskllm.generate(daskllm.prompt("Question: {q}\nAnswer: {a}\nIs that right? Answer yes or no:",
                                               q=asked[:3], a=daskllm.generate(daskllm.prompt(TEMPLATE, q=asked[:3]),
                                                                               model=MODEL, max_tokens=8)),
                                model=MODEL, max_tokens=4)
    optimized = daskllm.compute(chats, plain, followed, result_cache=False)
    naive = daskllm.compute(chats, plain, followed, passes=[], granularity="query", result_cache=False)
    assert optimized == naive

    reference = LlamaForCausalLM.from_pretrained(smollm2_model_dir)

    def generate(ids: list[int], max_new_tokens: int) -> str:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    got_chats, got_plain, got_followed = optimized
    expected = [generate(_chat_ids(tokenizer, [{"role": "user", "content": q}]), 12) for q in asked]
    assert got_chats == expected
    assert got_plain == [generate(tokenizer(TEMPLATE.format(q=q)).input_ids, 8) for q in asked[:3]]
    answers = [generate(tokenizer(TEMPLATE.format(q=q)).input_ids, 8) for q in asked[:3]]
    assert got_followed == [
        generate(tokenizer(f"Question: {q}\nAnswer: {a}\nIs that right? Answer yes or no:").input_ids, 4)
        for q, a in zip(asked[:3], answers)]
    assert any("Paris" in text for text in got_chats)  # a real model: readable, right answers


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_no_worker_serves_fails_at_submit_naming_it(client):
    from daskllm.runtime.view import ModelNotServedError

    node = daskllm.generate("Hello", model="tiny")
    with pytest.raises(ModelNotServedError, match=r"'tiny'.*hold.*smollm2 \(2 workers\)"):
        daskllm.compute(node)
    with pytest.raises(ModelNotServedError, match="'tiny'"):
        client.compute(node)
    assert daskllm.compute(daskllm.generate("Hello", model=MODEL, max_tokens=2))  # the cluster still serves
