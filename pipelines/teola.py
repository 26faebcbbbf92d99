"""Teola's document-QA workloads (teola.txt, Figure 2c/2d; end-to-end results in Figure 8).

- ``naive_rag``: embed the question, search the index (top ``k`` passages), answer from
  each passage and synthesize the answers in a tree (a leaf per passage, one root).
- ``advanced_rag``: the model rewrites the question into ``expansions`` search queries
  (streamed: each query is searched as soon as it is decoded), each query retrieves
  ``fanout`` passages, a reranker keeps the best ``k`` overall, and the answer is refined
  passage by passage (LlamaIndex's refine mode).

The papers' apps also chunk and embed the user's documents per request; here the corpus
is indexed once, before the workload (see ``pipelines.data``).

    python -m pipelines.teola --pipeline advanced_rag --queries 8
"""

from __future__ import annotations

from pipelines.ops import Lazy

LEAF = "Passage: {p}\nQuestion: {q}\nAnswer using only the passage:"
ROOT = "Partial answers:\n{a}\nQuestion: {q}\nCombine the partial answers into one answer:"
EXPAND = "Rewrite the question as {n} different search queries.\nQuestion: {q}\nQueries:"
FIRST = "Context: {p}\nQuestion: {q}\nAnswer:"
REFINE = "Question: {q}\nExisting answer: {a}\nNew context: {p}\nRefine the existing answer with the new context:"


def naive_rag(inputs, ops=None, *, model: str | None = None, k: int = 3, max_tokens: int = 16):
    ops = ops or Lazy(model)
    hits = ops.search(inputs.index, inputs.questions, k=k)
    return ops.each(_tree_synthesis, inputs.questions, hits, max_tokens)


def _tree_synthesis(ops, question, hits, max_tokens):
    leaves = ops.generate(LEAF, p=[h.text for h in hits], q=question, max_tokens=max_tokens)
    return ops.generate(ROOT, a=ops.gather(leaves), q=question, max_tokens=max_tokens)


def advanced_rag(inputs, ops=None, *, model: str | None = None, expansions: int = 3, fanout: int = 4, k: int = 3,
                 words: int = 6, max_tokens: int = 16):
    import daskllm

    ops = ops or Lazy(model)
    queries = ops.generate(EXPAND, n=str(expansions), q=inputs.questions, max_tokens=expansions * words * 2,
                           split=daskllm.words(words))
    hits = ops.map(queries, _search, inputs.index, fanout)
    return ops.each(_rerank_and_refine, inputs.questions, ops.collect(hits), k, max_tokens)


def _search(query, ops, index, fanout):
    return ops.search(index, query, k=fanout)


def _rerank_and_refine(ops, question, hits, k, max_tokens):
    # passages found by several queries count once, in the order first found
    passages = list(dict.fromkeys(h.text for per_query in hits for h in per_query))
    best = ops.rerank(question, passages, k=k)
    return ops.each(_refine, question, best, max_tokens)


def _refine(ops, question, passages, max_tokens):
    answer = ops.generate(FIRST, p=passages[0], q=question, max_tokens=max_tokens)
    for passage in passages[1:]:
        answer = ops.generate(REFINE, q=question, a=answer, p=passage, max_tokens=max_tokens)
    return answer


PIPELINES = {"naive_rag": naive_rag, "advanced_rag": advanced_rag}

if __name__ == "__main__":
    from pipelines import main

    main(PIPELINES)
