"""The ``.llm`` accessors on dask dataframes and series: each operator builds a lazy plan of
render, distinct, call and lookup steps (see the package docstring)."""

from __future__ import annotations

import functools

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from daskllm import api
from daskllm.budget import Budget
from daskllm.dataframe import cascade as cascade_
from daskllm.dataframe.calls import call, summarize_chunk, summarize_parts
from daskllm.dataframe.cascade import Cascade
from daskllm.dataframe.dedupe import STRATEGIES, plan
from daskllm.dataframe.job import Member, TableJob
from daskllm.dataframe.estimate import TableEstimate, estimate
from daskllm.dataframe import schema as types
from daskllm.dataframe.cells import check_nulls
from daskllm.dataframe.joins import sim_join
from daskllm.dataframe.ops import CASTS, KEY, STRING, Op, as_arrow, fields_schema, schema_dtype, yes_no
from daskllm.dataframe.rows import RENDERED, kept, lookup, pair_keys, render, render_column
from daskllm.engines import SamplingParams, StructuredOutput
from daskllm.prompts import Slot, parse_template, tokenizer_for
from daskllm.retrieval import ShardedIndex
from daskllm.runtime.view import check_served, take_view

@register_dataframe_accessor("llm")
class LLMAccessor:
    """``ddf.llm.map / filter / extract / embed / search / rerank / sim_join / topk / agg``."""

    def __init__(self, ddf):
        self._ddf = ddf

    # -- helpers ---------------------------------------------------------------------------

    def _slots(self, template: str) -> tuple:
        if not isinstance(template, str) or not template:
            raise ValueError(f"template must be a non-empty str, got {template!r}")
        slots = tuple(dict.fromkeys(s.name for s in parse_template(template) if isinstance(s, Slot)))
        missing = [s for s in slots if s not in self._ddf.columns]
        if missing:
            raise KeyError(f"template fields {missing} are not columns; columns are {list(self._ddf.columns)}")
        return slots

    def _render(self, template: str, slots: tuple, nulls: str):
        """Each row's prompt (its dedupe key), or why it has none (cells: the null and type rules)."""
        return _render(self._ddf, template, slots, check_nulls(nulls))

    def _results(self, rendered, op: Op, slots: tuple, on_error: str, dtype=None, dedupe: str = "auto"):
        """Per row (aligned with ``rendered``, the rows' keys): value (of ``dtype``, else objects)
        and error, each distinct input computed once (``dedupe``: see :mod:`daskllm.dataframe.dedupe`)."""
        if on_error not in ("raise", "null"):
            raise ValueError(f"on_error must be 'raise' or 'null', got {on_error!r}")
        own, shared = plan(self._inputs(rendered[KEY], slots), op, slots, dedupe)
        meta = pd.DataFrame({"value": types.empty(object if dtype is None else dtype),
                             "error": types.empty(types.ERROR)})
        return rendered.map_partitions(lookup, own, shared, op.name, on_error, dtype, meta=meta)

    def _inputs(self, keys, slots: tuple):
        """The rows' keys with the columns their prompts are filled from."""
        return self._ddf[list(slots)].assign(**{KEY: keys}) if slots else keys.to_frame()

    def _with(self, results, out: str, on_error: str, dtype=None):
        """``out`` (and ``<out>_error``) assigned; ``dtype`` converts a value column of objects."""
        return self._ddf.assign(**self._columns(results, out, on_error, dtype))

    @staticmethod
    def _columns(results, out: str, on_error: str, dtype=None) -> dict:
        """``out`` (and ``<out>_error``) from an operator's results; ``dtype`` converts a value
        column of objects."""
        value = results["value"]
        if isinstance(dtype, pd.ArrowDtype):  # parsed schema answers: their Arrow type, or JSON text
            value = value.map_partitions(as_arrow, dtype, meta=pd.Series([], dtype=dtype, name="value"))
        elif dtype is not None:
            value = value.astype(dtype)
        assigned = {out: value}
        if on_error == "null":
            assigned[f"{out}_error"] = results["error"]
        return assigned

    def _llm(self, op: Op, template: str, slots: tuple, nulls: str, on_error: str, dtype, dedupe: str, *,
             columns=None, mask=None, made: tuple = ()):
        """An LLM operator's output frame: ``columns`` (its results -> the columns it assigns)
        assigned, or the rows ``mask`` (its results -> a boolean series) keeps. With
        ``dedupe="auto"`` its calls are planned with the rest of its table job
        (:mod:`daskllm.dataframe.job`): it joins the job of the frame it is applied to where it
        reads none of that job's outputs (after a filter of the job, called only for the rows
        the filter keeps)."""
        if on_error not in ("raise", "null"):
            raise ValueError(f"on_error must be 'raise' or 'null', got {on_error!r}")
        if dedupe not in STRATEGIES:
            raise ValueError(f"dedupe must be one of {STRATEGIES}, got {dedupe!r}")
        if dedupe != "auto":
            results = self._results(self._render(template, slots, nulls), op, slots, on_error, dtype, dedupe)
            return self._ddf.assign(**columns(results)) if mask is None else self._ddf[mask(results)]
        member = Member(op, slots, functools.partial(_render, template=template, slots=slots, nulls=check_nulls(nulls)),
                        on_error, dtype, columns, mask, made)
        job = getattr(self._ddf, JOB, None)
        job = job.joined(member) if job is not None and job.joins(slots) else TableJob(self._ddf, (member,))
        out = job.frame()
        object.__setattr__(out, JOB, job)
        return out

    @staticmethod
    def _sampling(max_tokens, temperature=0.0, seed=None, stop=(), ignore_eos=False,
                  structured: StructuredOutput | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop,
                              ignore_eos=ignore_eos, structured=structured)

    def _model(self, model, kind: str = "llm"):
        model = api.default_model(model, "llm" if kind == "llm" else "embed")
        check_served(take_view(), {(kind, model)})  # here, not as an error on every row
        return model

    @staticmethod
    def _chat(model: str, chat: bool | None) -> bool:
        """Chat unless told otherwise, where the model has a chat template: an instruction-tuned
        model answers a user message, and often nothing at all to bare text."""
        if chat is not None:
            return bool(chat)
        return tokenizer_for(model).has_chat_template

    # -- operators ---------------------------------------------------------------------------

    def map(self, template: str, *, model: str | None = None, max_tokens: int = 64, out: str = "llm_output",
            on_error: str = "raise", budget: Budget | None = None, temperature: float = 0.0,
            seed: int | None = None, stop=(), ignore_eos: bool = False, chat: bool | None = None,
            schema=None, choices=None, dedupe: str = "auto", nulls: str = "skip"):
        """A new text column ``out``: the model's answer to ``template`` filled from each row.
        ``dedupe``: which task calls each distinct prompt (:mod:`daskllm.dataframe.dedupe`).

        Constrained (decoded under a grammar, so every answer parses): ``schema`` (a pydantic
        model or a JSON schema dict) gives a column of the Arrow type the schema fixes (a struct
        for a closed object: a pydantic model with ``extra="forbid"``), or else of the answers'
        JSON text; ``choices`` (a list of str) gives a
        categorical column whose values are always among them."""
        slots = self._slots(template)
        model = self._model(model)
        structured = api.structured_output(schema, choices)
        op = Op("generate", model, "map", template,
                self._sampling(max_tokens, temperature, seed, stop, ignore_eos, structured),
                budget=budget, chat=self._chat(model, chat))
        # A null field: a null result (nulls="skip") or a row error.
        if schema is None and choices is None:
            results_dtype, dtype = types.TEXT, None
        else:
            results_dtype = None
            dtype = schema_dtype(structured.value) if schema is not None else pd.CategoricalDtype(structured.value)
        return self._llm(op, template, slots, nulls, on_error, results_dtype, dedupe, made=(out, f"{out}_error"),
                         columns=functools.partial(self._columns, out=out, on_error=on_error, dtype=dtype))

    def filter(self, predicate: str, *, model: str | None = None, on_error: str = "raise",
               budget: Budget | None = None, chat: bool | None = None, dedupe: str = "auto",
               cascade: Cascade | None = None, nulls: str = "skip"):
        """The rows the model judges true: its answer to ``predicate`` is constrained to yes/no.
        With ``on_error="null"`` a row that cannot be judged is dropped. With ``cascade`` (a
        :class:`daskllm.Cascade`, instead of ``model``) a cheap proxy model answers the rows it is
        sure of and an oracle model the rest."""
        slots = self._slots(predicate)
        if cascade is not None:
            if model is not None:
                raise ValueError("filter: pass model= or cascade=, not both (the cascade names its models)")
            keys = self._render(predicate, slots, nulls)[KEY]  # a row with a null field is dropped (or an error)
            return self._ddf[_mask(self._cascade(keys, predicate, slots, cascade, on_error, budget, chat))]
        model = self._model(model)
        yes_no(model)  # fail here if the model cannot say yes or no
        op = Op("filter", model, "filter", predicate, SamplingParams(max_tokens=1), budget=budget,
                chat=self._chat(model, chat))
        return self._llm(op, predicate, slots, nulls, on_error, types.FIELDS["bool"], dedupe, mask=_mask)

    def _cascade(self, keys, predicate: str, slots: tuple, cascade: Cascade, on_error: str, budget, chat):
        """Per row: value and error of a cascaded filter (see daskllm/dataframe/cascade.py)."""
        if not isinstance(cascade, Cascade):
            raise TypeError(f"filter: cascade must be a daskllm.Cascade, got {type(cascade).__name__}")
        if on_error not in ("raise", "null"):
            raise ValueError(f"on_error must be 'raise' or 'null', got {on_error!r}")
        ops = {}
        for role in ("proxy", "oracle"):
            model = self._model(getattr(cascade, role))
            # The proxy reports every allowed token's probability: P(yes) is the yes tokens' mass.
            logprobs = len(yes_no(model)) if role == "proxy" else None
            ops[role] = Op("filter", model, f"filter-{role}", predicate,
                           SamplingParams(max_tokens=1, logprobs=logprobs), budget=budget, chat=self._chat(model, chat))
        inputs = self._inputs(keys, slots)
        # One-partition tables of results (the "global" dedupe plan), broadcast to the row partitions.
        proxy = plan(inputs, ops["proxy"], slots, "global")[1]
        if cascade.thresholds is not None:
            sample = dd.from_pandas(cascade_.TABLE, npartitions=1)
            learned = dd.from_pandas(cascade_.fixed(cascade), npartitions=1)
        else:
            candidates = inputs.map_partitions(cascade_.sample_candidates, cascade.seed, cascade.sample_size,
                                               meta=inputs._meta.assign(**{cascade_.SAMPLE_HASH: np.uint64(0)}))
            sampled = candidates.repartition(npartitions=1).map_partitions(cascade_.sample_of, cascade.sample_size,
                                                                           meta=inputs._meta)
            sample = sampled.map_partitions(call, ops["oracle"], slots, meta=cascade_.TABLE)
            learned = sample.map_partitions(cascade_.learn, proxy, cascade, meta=cascade_.LEARNED)
        unsure = keys.map_partitions(cascade_.uncertain, proxy, sample, learned, meta=(KEY, STRING))
        oracle = plan(self._inputs(unsure, slots), ops["oracle"], slots, "global")[1]
        learned = oracle.map_partitions(cascade_.settle, proxy, sample, learned, meta=cascade_.LEARNED)
        meta = pd.DataFrame({"value": pd.Series([], dtype=object), "error": pd.Series([], dtype=STRING)})
        return keys.map_partitions(cascade_.decide, proxy, sample, oracle, learned, on_error, meta=meta)

    def extract(self, template: str, fields: dict, *, model: str | None = None, max_tokens: int = 128,
                on_error: str = "raise", budget: Budget | None = None, chat: bool | None = None,
                nulls: str = "skip"):
        """Structured output: one column per field (``{"name": str, "year": int}``), parsed from a
        JSON object the model writes under a grammar (the fields' JSON schema), so it always
        parses; an answer cut by ``max_tokens`` is a row error."""
        slots = self._slots(template)
        if not fields:
            raise ValueError("extract: fields must name at least one output column")
        names = {t if isinstance(t, str) else getattr(t, "__name__", "") for t in fields.values()}
        if not names <= set(CASTS):
            raise ValueError(f"extract: field types must be among {sorted(CASTS)}, got {fields!r}")
        spec = tuple((f, t if isinstance(t, str) else t.__name__) for f, t in fields.items())
        model = self._model(model)
        structured = StructuredOutput.json_schema(fields_schema(spec))
        op = Op("extract", model, "extract", template, SamplingParams(max_tokens=max_tokens, structured=structured),
                fields=spec, budget=budget, chat=self._chat(model, chat))
        return self._llm(op, template, slots, nulls, on_error, None, "auto", made=(*dict(spec), "extract_error"),
                         columns=functools.partial(_fields, spec=spec, on_error=on_error))

    def embed(self, column: str, *, model: str | None = None, out: str | None = None, on_error: str = "raise",
              nulls: str = "skip"):
        """A column of embedding vectors (fixed-size lists of float32) of a column's text."""
        self._column(column)
        op = Op("embed", self._model(model, "embed"), "embed")
        rendered = self._ddf.map_partitions(render_column, column, check_nulls(nulls), meta=RENDERED)
        results = self._results(rendered, op, (), on_error, types.embedding(types.embedding_dim(op.model)))
        return self._with(results, out or f"{column}_embedding", on_error)

    def search(self, index, column: str, *, k: int = 5, out: str | None = None, on_error: str = "raise",
               nulls: str = "skip"):
        """A column of the ``k`` nearest documents (structs of id, score, text) for each row's text."""
        if not isinstance(index, ShardedIndex):
            raise TypeError(f"search: index must be a ShardedIndex, got {type(index).__name__}")
        self._column(column)
        op = Op("search", index.embedder, "search", index=index.detached(), k=k)
        rendered = self._ddf.map_partitions(render_column, column, check_nulls(nulls), meta=RENDERED)
        return self._with(self._results(rendered, op, (), on_error, types.HITS), out or f"{column}_hits", on_error)

    def rerank(self, query_column: str, docs_column: str, *, k: int | None = None, model: str | None = None,
               out: str | None = None, on_error: str = "raise", nulls: str = "skip"):
        """A column of each row's documents (a list of str) reordered by relevance to its query,
        the ``k`` best first."""
        self._column(query_column)
        self._column(docs_column)
        op = Op("rerank", self._model(model, "rerank"), "rerank", k=k)
        rendered = self._ddf[[query_column, docs_column]].map_partitions(pair_keys, check_nulls(nulls), meta=RENDERED)
        results = self._results(rendered, op, (), on_error, types.DOCUMENTS)
        return self._with(results, out or f"{docs_column}_reranked", on_error)

    def sim_join(self, other, left_on: str, right_on: str, *, k: int = 1, model: str | None = None,
                 suffixes: tuple[str, str] = ("", "_right"), nulls: str = "skip"):
        """Each row of this table joined to the ``k`` rows of ``other`` whose ``right_on`` text is
        most similar to its ``left_on`` text (cosine of embeddings), with a ``similarity`` column.
        ``other`` is embedded once and broadcast to this table's partitions. A null text matches
        nothing, as a null join key does (``nulls="error"``: a row error instead)."""
        self._column(left_on)
        other.llm._column(right_on)
        left = self.embed(left_on, model=model, out="_daskllm_left_vec", nulls=nulls)
        right = other.llm.embed(right_on, model=model, out="_daskllm_right_vec", nulls=nulls).repartition(npartitions=1)
        meta = sim_join(left._meta, right._meta, k, suffixes)
        return left.map_partitions(sim_join, right, k, suffixes, meta=meta)

    def topk(self, criterion: str, k: int, *, model: str | None = None, out: str = "rating",
             budget: Budget | None = None, chat: bool | None = None, nulls: str = "skip"):
        """The ``k`` rows that best meet ``criterion`` (a template with ``{column}`` fields): the
        model rates each row 0-9 (one token, constrained to digits), then Dask's tree reduction
        ``nlargest`` keeps the best, ties in table order. A row with a null field is not rated
        and never among them."""
        slots = self._slots(criterion)
        model = self._model(model)
        op = Op("rate", model, "topk", criterion, SamplingParams(max_tokens=1), budget=budget,
                chat=self._chat(model, chat))
        rated = self._llm(op, criterion, slots, nulls, "raise", types.RATING, "auto", made=(out,),
                          columns=functools.partial(self._columns, out=out, on_error="raise"))
        return rated.dropna(subset=[out]).nlargest(k, out)

    def agg(self, template: str, *, model: str | None = None, max_tokens: int = 64, split_every: int = 8,
            instruction: str = "Summarize the following in a few sentences:\n", chat: bool | None = None,
            nulls: str = "skip"):
        """One text summarizing the whole table, map-reduce style (Dask's tree reduction): each
        partition's rows (``template`` filled per row) are summarized, then groups of
        ``split_every`` summaries, until one is left. Returns a lazy dask scalar. Rows with a
        null field are left out (``nulls="error"``: a ``RowError`` naming the first)."""
        slots = self._slots(template)
        model = self._model(model)
        options = dict(model=model, sampling=SamplingParams(max_tokens=max_tokens), instruction=instruction,
                       chat=self._chat(model, chat))
        rendered = self._render(template, slots, nulls)
        return rendered.reduction(summarize_chunk, aggregate=summarize_parts, combine=summarize_parts,
                              split_every=split_every, meta=(None, object), chunk_kwargs=options,
                              aggregate_kwargs=options, combine_kwargs=options)

    def estimate(self, **options) -> TableEstimate:
        """Before running: rows, distinct prompts, tokens, stored results and time of each LLM
        operator this table will run (see :func:`daskllm.dataframe.estimate.estimate`)."""
        return estimate(self._ddf, **options)

    def _column(self, column: str) -> None:
        if column not in self._ddf.columns:
            raise KeyError(f"{column!r} is not a column; columns are {list(self._ddf.columns)}")


JOB = "_daskllm_job"  # the attribute of an operator's output frame holding its table job


def _render(frame, template: str, slots: tuple, nulls: str):
    """Each row's prompt (its dedupe key), or why it has none (cells: the null and type rules)."""
    return (frame[list(slots)] if slots else frame).map_partitions(render, template, slots, nulls, meta=RENDERED)


def _mask(results):
    # The mask is one opaque task per partition, never an astype the optimizer can see: dask-expr's
    # filter pushdown takes a predicate ending in astype (or another pass-through op) for the
    # filtered frame when both are co-aligned (one partition, dedupe="local") and replaces
    # ``frame[mask]`` by the mask itself (dask/dask#12172): the filter returned the mask.
    return results["value"].map_partitions(kept, meta=("value", bool))


def _fields(results, spec: tuple, on_error: str) -> dict:
    """An extract's columns: one per field, of its type (and ``extract_error``)."""
    columns = {}
    for name, kind in spec:
        columns[name] = results["value"].map(lambda v, n=name: None if v is None else v[n],
                                             meta=(name, object)).astype(types.FIELDS[kind])
    if on_error == "null":
        columns["extract_error"] = results["error"]
    return columns


@register_series_accessor("llm")
class LLMSeriesAccessor:
    """``series.llm.map / filter / embed``: the frame operators on a series' values, which
    templates name by the series' name (``{text}`` for a series named ``text``)."""

    def __init__(self, series):
        if series.name is None:
            raise ValueError("series.llm needs a named series (templates refer to it by name)")
        self._series = series

    def _frame(self):
        return self._series.to_frame()

    def map(self, template: str, **options):
        out = options.pop("out", "llm_output")
        return self._frame().llm.map(template, out=out, **options)[out]

    def filter(self, predicate: str, **options):
        return self._frame().llm.filter(predicate, **options)[self._series.name]

    def estimate(self, **options) -> TableEstimate:
        return estimate(self._series, **options)

    def embed(self, **options):
        out = options.pop("out", None) or f"{self._series.name}_embedding"
        return self._frame().llm.embed(self._series.name, out=out, **options)[out]
