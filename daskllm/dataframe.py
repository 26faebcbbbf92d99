"""The ``.llm`` accessor: LLM operators over every row of a dask dataframe.

    import daskllm.dataframe  # noqa: F401  (registers the accessor; ``import daskllm`` does too)
    out = ddf.llm.map("Summarize {doc} in one line:", model="small", max_tokens=32, out="summary")
    out = out.llm.filter("Is this about files? {summary}")
    out.to_parquet("summaries/")

Every operator is lazy and composes with dask's expression optimizer. How one runs:

1. **render**: each partition renders its rows' prompts (cheap string work);
2. **distinct**: ``drop_duplicates`` over the whole table (a Dask tree reduction): identical
   prompts anywhere in the table become one call (CSE across rows and partitions);
3. **call**: each partition of distinct prompts, sorted by prompt so shared prefixes are
   adjacent, becomes one batched daskllm call, planned and placed like any daskllm work (the
   shared instruction prefilled once per worker, shards placed with model and cache
   locality by the placement plugin), run from the task (tasks from tasks);
4. **fan out**: the (small) table of results is broadcast to the row partitions, which look
   their rows up.

The output is ``ddf.assign(out=...)``, so a column no later step reads is dropped by dask's
projection pushdown and never generated. A row that fails (prompt too long, output that does
not parse, budget exhausted) raises naming its index (``on_error="raise"``) or yields null
with the reason in ``<out>_error`` (``on_error="null"``); the other rows finish either way.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from distributed import worker_client
from distributed.worker import thread_state

from daskllm import api
from daskllm.api import batch
from daskllm.budget import Budget
from daskllm.engines import SamplingParams
from daskllm.models import resolve
from daskllm.prompts import Slot, Text, parse_template, render_value, tokenizer_for
from daskllm.retrieval import ShardedIndex
from daskllm.runtime import collection, submit
from daskllm.runtime.view import check_served, take_view
from daskllm.worker.host import host, in_worker
from daskllm.worker.usage import DATAFRAME, TaskUsage

STRING = pd.ArrowDtype(pa.string())
KEY = "_daskllm_key"


class RowError(ValueError):
    """A row's LLM call failed; the message names the row's index."""


class BudgetExceeded(RowError):
    """A budget would be exceeded: the work was not started."""


# --- operators -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One LLM operator: what each distinct input becomes. Picklable: it travels to workers."""

    kind: str  # generate | filter | extract | embed | search
    model: str
    name: str  # for usage and errors: map, filter, extract, embed, search
    template: str | None = None
    sampling: SamplingParams | None = None
    fields: tuple = ()  # extract: (name, type name)
    index: object = None  # search: a detached ShardedIndex
    k: int = 5
    budget: Budget | None = None
    chat: bool = False  # the prompt goes to the model as a user message in its chat template


def _render(frame: pd.DataFrame, template: str, slots: tuple) -> pd.Series:
    """Each row's prompt text (the dedupe key); slots render like prompt slots do."""
    segments = parse_template(template)
    columns = {s: frame[s].tolist() for s in slots}
    out = []
    for i in range(len(frame)):
        out.append("".join(seg.text if isinstance(seg, Text) else render_value(columns[seg.name][i])
                           for seg in segments))
    return pd.Series(out, index=frame.index, dtype=STRING, name=KEY)


@functools.cache
def _max_len(model: str) -> int:
    config = json.loads((resolve(model) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


def _call(distinct: pd.DataFrame, op: Op, slots: tuple) -> pd.DataFrame:
    """Run ``op`` on a partition of distinct inputs: one batched daskllm call, from this task."""
    empty = pd.DataFrame({KEY: pd.Series([], dtype=STRING), "value": pd.Series([], dtype=object),
                          "error": pd.Series([], dtype=STRING)})
    if distinct.empty:
        return empty
    distinct = distinct.sort_values(KEY)  # shared prefixes next to each other
    keys = distinct[KEY].tolist()
    cost = _costs(distinct, op)
    errors: dict[int, str] = {i: c for i, c in enumerate(cost) if isinstance(c, str)}
    if op.budget is not None:
        errors.update(_reserve(op.budget, {i: c for i, c in enumerate(cost) if isinstance(c, int)}))
    todo = [i for i in range(len(keys)) if i not in errors]
    values: list = [None] * len(keys)
    started = time.time()
    children, requested = [], {}
    if todo:
        node = _node(distinct.iloc[todo], op, slots)
        try:
            outputs, plan = _compute_nested(node)
            outputs = outputs if node.batched else [outputs]  # a template without fields: one prompt
            children, requested = _plan_keys(plan), plan.report.get("requested", {})
        except Exception as exc:  # noqa: BLE001 - every row of this batch gets the reason
            outputs = None
            for i in todo:
                errors[i] = f"{type(exc).__name__}: {exc}"
        if outputs is not None:
            for i, out in zip(todo, outputs):
                try:
                    values[i] = _parse(out, op)
                except ValueError as exc:
                    errors[i] = str(exc)
    _record(op.name, distinct=len(keys), executed=len(todo), failed=len(errors), children=children,
            requested=requested, started=started)
    return pd.DataFrame({KEY: pd.Series(keys, dtype=STRING), "value": pd.Series(values, dtype=object),
                         "error": pd.Series([errors.get(i) for i in range(len(keys))], dtype=STRING)})


def _reserve(budget: Budget, needs: dict[int, int]) -> dict[int, str]:
    """Reserve the partition's calls (tokens each, by input) in one step; the refused ones' errors."""
    if not needs:
        return {}
    grant = budget.reserve(list(needs.values()))
    return {i: (f"budget exhausted ({grant.tokens_used} of {budget.tokens} tokens, {grant.calls_used} of "
                f"{budget.calls} calls used; this call needs {tokens} tokens)")
            for (i, tokens), ok in zip(needs.items(), grant.granted) if not ok}


def _costs(distinct: pd.DataFrame, op: Op) -> list:
    """Per input: tokens to reserve (prompt + output), an error message, or None (no LLM)."""
    if op.kind in ("embed", "search", "rerank"):
        return [None] * len(distinct)
    tok, limit = tokenizer_for(op.model), _max_len(op.model)
    # The ids the engine will see: the whole prompt string, tokenized as daskllm prompts are.
    segments = parse_template(_template(op))
    out = []
    for row in distinct.to_dict("records"):
        text = "".join(seg.text if isinstance(seg, Text) else render_value(row[seg.name]) for seg in segments)
        if op.chat:
            text = tok.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
        n = len(tok.encode(text, not op.chat))
        if n + 1 > limit:
            out.append(f"prompt has {n} tokens; model {op.model!r} holds at most {limit} including one generated")
        else:
            out.append(n + op.sampling.max_tokens)
    return out


def _node(rows: pd.DataFrame, op: Op, slots: tuple):
    """The daskllm call for these rows: one batched node (a builder call) per operator."""
    if op.kind == "embed":
        return api.embed(batch(rows[KEY].tolist()), model=op.model)
    if op.kind == "search":
        return api.search(op.index, batch(rows[KEY].tolist()), k=op.k)
    if op.kind == "rerank":
        pairs = [json.loads(k) for k in rows[KEY]]
        return api.rerank(batch([q for q, _ in pairs]), batch([d for _, d in pairs]), k=op.k, model=op.model)
    template = _template(op)
    values = {s: batch(rows[s].tolist()) for s in slots}
    if not slots:
        values = {}
    p = api.chat([{"role": "user", "content": template}], **values) if op.chat else api.prompt(template, **values)
    s = op.sampling
    allowed = _yes_no(op.model) if op.kind == "filter" else _digits(op.model) if op.kind == "rate" else ()
    return api.generate(p, model=op.model, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                            seed=s.seed, stop=s.stop, ignore_eos=s.ignore_eos, allowed_token_ids=allowed)


def _template(op: Op) -> str:
    """The prompt template a call really uses: the user's, plus the operator's instruction."""
    # Field names are data (JSON keys), never template fields: a name like "{n}" is text.
    return op.template + _SUFFIX.get(op.kind, "").format(fields=", ".join(_literal(f) for f, _ in op.fields))


def _literal(text: str) -> str:
    """``text`` as template text that stands for itself: its braces are escaped."""
    return text.replace("{", "{{").replace("}", "}}")


_SUFFIX = {"filter": "\nAnswer yes or no:",
           "extract": "\nAnswer with one JSON object with the keys {fields}:\n",
           "rate": "\nRate this from 0 (not at all) to 9 (fully), one digit:"}


@functools.cache
def _yes_no(model: str) -> tuple[int, ...]:
    """The tokens a filter's answer may start with: yes or no, nothing else."""
    return tokenizer_for(model).answer_tokens(("yes", "no"))


@functools.cache
def _digits(model: str) -> tuple[int, ...]:
    """The tokens a rating may start with: the digits 0-9, nothing else."""
    return tokenizer_for(model).answer_tokens(tuple(str(d) for d in range(10)))


def _parse(output, op: Op):
    if op.kind == "filter":
        return output.strip().lower().startswith("y")
    if op.kind == "rate":
        return int(output.strip()[:1])
    if op.kind == "extract":
        return _extract_fields(output, op.fields)
    if op.kind == "search":
        return [{"id": int(h.id), "score": float(h.score), "text": h.text} for h in output]
    return output


def _extract_fields(text: str, fields: tuple) -> dict:
    snippet = text.strip()[:80]
    starts = [m.start() for m in re.finditer(r"\{", text)]
    if not starts:
        raise ValueError(f"output has no JSON object: {snippet!r}")
    # The first complete object: a key or value may hold braces ('{"{n}": 1}'), so the object
    # ends where JSON says, not at the first "}".
    first_error, obj = None, None
    for start in starts:
        try:
            obj, _ = _JSON.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            first_error = first_error or exc
            continue
        if isinstance(obj, dict):
            break
        obj = None
    if obj is None:
        raise ValueError(f"output does not parse as JSON ({first_error}): {snippet!r}")
    out = {}
    for name, kind in fields:
        if name not in obj:
            raise ValueError(f"output has no field {name!r}: {snippet!r}")
        try:
            out[name] = _CASTS[kind](obj[name])
        except (TypeError, ValueError):
            raise ValueError(f"field {name!r} is not {kind}: {obj[name]!r}") from None
    return out


_JSON = json.JSONDecoder()
_CASTS = {"str": str, "int": int, "float": float, "bool": bool}
_DTYPES = {"str": STRING, "int": "Int64", "float": "Float64", "bool": "boolean"}


def _compute_nested(node):
    """Compute a daskllm node from inside a task: planned here, placed by the scheduler plugin."""
    if not in_worker():
        return collection.compute(node)[0], submit.plan([node])
    with worker_client(separate_thread=True) as client:
        submission = submit.plan_and_submit([node], client)
        future = submission.futures[0]
        # If this partition's task is cancelled (the job was), so is the LLM work it started.
        with host().abortable(thread_state.key, lambda: client.loop.add_callback(client._cancel, [future])):
            return future.result(), submission.lowered


def _plan_keys(plan) -> list:
    return plan.task_keys()


def _record(operator: str, *, children=(), **record) -> None:
    host().usage[f"dataframe-{operator}-{uuid.uuid4().hex[:12]}"] = TaskUsage(DATAFRAME, operator=operator,
                                                                          children=tuple(children), **record)


def _lookup(keys: pd.Series, table: pd.DataFrame, op_name: str, on_error: str) -> pd.DataFrame:
    """Each row's value and error, from the broadcast table of distinct results."""
    if len(keys):
        _record(op_name, rows=len(keys))
    values = dict(zip(table[KEY], table["value"]))
    errors = dict(zip(table[KEY], table["error"]))
    value = [values.get(k) if isinstance(k, str) else None for k in keys]
    error = [errors.get(k) if isinstance(k, str) else None for k in keys]
    error = [None if e is None or e is pd.NA else e for e in error]
    if on_error == "raise":
        for index, e in zip(keys.index, error):
            if e is not None:
                raise (BudgetExceeded if e.startswith("budget exhausted") else RowError)(
                    f"{op_name}: row {index!r}: {e}")
    return pd.DataFrame({"value": pd.Series(value, index=keys.index, dtype=object),
                         "error": pd.Series(error, index=keys.index, dtype=STRING)})


def _pair_keys(frame: pd.DataFrame) -> pd.Series:
    """A rerank input as one dedupe key: the query and its documents, as JSON."""
    query, docs = frame.columns
    for index, ds in zip(frame.index, frame[docs]):
        if isinstance(ds, str) or not hasattr(ds, "__iter__"):
            raise RowError(f"rerank: row {index!r}: {docs!r} must hold a list of documents, got "
                           f"{type(ds).__name__} (dask turns object columns into strings unless "
                           f"dataframe.convert-string is off; parquet list columns stay lists)")
    keys = [json.dumps([str(q), [str(d) for d in ds]]) for q, ds in zip(frame[query], frame[docs])]
    return pd.Series(keys, index=frame.index, dtype=STRING, name=KEY)


def _sim_join(left: pd.DataFrame, right: pd.DataFrame, k: int, suffixes) -> pd.DataFrame:
    lvec, rvec = "_daskllm_left_vec", "_daskllm_right_vec"
    lcols = [c for c in left.columns if c != lvec]
    rcols = [c for c in right.columns if c != rvec]
    names = {c: c + suffixes[1] if c in lcols else c for c in rcols}
    rows = []
    if len(left) and len(right):
        a = np.stack(left[lvec].tolist())
        b = np.stack(right[rvec].tolist())
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        b = b / np.linalg.norm(b, axis=1, keepdims=True)
        scores = a @ b.T
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        for i, js in enumerate(best):
            for j in js:
                rows.append((i, j, float(scores[i, j])))
    li = [r[0] for r in rows]
    ri = [r[1] for r in rows]
    out = left[lcols].iloc[li].rename(columns={c: c + suffixes[0] for c in lcols})
    joined = right[rcols].iloc[ri].rename(columns=names).set_axis(out.index)
    return pd.concat([out, joined], axis=1).assign(similarity=pd.Series([r[2] for r in rows], index=out.index,
                                                                         dtype="float64"))


def _summarize(texts: list[str], model: str, sampling: SamplingParams, instruction: str, chat: bool) -> str:
    if not texts:
        return ""
    # The instruction first: every summary call of the tree shares it as a cached prefix.
    rows = "\n".join(texts)  # a value, not template text: rows may hold braces
    if chat:
        p = api.chat([{"role": "user", "content": _literal(instruction) + "{rows}"}],
                         rows=rows)
    else:
        p = api.prompt(_literal(instruction) + "{rows}\nSummary:", rows=rows)
    node = api.generate(p, model=model, max_tokens=sampling.max_tokens)
    summary, plan = _compute_nested(node)
    _record("agg", distinct=1, executed=1, failed=0, children=_plan_keys(plan),
            requested=plan.report.get("requested", {}), rows=len(texts))
    return summary


def _summarize_chunk(keys: pd.Series, model, sampling, instruction, chat) -> str:
    return _summarize([k for k in keys if isinstance(k, str)], model, sampling, instruction, chat)


def _summarize_parts(parts, model, sampling, instruction, chat) -> str:
    return _summarize([p for p in parts if p], model, sampling, instruction, chat)


# --- the accessor ----------------------------------------------------------------------------


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

    def _results(self, keys, op: Op, slots: tuple, on_error: str):
        """Per row (aligned with ``keys``): value and error, each distinct input computed once."""
        if on_error not in ("raise", "null"):
            raise ValueError(f"on_error must be 'raise' or 'null', got {on_error!r}")
        frame = self._ddf[list(slots)].assign(**{KEY: keys}) if slots else keys.to_frame()
        # A task-based shuffle: P2P's per-shuffle bookkeeping (and its log lines) costs more than
        # it saves on a column of short prompt strings.
        distinct = frame.dropna(subset=[KEY]).drop_duplicates(subset=[KEY], shuffle_method="tasks")
        meta = pd.DataFrame({KEY: pd.Series([], dtype=STRING), "value": pd.Series([], dtype=object),
                             "error": pd.Series([], dtype=STRING)})
        table = distinct.map_partitions(_call, op, slots, meta=meta).repartition(npartitions=1)
        meta = pd.DataFrame({"value": pd.Series([], dtype=object), "error": pd.Series([], dtype=STRING)})
        return keys.map_partitions(_lookup, table, op.name, on_error, meta=meta)

    def _with(self, results, out: str, on_error: str, dtype):
        assigned = {out: results["value"].astype(dtype) if dtype is not None else results["value"]}
        if on_error == "null":
            assigned[f"{out}_error"] = results["error"]
        return self._ddf.assign(**assigned)

    @staticmethod
    def _sampling(max_tokens, temperature=0.0, seed=None, stop=(), ignore_eos=False) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop,
                              ignore_eos=ignore_eos)

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
            seed: int | None = None, stop=(), ignore_eos: bool = False, chat: bool | None = None):
        """A new text column ``out``: the model's answer to ``template`` filled from each row."""
        slots = self._slots(template)
        model = self._model(model)
        op = Op("generate", model, "map", template, self._sampling(max_tokens, temperature, seed, stop, ignore_eos),
                budget=budget, chat=self._chat(model, chat))
        keys = self._ddf.map_partitions(_render, template, slots, meta=(KEY, STRING))
        return self._with(self._results(keys, op, slots, on_error), out, on_error, STRING)

    def filter(self, predicate: str, *, model: str | None = None, on_error: str = "raise",
               budget: Budget | None = None, chat: bool | None = None):
        """The rows the model judges true: its answer to ``predicate`` is constrained to yes/no.
        With ``on_error="null"`` a row that cannot be judged is dropped."""
        slots = self._slots(predicate)
        model = self._model(model)
        _yes_no(model)  # fail here if the model cannot say yes or no
        op = Op("filter", model, "filter", predicate, SamplingParams(max_tokens=1), budget=budget,
                chat=self._chat(model, chat))
        keys = self._ddf.map_partitions(_render, predicate, slots, meta=(KEY, STRING))
        results = self._results(keys, op, slots, on_error)
        return self._ddf[results["value"].fillna(False).astype(bool)]

    def extract(self, template: str, fields: dict, *, model: str | None = None, max_tokens: int = 128,
                on_error: str = "raise", budget: Budget | None = None, chat: bool | None = None):
        """Structured output: one column per field (``{"name": str, "year": int}``), parsed from a
        JSON object the model writes."""
        slots = self._slots(template)
        if not fields:
            raise ValueError("extract: fields must name at least one output column")
        names = {t if isinstance(t, str) else getattr(t, "__name__", "") for t in fields.values()}
        if not names <= set(_CASTS):
            raise ValueError(f"extract: field types must be among {sorted(_CASTS)}, got {fields!r}")
        spec = tuple((f, t if isinstance(t, str) else t.__name__) for f, t in fields.items())
        model = self._model(model)
        op = Op("extract", model, "extract", template, SamplingParams(max_tokens=max_tokens),
                fields=spec, budget=budget, chat=self._chat(model, chat))
        keys = self._ddf.map_partitions(_render, template, slots, meta=(KEY, STRING))
        results = self._results(keys, op, slots, on_error)
        columns = {}
        for name, kind in spec:
            columns[name] = results["value"].map(lambda v, n=name: None if v is None else v[n],
                                                 meta=(name, object)).astype(_DTYPES[kind])
        if on_error == "null":
            columns["extract_error"] = results["error"]
        return self._ddf.assign(**columns)

    def embed(self, column: str, *, model: str | None = None, out: str | None = None):
        """A column of embedding vectors (numpy arrays) of a text column."""
        self._column(column)
        op = Op("embed", self._model(model, "embed"), "embed")
        keys = self._ddf[column].astype(STRING).rename(KEY)
        return self._with(self._results(keys, op, (), "raise"), out or f"{column}_embedding", "raise", None)

    def search(self, index, column: str, *, k: int = 5, out: str | None = None):
        """A column of the ``k`` nearest documents (dicts of id, score, text) for each row's text."""
        if not isinstance(index, ShardedIndex):
            raise TypeError(f"search: index must be a ShardedIndex, got {type(index).__name__}")
        self._column(column)
        op = Op("search", index.embedder, "search", index=index.detached(), k=k)
        keys = self._ddf[column].astype(STRING).rename(KEY)
        return self._with(self._results(keys, op, (), "raise"), out or f"{column}_hits", "raise", None)

    def rerank(self, query_column: str, docs_column: str, *, k: int | None = None, model: str | None = None,
               out: str | None = None):
        """A column of each row's documents (a list of str) reordered by relevance to its query,
        the ``k`` best first."""
        self._column(query_column)
        self._column(docs_column)
        op = Op("rerank", self._model(model, "rerank"), "rerank", k=k)
        keys = self._ddf[[query_column, docs_column]].map_partitions(_pair_keys, meta=(KEY, STRING))
        return self._with(self._results(keys, op, (), "raise"), out or f"{docs_column}_reranked", "raise", None)

    def sim_join(self, other, left_on: str, right_on: str, *, k: int = 1, model: str | None = None,
                 suffixes: tuple[str, str] = ("", "_right")):
        """Each row of this table joined to the ``k`` rows of ``other`` whose ``right_on`` text is
        most similar to its ``left_on`` text (cosine of embeddings), with a ``similarity`` column.
        ``other`` is embedded once and broadcast to this table's partitions."""
        self._column(left_on)
        other.llm._column(right_on)
        left = self.embed(left_on, model=model, out="_daskllm_left_vec")
        right = other.llm.embed(right_on, model=model, out="_daskllm_right_vec").repartition(npartitions=1)
        meta = _sim_join(left._meta, right._meta, k, suffixes)
        return left.map_partitions(_sim_join, right, k, suffixes, meta=meta)

    def topk(self, criterion: str, k: int, *, model: str | None = None, out: str = "rating",
             budget: Budget | None = None, chat: bool | None = None):
        """The ``k`` rows that best meet ``criterion`` (a template with ``{column}`` fields): the
        model rates each row 0-9 (one token, constrained to digits), then Dask's tree reduction
        ``nlargest`` keeps the best, ties in table order."""
        slots = self._slots(criterion)
        model = self._model(model)
        op = Op("rate", model, "topk", criterion, SamplingParams(max_tokens=1), budget=budget,
                chat=self._chat(model, chat))
        keys = self._ddf.map_partitions(_render, criterion, slots, meta=(KEY, STRING))
        rated = self._with(self._results(keys, op, slots, "raise"), out, "raise", "int64")
        return rated.nlargest(k, out)

    def agg(self, template: str, *, model: str | None = None, max_tokens: int = 64, split_every: int = 8,
            instruction: str = "Summarize the following in a few sentences:\n", chat: bool | None = None):
        """One text summarizing the whole table, map-reduce style (Dask's tree reduction): each
        partition's rows (``template`` filled per row) are summarized, then groups of
        ``split_every`` summaries, until one is left. Returns a lazy dask scalar."""
        slots = self._slots(template)
        model = self._model(model)
        options = dict(model=model, sampling=SamplingParams(max_tokens=max_tokens), instruction=instruction,
                       chat=self._chat(model, chat))
        keys = self._ddf.map_partitions(_render, template, slots, meta=(KEY, STRING))
        return keys.reduction(_summarize_chunk, aggregate=_summarize_parts, combine=_summarize_parts,
                              split_every=split_every, meta=(None, object), chunk_kwargs=options,
                              aggregate_kwargs=options, combine_kwargs=options)

    def _column(self, column: str) -> None:
        if column not in self._ddf.columns:
            raise KeyError(f"{column!r} is not a column; columns are {list(self._ddf.columns)}")


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

    def embed(self, **options):
        out = options.pop("out", None) or f"{self._series.name}_embedding"
        return self._frame().llm.embed(self._series.name, out=out, **options)[out]


__all__ = ["Budget", "BudgetExceeded", "LLMAccessor", "LLMSeriesAccessor", "RowError"]
