"""Cost preview of a table job, before anything runs on the engines: per ``ddf.llm`` operator
that the collection will really run, its rows, distinct inputs, prompt and output tokens,
results already in the persistent store, and a time from the engines' measured per-token costs.

The operators are found in the collection's expression after dask's simplification (so a
column that projection pushdown drops, and the operator behind it, is not counted): each is a
``map_partitions`` of :func:`daskllm.dataframe.dedupe.call_owned` over the distinct rendered
prompts (see :mod:`daskllm.dataframe.dedupe`), with its :class:`~daskllm.dataframe.ops.Op` as
an argument. Its prompts are
rendered by dask (cheap string work on the cluster, no engine): all of them for a table held in
memory or of few partitions ("exact"), a spread of partitions otherwise ("sampled": distinct
inputs by the bias-corrected Chao1 estimator, tokens and store hits scaled from the sample).
An operator that reads another operator's output cannot be rendered without running that one:
its rows and distinct inputs are bounded by the upstream operator's rows ("upper bound").
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import asdict, dataclass, field

import dask
import pandas as pd
from dask.dataframe.dask_expr._collection import new_collection
from dask.dataframe.dask_expr._expr import DropnaFrame, MapPartitions
from dask.dataframe.dask_expr._reductions import DropDuplicates
from dask.dataframe.dask_expr.io.io import FromPandas

from daskllm.dataframe.calls import call_sampling
from daskllm.dataframe.dedupe import call_owned, local_distinct
from daskllm.dataframe.ops import KEY, Op, prompt_ids
from daskllm.prompts import tokenizer_for
from daskllm.runtime.view import current_client, take_view
from daskllm.worker.costs import calibrate as calibrate_worker
from daskllm.worker.costs import measured
from daskllm.worker.store import are_stored
from daskllm.engines import SamplingParams
from daskllm.worker.host import get_engine

LLM_KINDS = ("generate", "filter", "extract", "rate")
EXACT_PARTITIONS = 16  # up to this many partitions every prompt is rendered; more are sampled


@dataclass(frozen=True, slots=True)
class OperatorEstimate:
    """One operator's preview. Token counts and ``seconds`` cover the calls expected to execute
    (distinct inputs not already in the result store); None where they cannot be known yet."""

    operator: str  # map, filter, extract, topk, embed, search, rerank
    model: str
    method: str  # "exact", "sampled k of n partitions" or "upper bound (...)"
    rows: int
    distinct: int
    cache_hits: int
    prompt_tokens: int | None
    output_tokens: int | None  # a bound: max_tokens per executed call (the longest choice's tokens for choices=)
    seconds: float | None
    # prompt tokens the engines compute: a prefix the sorted prompts share is computed once per engine
    computed_tokens: int | None = None

    @property
    def calls(self) -> int:
        return self.distinct - self.cache_hits


@dataclass(frozen=True, slots=True)
class TableEstimate:
    """What ``ddf.llm.estimate()`` and ``daskllm.explain(ddf)`` return."""

    operators: tuple[OperatorEstimate, ...]
    costs: dict = field(default_factory=dict)  # model -> measured per-token seconds, with its engines
    notes: tuple[str, ...] = ()

    @property
    def seconds(self) -> float | None:
        """The whole job's estimated engine time, operators one after another; None if any is unknown."""
        times = [o.seconds for o in self.operators if o.output_tokens is not None]  # the LLM operators
        return None if not times or None in times else sum(times)

    def to_dict(self) -> dict:
        return {"operators": [{**asdict(o), "calls": o.calls} for o in self.operators], "costs": dict(self.costs),
                "seconds": self.seconds, "notes": list(self.notes)}

    COLUMNS = ("operator", "model", "method", "rows", "distinct", "cache_hits", "calls", "prompt_tokens",
               "output_tokens", "seconds")

    def _cells(self) -> list[list[str]]:
        def cell(o, c):
            v = getattr(o, c)
            return "?" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
        return [[cell(o, c) for c in self.COLUMNS] for o in self.operators]

    def _footer(self) -> list[str]:
        total = self.seconds
        known = [o for o in self.operators if o.seconds is not None]
        if total is not None:
            line = f"estimated time: {total:.3g} s"
        elif known:
            line = (f"estimated time: {sum(o.seconds for o in known):.3g} s for {', '.join(o.operator for o in known)}"
                    f"; unknown for the rest")
        else:
            line = "estimated time: unknown"
        return [line, *self.notes]

    def __str__(self) -> str:
        rows = [list(self.COLUMNS)] + self._cells()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.COLUMNS))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        if not self.operators:
            lines = ["no LLM operator runs in this collection"]
        return "\n".join(lines + self._footer())

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in self._cells())
        foot = "".join(f"<p>{html.escape(line)}</p>" for line in self._footer())
        return f"<table><tr>{head}</tr>{body}</table>{foot}"


def operator_calls(collection) -> list[MapPartitions]:
    """The LLM operators the collection will run, upstream first."""
    found = [e for e in collection.expr.simplify().walk() if is_call(e)]
    return sorted(found, key=lambda e: len(upstream_calls(e)))


def is_call(expr) -> bool:
    return isinstance(expr, MapPartitions) and expr.func is call_owned


def upstream_calls(expr) -> list:
    return [e for e in expr.frame.walk() if is_call(e)]


def operator_of(expr) -> tuple[Op, tuple]:
    """A call step's operator and its template's slots."""
    i = next(i for i, a in enumerate(expr.args) if isinstance(a, Op))  # args hold expressions: no ==
    return expr.args[i], expr.args[i + 1]


def keyed_rows(expr):
    """The rows a call step dedupes (slot columns and the prompt as ``KEY``): below its dedupe."""
    e = expr.frame
    while isinstance(e, (DropDuplicates, DropnaFrame)) or (isinstance(e, MapPartitions) and e.func is local_distinct):
        e = e.frame
    return e


def per_partition(expr) -> bool:
    """Whether each partition calls its own distinct inputs (``dedupe="local"``): a duplicate
    across partitions is then one call per partition holding it."""
    frame = expr.frame
    owners = expr.args[1]
    return owners is None and isinstance(frame, MapPartitions) and frame.func is local_distinct \
        and frame.npartitions > 1


def estimate(collection, *, exact: bool | None = None, sample_partitions: int = 4) -> TableEstimate:
    """The cost preview of ``collection`` (a dask dataframe or series built with ``.llm``
    operators). ``exact``: render every prompt (True) or a sample of ``sample_partitions``
    partitions (False); by default, exact for tables in memory or of at most 16 partitions."""
    costs = measured_costs()
    notes = []
    missing = set()
    previews: dict[str, OperatorEstimate] = {}
    for expr in operator_calls(collection):
        op, _ = operator_of(expr)
        above = [previews[e._name] for e in upstream_calls(expr) if e._name in previews]
        if above and any(p.calls for p in above):
            preview = bounded(op, above)
        else:  # reads only input columns, or answers all in the result store: rendered (from the store)
            preview = rendered(expr, op, exact, sample_partitions)
        if preview.prompt_tokens is not None and op.kind in LLM_KINDS:
            if op.model in costs:
                preview = replace(preview, seconds=engine_seconds(preview, costs[op.model]))
            else:
                missing.add(op.model)
        previews[expr._name] = preview
    for model in sorted(missing):
        notes.append(f"no measured per-token cost for {model!r} yet: run daskllm.dataframe.calibrate() "
                     f"for a time estimate")
    if any(p.method.startswith("upper bound") for p in previews.values()):
        notes.append("upper bound: an operator reading another's output is bounded by that one's rows; its "
                     "prompt tokens are known only once that one has run")
    return TableEstimate(tuple(previews.values()), costs, tuple(notes))


def engine_seconds(preview: OperatorEstimate, cost: dict) -> float:
    """The operator's engine time: computed prompt tokens and output tokens at the measured
    per-token costs, spread over the engines serving the model."""
    computed = preview.computed_tokens if preview.computed_tokens is not None else preview.prompt_tokens
    return (computed * cost["prefill_s_per_token"] + preview.output_tokens * cost["decode_s_per_token"]) \
        / max(1, cost["engines"])


def replace(preview: OperatorEstimate, **changes) -> OperatorEstimate:
    return OperatorEstimate(**{**asdict(preview), **changes})


def rendered(expr, op: Op, exact: bool | None, sample_partitions: int) -> OperatorEstimate:
    """Render the operator's prompts (all, or a sample of partitions) and count."""
    keyed = new_collection(keyed_rows(expr))  # the rows, with their prompt as KEY
    if exact is None:
        exact = keyed.npartitions <= EXACT_PARTITIONS or all(
            isinstance(e, FromPandas) for e in keyed.expr.leaves())
    if exact or keyed.npartitions <= sample_partitions:
        distinct, rows = dask.compute(new_collection(expr.frame), keyed.shape[0])
        if not per_partition(expr):  # the table's distinct inputs, each called once
            distinct = distinct.drop_duplicates(subset=[KEY])
        return counted(op, distinct, rows, len(distinct), "exact")
    step = keyed.npartitions / sample_partitions
    picks = sorted({int(i * step) for i in range(sample_partitions)})
    sample, rows = dask.compute(keyed.partitions[picks], keyed.shape[0])
    sample = sample.dropna(subset=[KEY])
    distinct = sample.drop_duplicates(subset=[KEY])
    method = f"sampled {len(picks)} of {keyed.npartitions} partitions"
    return counted(op, distinct, rows, distinct_count(sample[KEY], rows), method)


def distinct_count(sample: pd.Series, rows: int) -> int:
    """Distinct values among ``rows`` from a sample of them: the bias-corrected Chao1 estimate
    (unseen values from how many were seen once and twice), at most every unsampled row new."""
    seen = Counter(Counter(sample).values())
    d, f1, f2 = sum(seen.values()), seen.get(1, 0), seen.get(2, 0)
    return min(rows - (len(sample) - d), round(d + f1 * (f1 - 1) / (2 * (f2 + 1))))


def counted(op: Op, distinct: pd.DataFrame, rows: int, total: int, method: str) -> OperatorEstimate:
    """Tokens and store hits of ``distinct`` (all distinct inputs, or a sample of them standing
    for ``total``)."""
    if op.kind not in LLM_KINDS:  # embed, search, rerank: no prefill or decode
        return OperatorEstimate(op.name, op.model, method, rows, total, 0, None, None, None)
    share = total / len(distinct) if len(distinct) else 0.0
    ids = prompt_ids(distinct, op)
    sampling = call_sampling(op)
    stored = are_stored(op.model, ids, sampling)
    todo = [i for i, s in zip(ids, stored) if not s]
    hits = round(share * sum(stored))
    calls = total - hits
    return OperatorEstimate(op.name, op.model, method, rows, total, hits, round(share * sum(map(len, todo))),
                            calls * output_bound(op), None, round(share * computed_tokens(todo)))


def output_bound(op: Op) -> int:
    """Output tokens per call at most: ``max_tokens``, or the longest choice's tokens where the
    answer is one of ``choices`` (the grammar ends it there)."""
    sampling = call_sampling(op)
    structured = sampling.structured
    if structured is None or structured.kind != "choice":
        return sampling.max_tokens
    tok = tokenizer_for(op.model)
    longest = max(len(tok.encode(choice, False)) for choice in json.loads(structured.spec))
    return min(sampling.max_tokens, longest)


def computed_tokens(ids: list[list[int]], block: int | None = None) -> int:
    """Prompt tokens an engine computes for ``ids`` sent sorted (as a partition's calls are): each
    prompt's full blocks shared with the one before it are read from the prefix cache."""
    block = block or dask.config.get("daskllm.engine.block-size")
    total, previous = 0, []
    for prompt in sorted(ids):
        shared = next((k for k, (a, b) in enumerate(zip(prompt, previous)) if a != b), min(len(prompt), len(previous)))
        total += len(prompt) - min(shared // block * block, len(prompt) - 1)  # the last token is always computed
        previous = prompt
    return total


def bounded(op: Op, above: list[OperatorEstimate]) -> OperatorEstimate:
    """An operator on another's output: at most as many rows (and distinct inputs) as it."""
    rows = max((p.rows for p in above), default=0)
    names = ", ".join(sorted({p.operator for p in above}))
    output = rows * output_bound(op) if op.kind in LLM_KINDS else None
    return OperatorEstimate(op.name, op.model, f"upper bound (reads {names} output)", rows, rows, 0, None,
                            output, None)


def measured_costs(client=None) -> dict:
    """Per model: the best per-token seconds any worker measured, and how many engines serve it."""
    client = client if client is not None else current_client()
    if client is None:
        return {}
    engines = Counter({model: n for (kind, model), n in take_view(client).holders if kind == "llm"})
    best: dict[str, dict] = {}
    for per_model in client.run(measured).values():
        for model, cost in per_model.items():
            b = best.setdefault(model, dict(cost))
            for k, v in cost.items():
                b[k] = min(b[k], v)
    return {model: {**cost, "engines": engines.get(model, 1)} for model, cost in best.items()}


def calibrate(models=None, client=None) -> dict:
    """Measure the engines' per-token costs on every worker (seconds of engine work),
    so that later estimates carry a time. Returns what :func:`measured_costs` then reports."""
    client = client if client is not None else current_client()
    if client is None:
        raise RuntimeError("calibrate needs a dask client (a cluster whose engines it measures)")
    held = {model for (kind, model), _ in take_view(client).holders if kind == "llm"}
    for model in sorted(models or held):
        client.run(warm_up, model)  # a first request pays one-off costs a run does not
        client.run(calibrate_worker, model, **CALIBRATION)
    return measured_costs(client)


# Prompts and batches of a table job's size: a few seconds per model, and per-token costs of the
# batches a job's partitions make, with every worker measuring at once as every worker runs then.
CALIBRATION = {"prefill_prompts": 16, "prompt_tokens": 64, "decode_seqs": 32, "decode_tokens": 8}


def warm_up(model: str, dask_worker=None) -> None:
    get_engine(model).generate([[0, 11, 12, 13]], SamplingParams(max_tokens=2, ignore_eos=True))
