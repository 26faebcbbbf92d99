"""Inputs for the reference pipelines: questions, passages and a vector index.

Questions come from the real question sets in ``../shared/data/`` when they are there
(hotpotqa, parallelqa, movies), else from the standard-library corpus (questions generated
from its docstrings). Passages are the corpus's documentation texts, cut short so several
fit one prompt of the small models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PASSAGE_CHARS = 300


@dataclass
class Inputs:
    """What a pipeline's ``build`` takes: a batch of questions and what they are about."""

    questions: list[str]
    index: object | None = None  # a daskllm.ShardedIndex over the passages
    contexts: list[list[str]] = field(default_factory=list)  # per question: documents to work through

    def __post_init__(self):
        if not self.questions or not all(isinstance(q, str) and q for q in self.questions):
            raise ValueError("Inputs.questions must be a non-empty list of non-empty strings")
        for i, c in enumerate(self.contexts):
            if not c:
                raise ValueError(f"Inputs.contexts[{i}] (question {i}) is empty")

    def __len__(self) -> int:
        return len(self.questions)

    def subset(self, start: int, stop: int) -> Inputs:
        return Inputs(self.questions[start:stop], self.index, self.contexts[start:stop])


def questions(n: int, source: str = "auto", seed: int = 0) -> list[str]:
    """``n`` questions: from ``../shared/data`` (``source`` hotpotqa, parallelqa, movies; auto
    takes hotpotqa when present) or from the stdlib corpus (``stdlib``), repeated if short."""
    from daskllm import datasets

    if source == "auto":
        source = "hotpotqa" if datasets.default_data_dir() is not None else "stdlib"
    if source == "stdlib":
        texts = list(datasets.load("stdlib-objects", min(n, 2000), seed=seed)["question"])
    else:
        texts = list(datasets.load(source)["question"])
    if not texts:
        raise ValueError(f"question source {source!r} gave no questions")
    return [texts[i % len(texts)] for i in range(n)]


def passages(limit: int | None = 2000) -> list[str]:
    """Documentation passages of the stdlib corpus: name, signature and the doc's start."""
    from daskllm import datasets

    docs = datasets.load("stdlib-docs", limit)
    return [f"{row.qualname}{row.signature or ''}: {row.doc}"[:PASSAGE_CHARS] for row in docs.itertuples()]


def contexts(n: int, per_query: int = 4, seed: int = 0) -> list[list[str]]:
    """``per_query`` passages for each of ``n`` queries (documents to summarize or refine over)."""
    import random

    texts = passages()
    rng = random.Random(seed)
    return [rng.sample(texts, per_query) for _ in range(n)]


def make_inputs(client, n: int, *, source: str = "auto", index_docs: int = 2000, per_query: int = 4,
                index_name: str = "pipelines-stdlib") -> Inputs:
    """Questions, an index over the corpus's passages on ``client``'s cluster, and contexts."""
    import daskllm
    from daskllm.worker.indexes import drop_shards

    client.run(drop_shards, index_name)
    index = daskllm.ShardedIndex.from_texts(client, index_name, passages(index_docs))
    return Inputs(questions(n, source), index, contexts(n, per_query))
