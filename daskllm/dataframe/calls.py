"""One batched daskllm call per partition of distinct inputs, planned and submitted from its task."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid

import numpy as np
import pandas as pd
from distributed.worker import thread_state

from daskllm import api
from daskllm.api import batch
from daskllm.budget import Budget
from daskllm.dataframe.cells import ROW_ERROR, cells, render_cell
from daskllm.dataframe.ops import (
    KEY,
    STRING,
    Op,
    RowError,
    constraint_options,
    costs,
    digits,
    full_template,
    literal,
    parse,
    yes_no,
)
from daskllm.engines import SamplingParams
from daskllm.runtime.here import compute_nested
from daskllm.runtime.view import take_view
from daskllm.worker.host import host, in_worker
from daskllm.worker.usage import DATAFRAME, TaskUsage

@dataclasses.dataclass
class CallCounts:
    """What an operator's calls from one task did: what :func:`record` sums per operator."""

    distinct: int = 0
    executed: int = 0
    failed: int = 0
    children: list = dataclasses.field(default_factory=list)  # the nested plans' task keys
    requested: dict = dataclasses.field(default_factory=dict)

    def add(self, other: CallCounts) -> None:
        self.distinct += other.distinct
        self.executed += other.executed
        self.failed += other.failed
        self.children += other.children
        for op, n in other.requested.items():
            self.requested[op] = self.requested.get(op, 0) + n


def call(distinct: pd.DataFrame, op: Op, slots: tuple, here: bool = True) -> pd.DataFrame:
    """Run ``op`` on a partition of distinct inputs: one batched daskllm call, from this task
    (``here``: on this worker's engines where it holds them, :func:`compute_nested`)."""
    started = time.time()
    results, counts = run(distinct, op, slots, here)
    record(op.name, started=started, **dataclasses.asdict(counts))
    return results


def run(distinct: pd.DataFrame, op: Op, slots: tuple, here: bool = True,
        ids: list | None = None) -> tuple[pd.DataFrame, CallCounts]:
    """:func:`call`'s work, unrecorded: the results (``KEY``, value, error) and their counts.
    ``ids``: the inputs' prompt token ids where the caller has them (in ``distinct``'s order)."""
    empty = pd.DataFrame({KEY: pd.Series([], dtype=STRING), "value": pd.Series([], dtype=object),
                          "error": pd.Series([], dtype=STRING)})
    if distinct.empty:
        return empty, CallCounts()
    order = np.argsort(distinct[KEY].to_numpy(dtype=object), kind="stable")  # shared prefixes next to each other
    distinct = distinct.iloc[order]
    keys = distinct[KEY].tolist()
    if in_worker():  # costs() loads a tokenizer: transformers' lazy imports race with the engines' loading
        host().wait_loaded()
    cost = costs(distinct, op, None if ids is None else [ids[i] for i in order])
    errors: dict[int, str] = {i: c for i, c in enumerate(cost) if isinstance(c, str)}
    if op.budget is not None:
        errors.update(reserve(op.budget, {i: c for i, c in enumerate(cost) if isinstance(c, int)}))
    todo = [i for i in range(len(keys)) if i not in errors]
    values: list = [None] * len(keys)
    children, requested = [], {}
    if todo:
        node = call_node(distinct.iloc[todo], op, slots)
        try:
            (outputs,), plan = compute_nested([node], here)
            outputs = outputs if node.batched else [outputs]  # a template without fields: one prompt
            children, requested = plan_keys(plan), plan.report.get("requested", {})
        except ValueError:  # a CallError: an input failed; each runs alone, for its own outcome
            outputs = [None] * len(todo)
        except Exception as exc:  # noqa: BLE001 - every row of this batch gets the reason
            outputs = None
            for i in todo:
                errors[i] = f"{type(exc).__name__}: {exc}"
        if outputs is not None:
            for i, out in zip(todo, outputs):
                # One bad input never fails the rest of its batch: each is run by itself.
                out, error = (out, None) if out is not None else alone(distinct.iloc[[i]], op, slots)
                try:
                    values[i] = parse(out, op) if error is None else None
                except ValueError as exc:
                    error = str(exc)
                if error is not None:
                    errors[i] = error
    results = pd.DataFrame({KEY: pd.Series(keys, dtype=STRING), "value": pd.Series(values, dtype=object),
                            "error": pd.Series([errors.get(i) for i in range(len(keys))], dtype=STRING)})
    return results, CallCounts(len(keys), len(todo), len(errors), list(children), dict(requested))


def reserve(budget: Budget, needs: dict[int, int]) -> dict[int, str]:
    """Reserve the partition's calls (tokens each, by input) in one step; the refused ones' errors."""
    if not needs:
        return {}
    grant = budget.reserve(list(needs.values()))
    return {i: (f"budget exhausted ({grant.tokens_used} of {budget.tokens} tokens, {grant.calls_used} of "
                f"{budget.calls} calls used; this call needs {tokens} tokens)")
            for (i, tokens), ok in zip(needs.items(), grant.granted) if not ok}



def alone(row: pd.DataFrame, op: Op, slots: tuple) -> tuple:
    """``(output, None)`` or ``(None, why)``: one input's call, run by itself."""
    node = call_node(row, op, slots)
    try:
        (output,), _ = compute_nested([node])
    except ValueError as exc:  # a CallError: "<builder> item <i>: why"; the row is named by lookup
        return None, re.sub(r"^\w+( item \d+)?: ", "", str(exc))
    return (output[0] if node.batched else output), None


def call_node(rows: pd.DataFrame, op: Op, slots: tuple):
    """The daskllm call for these rows: one batched node (a builder call) per operator."""
    if op.kind == "embed":
        return api.embed(batch(rows[KEY].tolist()), model=op.model)
    if op.kind == "search":
        return api.search(op.index, batch(rows[KEY].tolist()), k=op.k)
    if op.kind == "rerank":
        pairs = [json.loads(k) for k in rows[KEY]]
        return api.rerank(batch([q for q, _ in pairs]), batch([d for _, d in pairs]), k=op.k, model=op.model)
    template = full_template(op)
    # The slots' text as the row's key has it (cells.render_cell), not the values' str().
    values = {s: batch([render_cell(v) for v in cells(rows[s])]) for s in slots}
    if not slots:
        values = {}
    p = api.chat([{"role": "user", "content": template}], **values) if op.chat else api.prompt(template, **values)
    s = call_sampling(op)
    return api.generate(p, model=op.model, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                            seed=s.seed, stop=s.stop, ignore_eos=s.ignore_eos, allowed_token_ids=s.allowed_token_ids,
                            **constraint_options(s.structured), logprobs=s.logprobs)


def call_sampling(op: Op) -> SamplingParams:
    """The sampling parameters each generation of ``op`` runs with (part of its result-store key)."""
    allowed = yes_no(op.model) if op.kind == "filter" else digits(op.model) if op.kind == "rate" else ()
    return dataclasses.replace(op.sampling, allowed_token_ids=allowed)



def spread(npartitions: int, op: Op) -> bool:
    """Whether a table of ``npartitions`` partitions has its calls split across engines: fewer
    partitions than workers holding the model (else each partition calls its own worker's
    engines, :func:`compute_nested`), or a search (its index shards live on their workers)."""
    kind = {"embed": "embed", "rerank": "rerank", "search": None}.get(op.kind, "llm")
    return kind is None or npartitions < take_view().holding(op.model, kind)


def plan_keys(plan) -> list:
    return plan.task_keys()


def record(operator: str, *, children=(), tag: str = "", **record) -> None:
    """This task's counts, under its task key (and ``tag``, where one task runs several
    operators): a task that runs again (its worker died, or a result it made was lost and is
    recomputed) replaces its record instead of adding one. On a worker the record also goes to
    the scheduler's event log, so it outlives the worker."""
    task_key = getattr(thread_state, "key", None)
    key = f"dataframe-{operator}-{task_key if task_key is not None else uuid.uuid4().hex[:12]}{tag}"
    host().record(key, TaskUsage(DATAFRAME, operator=operator, children=tuple(children), **record))



def summarize(texts: list[str], model: str, sampling: SamplingParams, instruction: str, chat: bool) -> str:
    if not texts:
        return ""
    # The instruction first: every summary call of the tree shares it as a cached prefix.
    rows = "\n".join(texts)  # a value, not template text: rows may hold braces
    if chat:
        p = api.chat([{"role": "user", "content": literal(instruction) + "{rows}"}],
                         rows=rows)
    else:
        p = api.prompt(literal(instruction) + "{rows}\nSummary:", rows=rows)
    node = api.generate(p, model=model, max_tokens=sampling.max_tokens)
    (summary,), plan = compute_nested([node])
    record("agg", distinct=1, executed=1, failed=0, children=plan_keys(plan),
            requested=plan.report.get("requested", {}), rows=len(texts))
    return summary


def summarize_chunk(rows: pd.DataFrame, model, sampling, instruction, chat) -> str:
    for index, error in zip(rows.index, rows[ROW_ERROR]):
        if isinstance(error, str):
            raise RowError(f"agg: row {index!r}: {error}")
    return summarize([k for k in rows[KEY] if isinstance(k, str)], model, sampling, instruction, chat)


def summarize_parts(parts, model, sampling, instruction, chat) -> str:
    return summarize([p for p in parts if p], model, sampling, instruction, chat)
