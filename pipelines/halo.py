"""Halo's agentic workflows W1-W6 (halo.txt, Table 2; end-to-end results in Figure 7).

A batch of queries runs through one template per operator (Halo consolidates them into one
plan; so does daskllm: one batched call per operator).

- ``w1`` multi-step chain: retrieve → extract and summarize → derive a secondary conclusion.
- ``w2`` adversarial reasoning: answer → critique → revised final answer.
- ``w3``: W2 with two models (the critic is ``model2``).
- ``w4`` multi-agent voting: political, economic and social agents judge in parallel, an
  aggregator reaches the decision.
- ``w5``: W4 with two models (the agents run ``model2``, the aggregator ``model``).
- ``w6`` multi-turn: ``turns`` turns, each answering a follow-up with the conversation so far.

    python -m pipelines.halo --pipeline w4 --queries 16
"""

from __future__ import annotations

from pipelines.ops import Lazy

SYSTEM = ("You are one step of an analysis workflow. Be factual and brief. Keep names, numbers and units "
          "exactly as given. ")
EXTRACT = SYSTEM + "Passages:\n{p}\nQuestion: {q}\nExtract and summarize what the passages say about it:"
CONCLUDE = SYSTEM + "Summary: {s}\nQuestion: {q}\nDerive one further conclusion from the summary:"
ANSWER = SYSTEM + "Question: {q}\nAnswer step by step:"
CRITIQUE = SYSTEM + "Question: {q}\nProposed answer: {a}\nCritique the answer: list its mistakes:"
REVISE = SYSTEM + "Question: {q}\nProposed answer: {a}\nCritique: {c}\nGive the corrected final answer:"
PERSPECTIVES = ("political", "economic", "social")
JUDGE = SYSTEM + "You judge from the {view} perspective.\nCase: {q}\nYour judgment:"
AGGREGATE = (SYSTEM + "Case: {q}\nPolitical judgment: {j0}\nEconomic judgment: {j1}\nSocial judgment: {j2}\n"
             "Reach a final decision by consensus:")
FOLLOW_UPS = ("Explain that in more detail.", "Give an example.", "Summarize in one sentence.",
              "What is a common mistake here?", "How would you test it?")


def w1(inputs, ops=None, *, model: str | None = None, k: int = 3, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    passages = ops.search(inputs.index, q, k=k)
    summary = ops.generate(EXTRACT, p=passages, q=q, max_tokens=max_tokens)
    return ops.generate(CONCLUDE, s=summary, q=q, max_tokens=max_tokens)


def w2(inputs, ops=None, *, model: str | None = None, model2: str | None = None, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    answer = ops.generate(ANSWER, q=q, max_tokens=max_tokens)
    critique = ops.generate(CRITIQUE, q=q, a=answer, model=model2, max_tokens=max_tokens)
    return ops.generate(REVISE, q=q, a=answer, c=critique, max_tokens=max_tokens)


def w3(inputs, ops=None, *, model: str | None = None, model2: str | None = None, max_tokens: int = 16):
    return w2(inputs, ops, model=model, model2=model2, max_tokens=max_tokens)


def w4(inputs, ops=None, *, model: str | None = None, model2: str | None = None, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    judgments = {f"j{i}": ops.generate(JUDGE, view=view, q=q, model=model2, max_tokens=max_tokens)
                 for i, view in enumerate(PERSPECTIVES)}
    return ops.generate(AGGREGATE, q=q, max_tokens=max_tokens, **judgments)


def w5(inputs, ops=None, *, model: str | None = None, model2: str | None = None, max_tokens: int = 16):
    return w4(inputs, ops, model=model, model2=model2, max_tokens=max_tokens)


def w6(inputs, ops=None, *, model: str | None = None, turns: int = 3, max_tokens: int = 16):
    ops = ops or Lazy(model)
    template, slots = SYSTEM + "User: {q}\nAssistant:", {"q": inputs.questions}
    reply = ops.generate(template, max_tokens=max_tokens, **slots)
    for turn in range(1, turns):
        # The conversation so far is the next turn's prompt prefix: it grows turn by turn.
        slots[f"r{turn}"] = reply
        template += f" {{r{turn}}}\nUser: {FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}\nAssistant:"
        reply = ops.generate(template, max_tokens=max_tokens, **slots)
    return reply


PIPELINES = {"w1": w1, "w2": w2, "w3": w3, "w4": w4, "w5": w5, "w6": w6}

if __name__ == "__main__":
    from pipelines import main

    main(PIPELINES)
