"""Alto's FacTool pipeline, streamed (alto.txt, Figure 1; results in Figures 2 and 4).

For each question: answer it, extract claims from the answer (a stream: each claim is
checked as soon as it is decoded), generate search queries per claim (a nested stream),
retrieve passages for each query, rerank them against the claim, verify the claim from
the best evidence, and aggregate the verdicts. Nested pmaps carry Alto's ancestry tags
(``question[i] > claim[j] > query[k]``).

The paper retrieves with BM25 and reranks with ColBERT; here retrieval is dense (MiniLM
over the stdlib corpus) and reranking is the configured reranker.

    python -m pipelines.alto --queries 8
"""

from __future__ import annotations

import daskllm

from pipelines.ops import Items, Lazy

ANSWER = "Question: {q}\nAnswer in a few sentences:"
CLAIMS = "Answer: {a}\nList the factual claims in the answer:"
QUERIES = "Claim: {c}\nSearch queries that would check the claim:"
VERIFY = "Claim: {c}\nEvidence:\n{e}\nIs the claim supported by the evidence? Verdict:"
AGGREGATE = "Question: {q}\nVerdicts on the answer's claims:\n{v}\nIs the answer factual overall?"


def factool(inputs, ops=None, *, model: str | None = None, claims: int = 3, queries: int = 2, words: int = 6,
            k: int = 3, evidence: int = 2, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    answer = ops.generate(ANSWER, q=q, max_tokens=max_tokens * 2)
    claim_stream = ops.generate(CLAIMS, a=answer, max_tokens=claims * words * 2, split=daskllm.words(words))
    verdicts = ops.map(claim_stream, _verify_claim, inputs.index, queries, words, k, evidence, max_tokens)
    return ops.generate(AGGREGATE, q=q, v=ops.collect(verdicts), max_tokens=max_tokens)


def _verify_claim(claim, ops, index, queries, words, k, evidence, max_tokens):
    query_stream = ops.generate(QUERIES, c=claim, max_tokens=queries * words * 2, split=daskllm.words(words))
    hits = ops.map(query_stream, _search, index, k)
    return ops.each(_rerank_and_verify, claim, ops.collect(hits), evidence, max_tokens)


def _search(query, ops, index, k):
    return ops.search(index, query, k=k)


def _rerank_and_verify(ops, claim, hits, evidence, max_tokens):
    passages = list(dict.fromkeys(h.text for per_query in hits for h in per_query))
    best = ops.rerank(claim, passages, k=evidence) if passages else Items([])
    return ops.generate(VERIFY, c=claim, e=best, max_tokens=max_tokens)


PIPELINES = {"factool": factool}

if __name__ == "__main__":
    from pipelines import main

    main(PIPELINES)
