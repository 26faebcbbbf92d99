"""Cost preview of a table job, before anything runs on the engines: per ``ddf.llm`` operator
that the collection will really run, its rows, distinct inputs, prompt and output tokens,
results already in the persistent store, and a time from the engines' measured per-token costs.

The operators are found in the collection's expression after dask's simplification (so a
column that projection pushdown drops, and the operator behind it, is not counted): each is a
``map_partitions`` of :func:`daskllm.dataframe.job.job_calls` (or, with another ``dedupe=``,
:func:`daskllm.dataframe.dedupe.call_owned`) over the distinct rendered prompts, with its
:class:`~daskllm.dataframe.ops.Op` as an argument. Its prompts are
rendered by dask (cheap string work on the cluster, no engine): all of them for a table held in
memory or of few partitions ("exact"), a spread of partitions otherwise ("sampled": distinct
inputs by the bias-corrected Chao1 estimator, tokens and store hits scaled from the sample).
An operator after another that reads only columns no LLM operator makes (a filter on the input
question after a map) is rendered from those columns alone ("exact"); one that reads another
operator's output, or whose rows depend on one (after a filter), cannot be rendered without
running that one: its rows and distinct inputs are bounded by the upstream operator's rows
("upper bound"). Its time: the engines' measured per-token costs, spread over the engines, plus
a measured per-operator overhead (see :func:`calibrate`): this cluster's calibration, else one
the workers remember from an earlier cluster on the same machine, model files and engine
numerics (:mod:`daskllm.worker.calibrations`), which the preview's notes then name.
"""

from __future__ import annotations

import html
import json
import os
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

import dask
import pandas as pd
from dask.dataframe.dask_expr._collection import new_collection
from dask.dataframe.dask_expr._expr import Assign, AssignAlign, DropnaFrame, MapPartitions, Projection
from dask.dataframe.dask_expr._reductions import DropDuplicates
from dask.dataframe.dask_expr.io.io import FromPandas

from daskllm.dataframe.calls import call_sampling
from daskllm.dataframe.dedupe import call_owned, local_distinct
from daskllm.dataframe.job import group_key, head_text, job_calls, prefix_bound, run_calls
from daskllm.dataframe.ops import KEY, WHEN, Op, prompt_ids
from daskllm.dataframe.rows import RENDERED, render
from daskllm.prompts import tokenizer_for
from daskllm.runtime.metering import usage
from daskllm.runtime.view import current_client, take_view
from daskllm.worker.calibrations import calibrations, remember_on_worker
from daskllm.worker.control import resident_models
from daskllm.worker.costs import calibrate as calibrate_worker
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
class JobEstimate:
    """A table job's plan (the operators computed together, :mod:`daskllm.dataframe.job`): its
    calls, the prefix groups its shuffle sends to one engine each, and the prefill it will
    compute (each call's tokens past the blocks it shares with the call before it, the job's
    calls sorted) against the least any plan could (the distinct-prefix bound)."""

    operators: tuple[str, ...]
    model: str
    method: str
    calls: int
    groups: int
    prompt_tokens: int
    predicted_prefill: int
    bound: int

    def __str__(self) -> str:
        ratio = self.predicted_prefill / self.bound if self.bound else 1.0
        return (f"table job ({', '.join(self.operators)}; {self.model}, {self.method}): {self.calls} calls in "
                f"{self.groups} prefix groups; prefill predicted {self.predicted_prefill} of {self.prompt_tokens} "
                f"prompt tokens, against a distinct-prefix bound of {self.bound} ({ratio:.2f}x)")


@dataclass(frozen=True, slots=True)
class TableEstimate:
    """What ``ddf.llm.estimate()`` and ``daskllm.explain(ddf)`` return."""

    operators: tuple[OperatorEstimate, ...]
    jobs: tuple[JobEstimate, ...] = ()
    # model -> measured per-token seconds and overheads, with its engines (and "remembered": from when and what)
    costs: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def seconds(self) -> float | None:
        """The whole job's estimated engine time, operators one after another; None if any is unknown."""
        times = [o.seconds for o in self.operators if o.output_tokens is not None]  # the LLM operators
        return None if not times or None in times else sum(times)

    def to_dict(self) -> dict:
        return {"operators": [{**asdict(o), "calls": o.calls} for o in self.operators],
                "jobs": [asdict(j) for j in self.jobs], "costs": dict(self.costs),
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
        return [*map(str, self.jobs), line, *self.notes]

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
    # Within a table job, in the order its operators were added (their number in it).
    return sorted(found, key=lambda e: (len(upstream_calls(e)), job_number(e)))


def job_number(expr) -> int:
    """A call step's operator's number in its table job (0 outside one)."""
    return expr.args[_op_at(expr) + 2] if expr.func is job_calls else 0


def is_call(expr) -> bool:
    return isinstance(expr, MapPartitions) and expr.func in (call_owned, job_calls)


def upstream_calls(expr) -> list:
    return [e for e in expr.frame.walk() if is_call(e)]


def operator_of(expr) -> tuple[Op, tuple]:
    """A call step's operator and its template's slots."""
    i = _op_at(expr)
    return expr.args[i], expr.args[i + 1]


def _op_at(expr) -> int:
    """Where a call step's arguments hold its operator (its slots, and a job's number, follow)."""
    return next(i for i, a in enumerate(expr.args) if isinstance(a, Op))  # args hold expressions: no ==


def keyed_rows(expr):
    """The rows a call step dedupes (slot columns and the prompt as ``KEY``): below its dedupe."""
    e = expr.frame
    while isinstance(e, (DropDuplicates, DropnaFrame)) or (isinstance(e, MapPartitions) and e.func is local_distinct):
        e = e.frame
    return e


def per_partition(expr) -> bool:
    """Whether each partition calls its own distinct inputs (``dedupe="local"``): a duplicate
    across partitions is then one call per partition holding it."""
    if expr.func is job_calls:  # a table job's calls: each distinct input called once
        return False
    frame = expr.frame
    owners = expr.args[1]
    return owners is None and isinstance(frame, MapPartitions) and frame.func is local_distinct \
        and frame.npartitions > 1


def estimate(collection, *, exact: bool | None = None, sample_partitions: int = 4,
             costs: dict | None = None) -> TableEstimate:
    """The cost preview of ``collection`` (a dask dataframe or series built with ``.llm``
    operators). ``exact``: render every prompt (True) or a sample of ``sample_partitions``
    partitions (False); by default, exact for tables in memory or of at most 16 partitions.
    ``costs``: per model, as :func:`measured_costs` returns (by default, asked of the cluster)."""
    costs = measured_costs() if costs is None else costs
    notes = []
    missing = set()
    previews: dict[str, OperatorEstimate] = {}
    kept: dict[str, Rendered] = {}  # a table job's operators: what they render
    found = operator_calls(collection)
    for expr in found:
        op, slots = operator_of(expr)
        above = [previews[e._name] for e in upstream_calls(expr) if e._name in previews]
        inputs = input_rows(expr, op, slots) if above else None
        if inputs is not None:  # reads only columns no LLM operator makes: rendered from them
            distinct = inputs.map_partitions(local_distinct, meta=inputs._meta)
            preview = rendered(inputs, distinct, per_partition(expr), op, exact, sample_partitions, kept, expr)
        elif above and any(p.calls for p in above):
            preview = bounded(op, above)
        else:  # the first operator, or one after operators all answered by the store (rendered from it)
            keyed = new_collection(keyed_rows(expr))
            preview = rendered(keyed, new_collection(expr.frame), per_partition(expr), op, exact, sample_partitions,
                               kept, expr)
        if WHEN in expr.frame._meta.columns:  # a table job's call after its filter: on the rows it keeps
            preview = replace(preview, method=f"upper bound ({preview.method}; runs on the rows the filter keeps)")
        previews[expr._name] = preview
    jobs = []
    for names in job_members(collection, kept):
        job, computed = job_estimate(names, kept, previews)
        jobs.append(job)
        for name, tokens in computed.items():
            previews[name] = replace(previews[name], computed_tokens=tokens)
    for expr in found:
        op, _ = operator_of(expr)
        preview = previews[expr._name]
        if preview.prompt_tokens is not None and op.kind in LLM_KINDS:
            if op.model in costs:
                preview = replace(preview, seconds=engine_seconds(preview, costs[op.model]))
            else:
                missing.add(op.model)
        previews[expr._name] = preview
    for model in sorted(missing):
        notes.append(f"no measured per-token cost for {model!r} yet: run daskllm.dataframe.calibrate() "
                     f"for a time estimate")
    used = {op.model for op in previews.values() if op.seconds is not None}
    notes += [remembered_note(model, costs[model]["remembered"]) for model in sorted(used)
              if costs[model].get("remembered")]
    if any(p.method.startswith("upper bound") for p in previews.values()):
        notes.append("upper bound: an operator reading another's output is bounded by that one's rows; its "
                     "prompt tokens are known only once that one has run")
    return TableEstimate(tuple(previews.values()), tuple(jobs), costs, tuple(notes))


def engine_seconds(preview: OperatorEstimate, cost: dict) -> float:
    """The operator's time: computed prompt tokens and output tokens at the measured per-token
    costs, spread over the engines serving the model, plus what calibration measured an
    operator's run to add to that (planning, scheduling, the dedupe barrier, Python work).
    Nothing to call (every input in the result store): the lookups only, counted as 0."""
    if not preview.calls:
        return 0.0
    computed = preview.computed_tokens if preview.computed_tokens is not None else preview.prompt_tokens
    work = computed * cost["prefill_s_per_token"] + preview.output_tokens * cost["decode_s_per_token"]
    overhead = cost.get("operator_overhead_s", 0.0) + preview.calls * cost.get("call_overhead_s", 0.0)
    return overhead + work / max(1, cost["engines"])


def replace(preview: OperatorEstimate, **changes) -> OperatorEstimate:
    return OperatorEstimate(**{**asdict(preview), **changes})


def input_rows(expr, op: Op, slots: tuple):
    """The rows of an operator that reads only columns no LLM operator makes (input columns, even
    after a map), with their prompt as ``KEY``, rendered from those columns alone: None where a
    slot is another operator's output or the rows depend on one (after a filter or topk)."""
    if not slots or op.template is None:
        return None
    # Below the assigns that make other columns (a map's output, the prompt): dask's projection
    # pushdown keeps some of them, so they are peeled here. What is left holds an LLM call only
    # where these columns, or which rows there are (after a filter or topk), need one.
    e, wanted = keyed_rows(expr), set(slots)
    while (isinstance(e, Projection) or (isinstance(e, Assign) and not wanted & set(e.keys))
           or (isinstance(e, AssignAlign) and e.column not in wanted)):
        e = e.frame
    columns = new_collection(e)[list(slots)]
    if any(is_call(c) for c in columns.expr.simplify().walk()):
        return None
    keys = columns.map_partitions(render, op.template, slots, "skip", meta=RENDERED)[KEY]
    return columns.assign(**{KEY: keys})


def rendered(keyed, distinct_rows, per_part: bool, op: Op, exact: bool | None,
             sample_partitions: int, kept: dict | None = None, expr=None) -> OperatorEstimate:
    """Render the operator's prompts (all, or a sample of partitions) and count. ``keyed``: its
    rows with their prompt as ``KEY``; ``distinct_rows``: each partition's distinct ones.
    A table job's operator (``expr``) keeps what it rendered in ``kept``."""
    keep = kept if expr is not None and expr.func is job_calls else None
    name = None if keep is None else expr._name
    if exact is None:
        exact = keyed.npartitions <= EXACT_PARTITIONS or all(
            isinstance(e, FromPandas) for e in keyed.expr.leaves())
    if exact or keyed.npartitions <= sample_partitions:
        distinct, rows = dask.compute(distinct_rows, keyed.shape[0])
        if not per_part:  # the table's distinct inputs, each called once
            distinct = distinct.drop_duplicates(subset=[KEY])
        return counted(op, distinct, rows, len(distinct), "exact", keep, name)
    step = keyed.npartitions / sample_partitions
    picks = sorted({int(i * step) for i in range(sample_partitions)})
    sample, rows = dask.compute(keyed.partitions[picks], keyed.shape[0])
    sample = sample.dropna(subset=[KEY])
    distinct = sample.drop_duplicates(subset=[KEY])
    method = f"sampled {len(picks)} of {keyed.npartitions} partitions"
    return counted(op, distinct, rows, distinct_count(sample[KEY], rows), method, keep, name)


def distinct_count(sample: pd.Series, rows: int) -> int:
    """Distinct values among ``rows`` from a sample of them: the bias-corrected Chao1 estimate
    (unseen values from how many were seen once and twice), at most every unsampled row new."""
    seen = Counter(Counter(sample).values())
    d, f1, f2 = sum(seen.values()), seen.get(1, 0), seen.get(2, 0)
    return min(rows - (len(sample) - d), round(d + f1 * (f1 - 1) / (2 * (f2 + 1))))


def counted(op: Op, distinct: pd.DataFrame, rows: int, total: int, method: str, kept: dict | None = None,
            name: str | None = None) -> OperatorEstimate:
    """Tokens and store hits of ``distinct`` (all distinct inputs, or a sample of them standing
    for ``total``); a table job's operator keeps its calls' prompts in ``kept[name]``."""
    if op.kind not in LLM_KINDS:  # embed, search, rerank: no prefill or decode
        return OperatorEstimate(op.name, op.model, method, rows, total, 0, None, None, None)
    share = total / len(distinct) if len(distinct) else 0.0
    ids = prompt_ids(distinct, op)
    sampling = call_sampling(op)
    stored = are_stored(op.model, ids, sampling)
    todo = [i for i, s in zip(ids, stored) if not s]
    hits = round(share * sum(stored))
    calls = total - hits
    if kept is not None:
        kept[name] = Rendered(op, method, share, [k for k, s in zip(distinct[KEY], stored) if not s],
                            [list(i) for i in todo])
    return OperatorEstimate(op.name, op.model, method, rows, total, hits, round(share * sum(map(len, todo))),
                            calls * output_bound(op), None, round(share * computed_tokens(todo)))


@dataclass(frozen=True)
class Rendered:
    """A table job operator's calls still to run, as rendered for the preview (or a sample of
    them, each standing for ``share`` calls)."""

    op: Op
    method: str
    share: float
    keys: list[str]
    ids: list[list[int]]


def job_members(collection, kept: dict[str, Rendered]) -> list[list[str]]:
    """The kept operators (their expressions' names) of each table job in the collection, of
    one model each (as a job sorts its calls): those whose calls one ``run_calls`` step runs
    (not an earlier job's, upstream of it)."""
    runs = [e for e in collection.expr.simplify().walk() if isinstance(e, MapPartitions) and e.func is run_calls]
    jobs = []
    for run in runs:
        inner = {c._name for other in run.frame.walk() if isinstance(other, MapPartitions)
                 and other.func is run_calls for c in other.walk() if is_call(c)}
        mine = {c._name for c in run.frame.walk() if is_call(c) and c._name not in inner}
        by_model: dict[str, list[str]] = {}
        for name, rendered_ in kept.items():  # kept in operator_calls' order: a job's in its operators' order
            if name in mine and rendered_.op.kind in LLM_KINDS:
                by_model.setdefault(rendered_.op.model, []).append(name)
        jobs += list(by_model.values())
    return jobs


def job_estimate(names: list[str], kept: dict[str, Rendered],
                 previews: dict[str, OperatorEstimate]) -> tuple[JobEstimate, dict[str, int]]:
    """A job's groups and predicted prefill against its bound, and each operator's share of that
    prefill (a prefix several operators share is computed by the first in sorted order)."""
    block = dask.config.get("daskllm.engine.block-size")
    calls = sorted((ids, name) for name in names for ids in kept[name].ids)
    computed: dict[str, float] = dict.fromkeys(names, 0.0)
    for (_, name), tokens in zip(calls, computed_each([ids for ids, _ in calls], block)):
        computed[name] += tokens * kept[name].share
    ops = [kept[n].op for n in names]
    skip = len(os.path.commonprefix([head_text(op.template) for op in ops]))
    groups = {group_key(op, key, skip) for n, op in zip(names, ops) for key in kept[n].keys}
    share = max(kept[n].share for n in names)  # a sample stands for the rest
    methods = sorted({kept[n].method for n in names})
    job = JobEstimate(tuple(previews[n].operator for n in names), ops[0].model, ", ".join(methods),
                      sum(previews[n].calls for n in names), round(len(groups) * share),
                      sum(previews[n].prompt_tokens or 0 for n in names), round(sum(computed.values())),
                      round(prefix_bound([ids for n in names for ids in kept[n].ids], block) * share))
    return job, {n: round(v) for n, v in computed.items()}


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
    return sum(computed_each(sorted(ids), block or dask.config.get("daskllm.engine.block-size")))


def computed_each(prompts: list[list[int]], block: int):
    """Per prompt of ``prompts`` (sent in this order), the tokens an engine computes: those past
    the full blocks it shares with the prompt before it (the last token is always computed)."""
    previous: list = []
    for prompt in prompts:
        shared = next((k for k, (a, b) in enumerate(zip(prompt, previous)) if a != b), min(len(prompt), len(previous)))
        yield len(prompt) - min(shared // block * block, len(prompt) - 1)
        previous = prompt


def bounded(op: Op, above: list[OperatorEstimate]) -> OperatorEstimate:
    """An operator on another's output: at most as many rows (and distinct inputs) as it."""
    rows = max((p.rows for p in above), default=0)
    names = ", ".join(sorted({p.operator for p in above}))
    output = rows * output_bound(op) if op.kind in LLM_KINDS else None
    return OperatorEstimate(op.name, op.model, f"upper bound (reads {names} output)", rows, rows, 0, None,
                            output, None)


def remembered_note(model: str, remembered: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(remembered["measured_at"]))
    return (f"time for {model!r} from a remembered calibration, measured {when} on {remembered['machine']} "
            f"({remembered['numerics']}); daskllm.dataframe.calibrate() measures this cluster again")


PER_TOKEN = ("prefill_s_per_token", "decode_s_per_token")
OVERHEADS = ("operator_overhead_s", "call_overhead_s")


def measured_costs(client=None) -> dict:
    """Per model: the best per-token seconds any worker measured, how many engines serve it, and
    the seconds an operator's run adds to its engines' work (``operator_overhead_s``, and
    ``call_overhead_s`` per call). From this cluster's :func:`calibrate`, else from the
    calibrations its workers remember for their engines (then ``remembered`` says when it was
    measured, on what machine and numerics). Waits for engines still loading."""
    client = client if client is not None else current_client()
    if client is None:
        return {}
    engines = Counter({model: n for (kind, model), n in take_view(client).holders if kind == "llm"})
    found: dict[str, list[dict]] = {}
    for per_model in client.run(calibrations).values():
        for model, record in per_model.items():
            found.setdefault(model, []).append(record)
    costs = {}
    for model, records in found.items():
        records = [r for r in records if not r["remembered"]] or records  # this cluster's own, where measured
        cost = {k: min(r.get(k, 0.0) for r in records) for k in PER_TOKEN + OVERHEADS}
        cost["engines"] = engines.get(model, 1)
        if records[0]["remembered"]:
            latest = max(records, key=lambda r: r["measured_at"])
            cost["remembered"] = {k: latest[k] for k in ("measured_at", "machine", "numerics")}
        costs[model] = cost
    return costs


def calibrate(models=None, client=None) -> dict:
    """Measure, per model the cluster serves: the engines' per-token costs on every worker, then
    what a small table job takes beyond them (planning, scheduling, the dedupe barrier, the
    calls' Python work), so that later estimates carry a time. The workers keep the result for
    this cluster and remember it on disk for their engines' identity (model files, numerics,
    machine), replacing what they remembered: a later cluster on the same machine previews
    with it. Returns what :func:`measured_costs` then reports."""
    client = client if client is not None else current_client()
    if client is None:
        raise RuntimeError("calibrate needs a dask client (a cluster whose engines it measures)")
    holding = resident_models(client)  # waits for engines still loading: no part of the measurement
    held = {model for models_here in holding.values() for model in models_here}
    for model in sorted(models or held):
        workers = [w for w, models_here in holding.items() if model in models_here]
        if not workers:
            raise ValueError(f"calibrate: no worker of this cluster holds {model!r}")
        # A task on every worker at once (as every worker runs in a job), in its thread pool: never
        # on its event loop, whose heartbeats go on during the measurement.
        measured = client.gather([client.submit(measure, model, workers=[w], allow_other_workers=False, pure=False)
                                  for w in workers])
        cost = {k: min(m[k] for m in measured) for k in PER_TOKEN}
        cost = {**cost, **job_overhead(model, {**cost, "engines": len(workers)}, client), "engines": len(workers)}
        client.run(remember_on_worker, model, cost, workers=workers)
    return measured_costs(client)


# Prompts and batches of a table job's size: per-token costs of the batches a job's partitions
# make. One step of 128 prompt tokens costs per token what a longer step does (a CPU engine's
# step is at most torch_engine.CPU_PREFILL_CHUNK tokens); 32 sequences then decode 2 tokens
# each, continuing those prompts (see daskllm.worker.costs.calibrate): about 2 s.
CALIBRATION = {"prefill_prompts": 2, "prompt_tokens": 64, "decode_seqs": 32, "decode_tokens": 2}


def measure(model: str) -> dict:
    warm_up(model)
    return calibrate_worker(model, **CALIBRATION)


def warm_up(model: str, dask_worker=None) -> None:
    """What a worker's first request and first table job pay once (the engine's first steps,
    loading the tokenizer a partition renders its prompts with): not part of a run's costs."""
    tokenizer_for(model)
    get_engine(model).generate([[0, 11, 12, 13]], SamplingParams(max_tokens=2, ignore_eos=True))


def table_job(model: str, client, engines: int, calls_per_partition: int,
              max_tokens: int = 1) -> tuple[int, float, tuple[int, int]]:
    """Run a small ``map`` job of fresh prompts (no result store or prefix cache hit), two
    partitions per engine; its calls, wall seconds and the engine work it did (computed prompt
    tokens and decoded tokens, as a preview counts them)."""
    import dask.dataframe as dd  # here: the accessor module imports this one

    parts = 2 * engines
    tag = uuid.uuid4().hex[:8]
    rows = pd.DataFrame({"q": [f"Calibration {tag}: say the number {i}." for i in range(calls_per_partition * parts)]})
    # chat=False: no tokenizer needed on the client, whose first load is no part of a run
    job = dd.from_pandas(rows, npartitions=parts).llm.map("{q}", model=model, max_tokens=max_tokens, ignore_eos=True,
                                                           chat=False, out="a")
    with usage() as used:
        start = time.perf_counter()
        job.compute()
        wall = time.perf_counter() - start
    return len(rows), wall, (used.prefill_tokens_computed, used.decode_tokens)


def job_overhead(model: str, cost: dict, client) -> dict[str, float]:
    """What a table operator takes beyond its engines' modelled work: a fixed part (planning,
    scheduling, the dedupe barrier) and a part per call (its Python work: rendering, task
    bookkeeping, parsing), fitted to the wall times of two small ``map`` jobs (1 and 4 fresh
    prompts per partition, one output token each: decoding is the engines' measured work, not
    overhead) minus their computed prompt and decoded tokens at the measured per-token costs
    ``cost``, spread over its ``engines``. Run after :func:`warm_up` on every worker."""
    def extra(per_part: int) -> tuple[int, float]:
        calls, wall, (prefill, decode) = table_job(model, client, cost["engines"], per_part)
        work = prefill * cost["prefill_s_per_token"] + decode * cost["decode_s_per_token"]
        return calls, wall - work / max(1, cost["engines"])

    small, large = extra(1), extra(4)
    per_call = max(0.0, (large[1] - small[1]) / (large[0] - small[0]))
    return {"operator_overhead_s": max(0.0, small[1] - per_call * small[0]), "call_overhead_s": per_call}
