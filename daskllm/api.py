"""User-facing builders: each returns a lazy node that is a Dask collection.

    q = ["How do I read JSON?", "How do I parse CSV?"]
    answer = daskllm.generate(daskllm.prompt(SYSTEM + "Q: {q}\\nA:", q=q), model="small", max_tokens=32)
    answer.compute()                 # a list of two answers; dask.compute / client.compute / persist work too

A builder given a list (for a text-valued argument) builds a batch of calls from one
template; nodes, ``dask.delayed`` values and plain values are all accepted as inputs.
Bad input fails here, at build time, with an error naming the node or field.
"""

from __future__ import annotations

import numpy as np
from dask.delayed import Delayed

from daskllm import config
from daskllm.engines import SamplingParams
from daskllm.graph.nodes import Node
from daskllm.graph.prompt import Prompt, Tokens, as_prompt, chat, prompt, tokenizer_fingerprint, tokens
from daskllm.models import DEFAULT_EMBEDDING_MODEL


class batch(list):  # noqa: N801 - reads as a marker: daskllm.batch([...])
    """Mark a list as a batch of values where a list would otherwise be one value (e.g. ``docs``)."""


def _input(value, *, lists_are_batches: bool = True) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, Delayed):
        return Node("delayed", value=value)
    if isinstance(value, batch) or (lists_are_batches and isinstance(value, (list, tuple))):
        if not len(value):
            raise ValueError("a batch must not be empty")
        return Node("const", value=tuple(value), width=len(value))
    return Node("const", value=value)


def _width(op: str, inputs: dict[str, Node]) -> int | None:
    widths = {name: n.width for name, n in inputs.items() if n.batched}
    if len(set(widths.values())) > 1:
        raise ValueError(f"{op}: batched inputs have different sizes: {widths}")
    return next(iter(widths.values()), None)


def _model(model: str | None, kind: str = "llm") -> str:
    if model is None:
        model = config.get("model") if kind == "llm" else DEFAULT_EMBEDDING_MODEL
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a recipe name or a model directory, got {model!r}")
    return model


def _prompt_inputs(op: str, p: Prompt, model: str) -> dict[str, Node]:
    for seg in p.segments:
        if isinstance(seg, Tokens) and seg.model != model and tokenizer_fingerprint(seg.model) != \
                tokenizer_fingerprint(model):
            raise ValueError(f"{op}({model!r}): the prompt has token ids from model {seg.model!r}, whose tokenizer "
                             f"differs; pass text, or token ids from {model!r}'s tokenizer")
    return {name: _input(value) for name, value in p.values.items()}


def generate(prompt_, model: str | None = None, *, max_tokens: int = 16, temperature: float = 0.0,
             top_p: float = 1.0, stop=(), seed: int | None = None, ignore_eos: bool = False,
             cache: bool | None = None) -> Node:
    """An LLM call (or a batch of them). Its value is the generated text (a list for a batch)."""
    model = _model(model)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              stop=stop, ignore_eos=ignore_eos)
    if cache and not sampling.deterministic:
        raise ValueError(f"generate({model!r}): a sampled call without a seed is not deterministic and cannot be "
                         f"cached; pass seed= or cache=False")
    p = as_prompt(prompt_)
    inputs = _prompt_inputs("generate", p, model)
    return Node("generate", inputs=inputs, template=p.segments, chat=p.chat, width=_width("generate", inputs),
                params={"model": model, "sampling": sampling, "cache": cache is not False and sampling.deterministic,
                        "nonce": not sampling.deterministic},
                nonce=not sampling.deterministic)


def prefill(prefix, model: str | None = None) -> Node:
    """Warm the engine's cache with ``prefix``; its value is a small PrefillHandle."""
    model = _model(model)
    p = as_prompt(prefix)
    inputs = _prompt_inputs("prefill", p, model)
    return Node("prefill", inputs=inputs, template=p.segments, chat=p.chat, width=_width("prefill", inputs),
                params={"model": model})


def embed(text_or_texts, model: str | None = None) -> Node:
    """Embedding vector(s) of text: one vector for a str, one per item for a list or batch."""
    model = _model(model, "embed")
    inputs = {"text": _input(text_or_texts)}
    return Node("embed", inputs=inputs, width=_width("embed", inputs), params={"model": model})


def search(index, query_or_vector, k: int = 5) -> Node:
    """The ``k`` nearest documents (a list of Hits) of a query text or vector in a sharded index."""
    from daskllm.retrieval import ShardedIndex

    if not isinstance(index, ShardedIndex):
        raise TypeError(f"search: index must be a ShardedIndex, got {type(index).__name__}")
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"search({index.name!r}): k must be a positive int, got {k!r}")
    if isinstance(query_or_vector, np.ndarray):
        vectors = query_or_vector.astype(np.float32)
        query = _input(batch(list(vectors)) if vectors.ndim == 2 else vectors)
    else:
        source = _input(query_or_vector)
        query = source if source.op == "embed" else embed(source, model=index.embedder)
    return Node("search", inputs={"query": query}, width=query.width,
                params={"index": IndexRef.of(index), "k": k})


def rerank(query, docs, k: int | None = None, model: str | None = None) -> Node:
    """The ``k`` documents most relevant to ``query``, best first (a list of str per call).

    ``docs`` is one call's documents: a list of str, or a node producing them (e.g. a search).
    """
    model = _model(model, "embed")
    inputs = {"query": _input(query), "docs": _input(docs, lists_are_batches=False)}
    return Node("rerank", inputs=inputs, width=_width("rerank", inputs), params={"model": model, "k": k})


def gather(node: Node) -> Node:
    """One value holding a whole batch (a list): for a call that needs every item at once."""
    if not isinstance(node, Node) or not node.batched:
        raise TypeError("gather() takes a batched node")
    return Node("gather", inputs={"items": node})


class IndexRef:
    """What a search task needs to know about a ShardedIndex: name and shard placement."""

    __slots__ = ("name", "workers", "embedder", "fingerprint")

    def __init__(self, name, workers, embedder, sizes, version):
        self.name, self.workers, self.embedder = name, list(workers), embedder
        self.fingerprint = (name, tuple(workers), tuple(sizes), version)

    @classmethod
    def of(cls, index) -> IndexRef:
        return cls(index.name, index.workers, index.embedder, index.sizes, index.version)


def compute(*nodes, passes=None, granularity=None, result_cache=None, **kwargs):
    """``dask.compute`` with per-call rewrite settings."""
    import dask

    from daskllm.graph.lower import overrides

    from daskllm.graph.lower import remember

    settings = {k: v for k, v in {"passes": passes, "granularity": granularity,
                                  "result_cache": result_cache}.items() if v is not None}
    with overrides(settings):
        results = dask.compute(*nodes, **kwargs)
        for node, value in zip(nodes, results):
            if isinstance(node, Node):
                remember(node.key, value)
    return results


def explain(*nodes, file=None) -> dict:
    """Print (and return) the optimized plan: passes applied, tasks by type, calls merged, tokens saved."""
    from daskllm.graph.lower import lowered

    report = lowered(list(nodes)).report
    lines = [f"passes applied: {', '.join(report.get('applied', [])) or 'none'}",
             "tasks by type: " + ", ".join(f"{op} {n}" for op, n in sorted(report.get("tasks", {}).items())),
             "calls requested: " + ", ".join(f"{op} {n}" for op, n in sorted(report.get("requested", {}).items()))]
    if "cse" in report:
        lines.append(f"cse: {report['cse']['merged']} of {report['cse']['calls']} calls merged")
    if "cache" in report:
        lines.append(f"result cache: {report['cache']['hits']} calls served")
    if "prefix" in report:
        r = report["prefix"]
        lines.append(f"shared-prefix prefill: {r['prefills']} prefills ({r['shared']} shared, {r['partial']} partial),"
                     f" about {r['prefill_tokens_saved']} prefill tokens saved")
    if "stage" in report:
        lines.append(f"stage split: {report['stage']['nodes_split']} nodes into {report['stage']['stages']} stages")
    if "prune" in report:
        lines.append(f"pruned: {report['prune']['nodes_removed']} nodes, {report['prune']['edges_removed']} edges")
    print("\n".join(lines), file=file)
    return report


__all__ = ["batch", "chat", "tokens", "compute", "embed", "explain", "gather", "generate", "prefill", "prompt", "rerank",
           "search"]
