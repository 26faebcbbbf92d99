"""Harmonia's RAG workflows with data-dependent control flow (harmonia.txt, Section 2 and
Table 1: Corrective-RAG and Adaptive-RAG).

- ``corrective_rag``: retrieve, a grader LLM judges the retrieved passages; relevant → answer
  from them; not relevant → the conditional fallback branch rewrites the query and
  retrieves again (the paper's web search) before answering.
- ``adaptive_rag``: a classifier LLM routes each query to one of three paths: ``simple``
  (the LLM alone), ``standard`` (single-pass RAG) or ``complex`` (iterative RAG: retrieve,
  draft, retrieve again with the draft, answer).

Branches are plain Python in per-query functions (``ops.each``): the branch not taken is
never built, let alone run. With random-weight models the grader's and classifier's picks
are arbitrary but deterministic, so both branches run on a batch of queries.

    python -m pipelines.harmonia --pipeline adaptive_rag --queries 8
"""

from __future__ import annotations

from pipelines.ops import Items, Lazy, picked

GRADE = "Passages:\n{d}\nQuestion: {q}\nAre the passages relevant to the question? Answer yes or no:"
REWRITE = "Question: {q}\nRewrite it as a better search query:"
ANSWER = "Context:\n{c}\nQuestion: {q}\nAnswer:"
CLASSIFY = "Question: {q}\nHow hard is it to answer: simple, standard or complex?"
ALONE = "Question: {q}\nAnswer:"
DRAFT = "Context:\n{c}\nQuestion: {q}\nA first draft of the answer:"
ROUTES = ("simple", "standard", "complex")


def corrective_rag(inputs, ops=None, *, model: str | None = None, k: int = 3, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    docs = ops.search(inputs.index, q, k=k)
    grades = ops.choose(GRADE, ("yes", "no"), d=docs, q=q)
    return ops.each(_correct, q, docs, grades, inputs.index, k, max_tokens)


def _correct(ops, question, docs, grade, index, k, max_tokens):
    if picked(grade, ("yes", "no")) == "yes":
        context = Items(docs)
    else:
        context = ops.search(index, ops.generate(REWRITE, q=question, max_tokens=max_tokens), k=k)
    return ops.generate(ANSWER, c=context, q=question, max_tokens=max_tokens)


def adaptive_rag(inputs, ops=None, *, model: str | None = None, k: int = 3, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    routes = ops.choose(CLASSIFY, ROUTES, q=q)
    return ops.each(_route, q, routes, inputs.index, k, max_tokens)


def _route(ops, question, route, index, k, max_tokens):
    route = picked(route, ROUTES)
    if route == "simple":
        return ops.generate(ALONE, q=question, max_tokens=max_tokens)
    context = ops.search(index, question, k=k)
    if route == "complex":
        draft = ops.generate(DRAFT, c=context, q=question, max_tokens=max_tokens)
        context = ops.search(index, draft, k=k)
    return ops.generate(ANSWER, c=context, q=question, max_tokens=max_tokens)


PIPELINES = {"corrective_rag": corrective_rag, "adaptive_rag": adaptive_rag}

if __name__ == "__main__":
    from pipelines import main

    main(PIPELINES)
