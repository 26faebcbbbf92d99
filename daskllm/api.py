"""User-facing builders: each returns a lazy node that is a Dask collection.

    q = ["How do I read JSON?", "How do I parse CSV?"]
    answer = daskllm.generate(daskllm.prompt(SYSTEM + "Q: {q}\\nA:", q=q), model="small", max_tokens=32)
    answer.compute()                 # a list of two answers; dask.compute / client.compute / persist work too

A builder given a list (for a text-valued argument) builds a batch of calls from one
template; nodes, ``dask.delayed`` values and plain values are all accepted as inputs.
Bad input fails here, at build time, with an error naming the node or field. A call that
cannot run (a prompt longer than the model holds, text that is not valid Unicode) fails
alone when it runs: ``on_error="raise"`` (default) raises a
:class:`~daskllm.worker.failures.CallError` naming the builder, the item's index in the
batch and why; ``on_error="null"`` makes its value None and keeps the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import dask.base
import dask.dataframe as dd
import numpy as np
from dask.delayed import Delayed

from daskllm import config
from daskllm.engines import SamplingParams, StructuredOutput
from daskllm.models import DEFAULT_EMBEDDING_MODEL
from daskllm.ops import is_stream
from daskllm.ops.collections import COLLECT, GATHER
from daskllm.ops.embed import EMBED
from daskllm.ops.generate import GENERATE
from daskllm.ops.pmap import PMAP
from daskllm.ops.prefill import PREFILL
from daskllm.ops.rerank import RERANK
from daskllm.ops.search import SEARCH, IndexRef
from daskllm.ops.values import CONST, DELAYED
from daskllm.plan.ir import Node
from daskllm.prompts import Prompt, Tokens, as_prompt, chat, prompt, tokenizer_fingerprint, tokens
from daskllm.retrieval import ShardedIndex
from daskllm.runtime import submit
from daskllm.runtime.collection import LazyNode, compute
from daskllm.streaming.split import delimited, splitter, words
from daskllm.streaming.stages import ANCESTRY, PmapSpec, Stage
from daskllm.worker.failures import ON_ERROR


class batch(list):  # noqa: N801 - reads as a marker: daskllm.batch([...])
    """Mark a list as a batch of values where a list would otherwise be one value (e.g. ``docs``)."""


def _input(value, *, lists_are_batches: bool = True) -> Node:
    if isinstance(value, Node):
        return value
    if isinstance(value, ShardedIndex):
        value = value.detached()
        return LazyNode(CONST.name, value=value, identity=value)
    if isinstance(value, Delayed):
        return LazyNode(DELAYED.name, value=value, identity=value.key)
    if isinstance(value, batch) or (lists_are_batches and isinstance(value, (list, tuple))):
        if not len(value):
            raise ValueError("a batch must not be empty")
        return LazyNode(CONST.name, value=tuple(value), width=len(value), identity=tuple(value))
    return LazyNode(CONST.name, value=value, identity=value)


def _width(op: str, inputs: dict[str, Node]) -> int | None:
    widths = {name: n.width for name, n in inputs.items() if n.batched}
    if len(set(widths.values())) > 1:
        raise ValueError(f"{op}: batched inputs have different sizes: {widths}")
    return next(iter(widths.values()), None)


def default_model(model: str | None, kind: str = "llm") -> str:
    """The model a builder uses: the one named, else the configured default of its kind."""
    if model is None:
        model = config.get("model") if kind == "llm" else DEFAULT_EMBEDDING_MODEL
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a recipe name or a model directory, got {model!r}")
    return model


def _on_error(op: str, on_error: str) -> dict:
    """The params entry for ``on_error``: none for the default, so a default call's hash (CSE,
    the result cache) is what it always was; a null call never merges with a raising one."""
    if on_error not in ON_ERROR:
        raise ValueError(f"{op}: on_error must be 'raise' or 'null', got {on_error!r}")
    return {} if on_error == "raise" else {"on_error": on_error}


def _prompt_inputs(op: str, p: Prompt, model: str) -> dict[str, Node]:
    for seg in p.segments:
        if isinstance(seg, Tokens) and seg.model != model and tokenizer_fingerprint(seg.model) != \
                tokenizer_fingerprint(model):
            raise ValueError(f"{op}({model!r}): the prompt has token ids from model {seg.model!r}, whose tokenizer "
                             f"differs; pass text, or token ids from {model!r}'s tokenizer")
    return {name: _input(value) for name, value in p.values.items()}


def generate(prompt_, model: str | None = None, *, max_tokens: int = 16, temperature: float = 0.0,
             top_p: float = 1.0, stop=(), seed: int | None = None, ignore_eos: bool = False,
             cache: bool | None = None, split=None, allowed_token_ids=(), on_error: str = "raise",
             schema=None, choices=None, regex: str | None = None, logprobs: int | None = None) -> Node:
    """An LLM call (or a batch of them). Its value is the generated text (a list for a batch).

    Constrained output (at most one): ``schema`` (a JSON schema dict or a pydantic model: the
    text is one JSON value that follows it), ``choices`` (a list of str: the text is one of
    them) or ``regex``. Decoding is masked to the grammar, so the text always parses unless
    ``max_tokens`` cuts it.

    With ``logprobs=k`` (an int) its value is instead a record ``{"text": ..., "logprobs": [...],
    "top_logprobs": [{token id: logprob}, ...], "token_ids": [...], "finish_reason": "eos" | "stop" | "length"}``:
    each generated token's log-probability under
    the distribution it was drawn from (after ``allowed_token_ids`` and any grammar: for a
    yes/no answer, the probability among the allowed tokens), and the ``k`` likeliest tokens'.

    ``on_error``: what a call that cannot run (its prompt longer than the model holds, its text
    not valid Unicode, its input null) does: "raise" (default) raises a ``CallError`` naming
    the item's index in the batch and why; "null" makes that item None and keeps the others.

    With ``split`` ("lines", "json", :func:`delimited` or a parser ``fn(text, final)``) it
    is a stream: its value is the list of items the text splits into, and consumers
    (:func:`pmap`, or embed/search/rerank/generate given the stream) start on each item as
    soon as it is decoded. A prompt slot filled by a stream makes one call per item.
    """
    p = as_prompt(prompt_)
    errors = _on_error(GENERATE.name, on_error)
    options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                   ignore_eos=ignore_eos, cache=cache, split=split, allowed_token_ids=tuple(allowed_token_ids),
                   on_error=on_error, schema=schema, choices=choices, regex=regex, logprobs=logprobs)
    lifted = _lift_prompt("generate", p, dict(model=model, **options))
    if lifted is not None:
        return lifted
    model = default_model(model)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              stop=stop, ignore_eos=ignore_eos, allowed_token_ids=tuple(allowed_token_ids),
                              structured=structured_output(schema, choices, regex), logprobs=logprobs)
    if split is not None and logprobs is not None:
        raise ValueError(f"generate({model!r}): logprobs is not supported with split (a stream's items are text)")
    if cache and not sampling.deterministic:
        raise ValueError(f"generate({model!r}): a sampled call without a seed is not deterministic and cannot be "
                         f"cached; pass seed= or cache=False")
    inputs = _prompt_inputs(GENERATE.name, p, model)
    params = {"model": model, "sampling": sampling, "cache": cache is not False and sampling.deterministic,
              "nonce": not sampling.deterministic, **errors}
    if split is not None:
        if on_error != "raise":
            raise ValueError(f"generate({model!r}): on_error={on_error!r} is not supported with split "
                             f"(a stream's errors are its items': see pmap's errors=)")
        params["split"] = splitter(split)
    return LazyNode(GENERATE.name, inputs=inputs, template=p.segments, chat=p.chat, width=_width(GENERATE.name, inputs),
                params=params, nonce=not sampling.deterministic)


def structured_output(schema=None, choices=None, regex: str | None = None) -> StructuredOutput | None:
    """The constraint named by at most one of ``schema``, ``choices`` and ``regex``."""
    given = [name for name, v in (("schema", schema), ("choices", choices), ("regex", regex)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"generate: pass at most one of schema, choices and regex, got {given}")
    if schema is not None:
        return StructuredOutput.json_schema(schema)
    if choices is not None:
        return StructuredOutput.choice(choices)
    return None if regex is None else StructuredOutput.regex(regex)


def prefill(prefix, model: str | None = None) -> Node:
    """Warm the engine's cache with ``prefix``; its value is a small PrefillHandle."""
    p = as_prompt(prefix)
    lifted = _lift_prompt("prefill", p, dict(model=model))
    if lifted is not None:
        return lifted
    model = default_model(model)
    inputs = _prompt_inputs(PREFILL.name, p, model)
    return LazyNode(PREFILL.name, inputs=inputs, template=p.segments, chat=p.chat, width=_width(PREFILL.name, inputs),
                params={"model": model})


def embed(text_or_texts, model: str | None = None, *, on_error: str = "raise") -> Node:
    """Embedding vector(s) of text: one vector for a str, one per item for a list or batch.

    ``on_error``: as for :func:`generate` (a text that is not valid Unicode, a null input)."""
    errors = _on_error(EMBED.name, on_error)
    if is_stream(text_or_texts):
        return _lift(embed, "text_or_texts", text_or_texts, {}, model=model, on_error=on_error)
    model = default_model(model, "embed")
    inputs = {"text": _input(text_or_texts)}
    return LazyNode(EMBED.name, inputs=inputs, width=_width(EMBED.name, inputs),
                    params={"model": model, **errors})


def search(index, query_or_vector, k: int = 5, *, on_error: str = "raise") -> Node:
    """The ``k`` nearest documents (a list of Hits) of a query text or vector in a sharded index.

    ``on_error``: as for :func:`generate`; the embedding of query texts is made with it too."""
    errors = _on_error(SEARCH.name, on_error)
    if not isinstance(index, ShardedIndex):
        raise TypeError(f"search: index must be a ShardedIndex, got {type(index).__name__}")
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"search({index.name!r}): k must be a positive int, got {k!r}")
    if is_stream(query_or_vector):
        return _lift(search, "query_or_vector", query_or_vector, {}, index=index.detached(), k=k, on_error=on_error)
    params = {"index": IndexRef.of(index), "k": k, **errors}
    if isinstance(query_or_vector, np.ndarray):
        vectors = query_or_vector.astype(np.float32)
        query = _input(batch(list(vectors)) if vectors.ndim == 2 else vectors)
    else:
        source = _input(query_or_vector)
        query = source if source.op == EMBED.name else embed(source, model=index.embedder, on_error=on_error)
    return LazyNode(SEARCH.name, inputs={"query": query}, width=query.width, params=params)


def rerank(query, docs, k: int | None = None, model: str | None = None, *, on_error: str = "raise") -> Node:
    """The ``k`` documents most relevant to ``query``, best first (a list of str per call).

    ``docs`` is one call's documents: a list of str, or a node producing them (e.g. a search).
    ``on_error``: as for :func:`generate`.
    """
    errors = _on_error(RERANK.name, on_error)
    streams = [name for name, v in (("query", query), ("docs", docs)) if is_stream(v)]
    if len(streams) > 1:
        raise ValueError("rerank: query and docs are both streams; a call draws items from one (collect() the other)")
    if streams:
        name = streams[0]
        other = "docs" if name == "query" else "query"
        return _lift(rerank, name, query if name == "query" else docs, {other: docs if name == "query" else query},
                     k=k, model=model, on_error=on_error)
    model = default_model(model, "embed")
    inputs = {"query": _input(query), "docs": _input(docs, lists_are_batches=False)}
    return LazyNode(RERANK.name, inputs=inputs, width=_width(RERANK.name, inputs),
                    params={"model": model, "k": k, **errors})


def gather(node: Node) -> Node:
    """One value holding a whole batch (a list): for a call that needs every item at once."""
    if not isinstance(node, Node) or not node.batched:
        raise TypeError("gather() takes a batched node")
    return LazyNode(GATHER.name, inputs={"items": node})


def pmap(stream, fn, *args, errors: str = "raise", sticky: bool = False) -> Node:
    """``fn(item, *args)`` for every item of ``stream``, as items arrive, in parallel across workers.

    ``stream`` is a split generation, another pmap, or any node or list whose value (per
    call) is a list. ``fn`` may return plain values or lazy work: daskllm nodes (nested
    pmaps included), ``dask.delayed`` values, or lists of them; it runs on a worker, so
    upstream values it needs go in ``args`` (nodes, delayed or plain values) rather than
    in its closure. The value is the list of results in item order (:func:`collect`).

    ``errors="raise"``: a failed item raises :class:`~daskllm.streaming.ItemError` naming its
    ancestry, once the other items finish (their results are in ``.results``);
    ``errors="keep"``: the failed slot holds the error. ``sticky=True`` keeps all items of
    one parent on one worker (a stateful consumer, e.g. calls sharing that parent's
    prefix); by default items spread across workers.
    """
    if not callable(fn):
        raise TypeError(f"pmap: fn must be callable, got {type(fn).__name__}")
    return _pmap(stream, Stage(fn, len(args)), args, errors=errors, sticky=sticky)


def _pmap(stream, stage: Stage, args, *, errors: str = "raise", sticky: bool = False) -> Node:
    if errors not in ("raise", "keep"):
        raise ValueError(f"pmap: errors must be 'raise' or 'keep', got {errors!r}")
    source = _input(stream, lists_are_batches=False)
    inputs = {"stream": source, **{f"arg{j}": _input(a, lists_are_batches=False) for j, a in enumerate(args)}}
    spec = PmapSpec((stage,), errors, bool(sticky), ANCESTRY.get())
    return LazyNode(PMAP.name, inputs=inputs, width=_width(PMAP.name, inputs), value=spec,
                params={"stage": stage.fingerprint, "errors": errors, "sticky": bool(sticky)})


def collect(stream) -> Node:
    """A stream's items (or a pmap's results) as one list, in item order: a plain value, so a
    builder given it sees the whole list (e.g. a prompt slot listing every item)."""
    if not is_stream(stream):
        raise TypeError("collect() takes a stream: a split generate or a pmap")
    return LazyNode(COLLECT.name, inputs={"stream": stream}, width=stream.width)


@dataclass(frozen=True)
class _Call:
    """A builder applied to one item: ``builder(**{item_arg: item, **others, **fixed})``."""

    builder: str
    item_arg: str
    other_args: tuple[str, ...]
    fixed: tuple

    def __call__(self, item, *others):
        return globals()[self.builder](**{self.item_arg: item, **dict(zip(self.other_args, others)),
                                          **dict(self.fixed)})

    @property
    def fingerprint(self) -> tuple:
        return (self.builder, self.item_arg, self.other_args, dask.base.tokenize(self.fixed))


def _lift(builder, item_arg: str, stream: Node, others: dict, **fixed) -> Node:
    """``builder`` over each item of ``stream``: a pmap whose stage is the builder."""
    call = _Call(builder.__name__, item_arg, tuple(others), tuple(sorted(fixed.items())))
    return _pmap(stream, Stage(call, len(others), lazy_ok=True), list(others.values()))


def _with_slot(builder: str, segments, chat, slot: str, other_slots: tuple, options: tuple, item, *others):
    p = Prompt(segments, {slot: item, **dict(zip(other_slots, others))}, chat=chat)
    return globals()[builder](p, **dict(options))


def _lift_prompt(builder: str, p: Prompt, options: dict) -> Node | None:
    """A prompt with a slot filled by a stream: one call per item (None if no slot is)."""
    streams = [name for name, v in p.values.items() if is_stream(v)]
    if not streams:
        return None
    if len(streams) > 1:
        raise ValueError(f"{builder}: slots {streams} are all streams; a call draws items from one "
                         f"(collect() the others)")
    slot = streams[0]
    others = {k: v for k, v in p.values.items() if k != slot}
    fn = functools.partial(_with_slot, builder, p.segments, p.chat, slot, tuple(others), tuple(sorted(options.items())))
    return _pmap(p.values[slot], Stage(fn, len(others), lazy_ok=True), list(others.values()))


def explain(*nodes, file=None, passes=None, granularity=None, result_cache=None, release_threads=None, **options):
    """Print (and return) the optimized plan: passes applied, tasks by type, calls merged, tokens saved.

    The settings are those of :func:`compute`: ``explain(node, passes=[], granularity="query")``
    shows the naive plan. Given a dask dataframe or series built with ``.llm`` operators, it
    prints and returns its cost preview instead (``ddf.llm.estimate(**options)``)."""
    if len(nodes) == 1 and isinstance(nodes[0], (dd.DataFrame, dd.Series)):
        preview = nodes[0].llm.estimate(**options)  # the accessor is registered by daskllm.dataframe
        print(preview, file=file)
        return preview
    settings = {k: v for k, v in {"passes": passes, "granularity": granularity,
                                  "result_cache": result_cache,
                                  "release_threads": release_threads}.items() if v is not None}
    with submit.overrides(settings):
        report = submit.plan(list(nodes)).report
    lines = [f"passes applied: {', '.join(report.get('applied', [])) or 'none'}",
             "tasks by type: " + ", ".join(f"{op} {n}" for op, n in sorted(report.get("tasks", {}).items())),
             "calls requested: " + ", ".join(f"{op} {n}" for op, n in sorted(report.get("requested", {}).items()))]
    if "cse" in report:
        lines.append(f"cse: {report['cse']['merged']} of {report['cse']['calls']} calls merged")
    if "cache" in report:
        lines.append(f"result cache: {report['cache']['hits']} calls served")
    if "prefix" in report:
        r = report["prefix"]
        stored = (f"; {_count(r['answered_by_store'], 'prefill')} not made: the result store answers their calls"
                  if r.get("answered_by_store") else "")
        lines.append(f"shared-prefix prefill: {r['prefills']} prefills ({r['shared']} shared, {r['partial']} partial),"
                     f" {r['prefill_tokens_cached']} prefill tokens read from the prefix cache{stored}")
    if "stage" in report:
        r = report["stage"]
        lines.append(f"stage split: {r['nodes_split']} nodes into {r['stages']} stages, "
                     f"{r.get('nodes_fused', 0)} nodes consolidated")
    if "pipeline" in report:
        r = report["pipeline"]
        short = f" ({r['short_decodes']} over decodes too short to pay)" if r.get("short_decodes") else ""
        lines.append(f"decode pipelining: {r['streamed']} pmaps streamed{short}, {r['pmaps_fused']} pmaps fused")
    if "parts" in report:
        r = report["parts"]
        lines.append(f"parts: the plan's {r['calls']} calls run in {_count(r['tasks'], 'worker task')} "
                     f"({_count(r['workers'], 'worker')} with the model), no task between them")
    if "prune" in report:
        lines.append(f"pruned: {report['prune']['nodes_removed']} nodes, {report['prune']['edges_removed']} edges")
    print("\n".join(lines), file=file)
    return report


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


__all__ = ["batch", "chat", "collect", "compute", "delimited", "embed", "explain", "gather", "generate", "pmap",
           "prefill", "prompt", "rerank", "search", "tokens"]
