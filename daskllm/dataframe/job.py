"""One plan for all of a table job's LLM calls: every distinct prompt of the job's operators,
grouped by shared prefix across rows, partitions and operators, so each prefix is computed once.

1. **calls**: each operator's rows render their prompts; each row partition's distinct prompts
   become calls ``(order, op, KEY, origin)``. ``order`` is the model, the chat flag and the
   whole prompt text (the template's text and the operator's instruction); ``origin`` is the
   row partition that asked.
2. **group**: a shuffle on each call's *group*: the model, the chat flag and ``GROUP_CHARS``
   characters of its prompt after the text every operator's template starts with. Prompts that
   share more than that (the same document under several questions, rows that share a module's
   documentation) land in one partition, whichever rows, partitions and operators they came
   from; identical prompts too. No process holds every prompt, and no pass over the data comes
   first (as a sort's quantiles would).
3. **run**: each partition of calls is one task. It sorts them by ``order``: the
   lexicographic order of prompts is the depth-first walk of their prefix tree, so prompts that
   share a prefix are next to each other. It calls each distinct prompt once,
   whatever partitions asked for it, in *waves*: runs of sorted calls whose distinct prefix
   tokens fit in half its engine's KV cache. A wave's calls run operator after operator on one
   engine, so the first operator computes a prefix and the others find it cached; the next wave
   may evict it, since nothing later needs it. That is the order that uses the cache before it
   evicts, however much larger than the cache the job is.
4. **back**: the results go back to the row partitions that asked (a shuffle on ``origin``:
   partition i holds origin i), where each operator's rows look their values up.

Several operators are one job where a user adds them one after another to the same rows
(``ddf.llm.map(a).llm.map(b).llm.filter(c)``): see :class:`TableJob`. Whatever the grouping, a
call is the same call (the same prompt and sampling), so it returns the same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import dask.dataframe as dd
import pandas as pd

from daskllm.dataframe.calls import CallCounts, record, run, spread
from daskllm.dataframe.dedupe import local_distinct
from daskllm.dataframe.ops import KEY, STRING, Op, full_template, prompt_ids
from daskllm.dataframe.rows import lookup
from daskllm.prompts import Text, parse_template
from daskllm.runtime.view import take_view
from daskllm.worker.host import host, in_worker

ORDER = "_daskllm_order"  # the sort key: model, chat flag, whole prompt text
GROUP = "_daskllm_group"  # the shuffle key: model, chat flag, the prompt's first characters past the templates' head
GROUP_CHARS = 256  # prompts sharing more than this past the head share a partition (~64 tokens)
OP = "_daskllm_op"  # the operator's number in its job
ORIGIN = "_daskllm_origin"  # the row partition that asked
WAVE_SHARE = 0.5  # of an engine's KV cache a wave's distinct prefix tokens may fill

CALLS_META = pd.DataFrame({ORDER: pd.Series([], dtype=STRING), GROUP: pd.Series([], dtype=STRING),
                           OP: pd.Series([], dtype="int64"),
                           KEY: pd.Series([], dtype=STRING), ORIGIN: pd.Series([], dtype="int64")})
RESULTS_META = pd.DataFrame({OP: pd.Series([], dtype="int64"), KEY: pd.Series([], dtype=STRING),
                             ORIGIN: pd.Series([], dtype="int64"), "value": pd.Series([], dtype=object),
                             "error": pd.Series([], dtype=STRING)})


def keyed(op: Op) -> Op:
    """``op`` with its prompt read whole from a row's ``KEY`` (the rendered template): the same
    prompt text, so the same call."""
    return dataclasses.replace(op, template="{%s}" % KEY)


def suffix_text(op: Op) -> str:
    """The text the operator adds after the user's template (its instruction)."""
    return "".join(seg.text for seg in parse_template(full_template(keyed(op))) if isinstance(seg, Text))


def head_text(template: str) -> str:
    """The text a template starts with, before its first field."""
    head = []
    for seg in parse_template(template):
        if not isinstance(seg, Text):
            break
        head.append(seg.text)
    return "".join(head)


def job_calls(distinct: pd.DataFrame, op: Op, slots: tuple, number: int, skip: int,
              partition_info=None) -> pd.DataFrame:
    """A row partition's distinct prompts of operator ``number`` (``slots`` names the columns
    they were filled from: what :mod:`daskllm.dataframe.estimate` reads) as calls to group and
    sort; ``skip``: the characters every prompt of the job starts with."""
    keys = distinct[KEY].astype(STRING)
    head, tail = f"{op.model}\x1f{int(op.chat)}\x1f", suffix_text(op)
    text = keys + tail
    return pd.DataFrame({ORDER: (head + text).astype(STRING),
                         GROUP: (head + text.str.slice(skip, skip + GROUP_CHARS)).astype(STRING),
                         OP: pd.Series(number, index=keys.index, dtype="int64"), KEY: keys,
                         ORIGIN: pd.Series(partition_info["number"], index=keys.index, dtype="int64")})


def run_calls(calls: pd.DataFrame, ops: tuple[Op, ...], here: tuple[bool, ...]) -> pd.DataFrame:
    """A partition of sorted calls: each distinct one run once, in waves (module docstring);
    a result for every ``(op, KEY, origin)`` that asked."""
    if calls.empty:
        return RESULTS_META.copy()
    started = time.time()
    calls = calls.sort_values(ORDER, kind="stable")
    distinct = calls.drop_duplicates(subset=[OP, KEY])
    if in_worker():  # tokenizing loads a tokenizer: transformers' lazy imports race with the engines' loading
        host().wait_loaded()
    counts = [CallCounts() for _ in ops]
    results = []
    for wave, ids, gate, tokens in waves(distinct, ops):
        numbers = wave[OP].tolist()
        with gate.hold(tokens):
            for number in sorted(set(numbers)):
                mine = [i for i, n in enumerate(numbers) if n == number]
                frame, done = run(wave.iloc[mine][[KEY]], keyed(ops[number]), (KEY,), here[number],
                                  None if ids is None else [ids[i] for i in mine])
                counts[number].add(done)
                results.append(frame.assign(**{OP: number}))
    for number, (op, c) in enumerate(zip(ops, counts)):
        if c.distinct:
            record(op.name, started=started, tag=f"-{number}", **dataclasses.asdict(c))
    values = pd.concat(results, ignore_index=True)
    asked = calls[[OP, KEY, ORIGIN]].reset_index(drop=True)
    return asked.merge(values, on=[OP, KEY], how="left")[list(RESULTS_META.columns)]


def waves(distinct: pd.DataFrame, ops: tuple[Op, ...]) -> list[tuple[pd.DataFrame, list | None, TokenGate, int]]:
    """Sorted calls cut into runs whose distinct prefix tokens (each prompt's tokens past its
    common prefix with the one before it: the nodes of their prefix tree) fit in ``WAVE_SHARE``
    of the engine's KV cache, each with its prompts' token ids (so they are not tokenized
    again), the gate its tokens pass and their count; one run where the engine is not
    resident here (its calls tokenize their prompts themselves)."""
    gates = {op.model: gate(op.model) for op in ops}
    if len(set(gates.values())) != 1 or next(iter(gates.values())) is OPEN:  # several models, or none here
        return [(distinct, None, OPEN, 0)]
    the_gate = next(iter(gates.values()))
    ids: list = [None] * len(distinct)
    numbers = distinct[OP].tolist()
    for number in set(numbers):
        where = [i for i, n in enumerate(numbers) if n == number]
        for i, tokens in zip(where, prompt_ids(distinct.iloc[where][[KEY]], keyed(ops[number]))):
            ids[i] = tokens
    out, start, filled, previous = [], 0, 0, ()
    for i, tokens in enumerate(ids):
        new = len(tokens) - len(os.path.commonprefix([previous, tokens]))
        if i > start and filled + new > the_gate.limit:
            out.append((distinct.iloc[start:i], ids[start:i], the_gate, filled))
            start, filled = i, len(tokens)
        else:
            filled += new
        previous = tokens
    out.append((distinct.iloc[start:], ids[start:], the_gate, filled))
    return out


class TokenGate:
    """The distinct prompt tokens of the waves running on one engine at a time, at most
    ``limit``: tasks on one worker share its engine's cache, so a wave waits while the others'
    would leave it no room (it would evict their prefixes before they are read)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, tokens: int):
        tokens = min(tokens, self.limit)  # a wave larger than the limit runs alone
        with self._changed:
            self._changed.wait_for(lambda: self._used + tokens <= self.limit)
            self._used += tokens
        try:
            yield
        finally:
            with self._changed:
                self._used -= tokens
                self._changed.notify_all()


OPEN = TokenGate(0)  # no engine here to fill: nothing waits (every hold is of 0 tokens)
_gates: dict[tuple[str, int], TokenGate] = {}
_gates_lock = threading.Lock()


def gate(model: str) -> TokenGate:
    """This worker's gate for ``model``'s engine (``WAVE_SHARE`` of its KV cache), or
    :data:`OPEN` where it has no such engine."""
    if not in_worker():
        return OPEN
    engine = host().resident(model, "llm")
    if engine is None:
        return OPEN
    state = engine.cache_state()
    limit = int(state.num_blocks * state.block_size * WAVE_SHARE)
    with _gates_lock:
        return _gates.setdefault((engine.name, limit), TokenGate(limit))


def lookup_op(rows: pd.DataFrame, results: pd.DataFrame, number: int, op_name: str, on_error: str,
              dtype=None) -> pd.DataFrame:
    """Operator ``number``'s value and error for each row of a row partition, from the results
    sent back to it."""
    mine = results[results[OP] == number]
    return lookup(rows, mine[[KEY, "value", "error"]], None, op_name, on_error, dtype)


@dataclass(frozen=True)
class Member:
    """One operator of a job: its call, how its rows are rendered, and what it makes of its
    results (the columns it assigns, or a filter's mask)."""

    op: Op
    slots: tuple
    render: Callable[[dd.DataFrame], dd.DataFrame]  # the rows -> each row's KEY and ROW_ERROR
    on_error: str
    dtype: object
    columns: Callable[[dd.DataFrame], dict] | None = None  # its results -> the columns it assigns
    mask: Callable[[dd.DataFrame], dd.Series] | None = None  # a filter: its results -> the rows kept
    made: tuple[str, ...] = ()  # the names of the columns it assigns


@dataclass(frozen=True)
class TableJob:
    """The operators added one after another to the same rows (``base``): one plan computes all
    their calls. A frame an operator returns carries its job, so the next operator on it joins
    the job where it reads only ``base``'s columns (not another member's output)."""

    base: dd.DataFrame
    members: tuple[Member, ...]

    def joins(self, slots: tuple) -> bool:
        made = {c for m in self.members for c in m.made}
        return all(s in self.base.columns and s not in made for s in slots)

    def frame(self) -> dd.DataFrame:
        """``base`` with every member's columns, and the rows every filter member kept."""
        results = job_results(self.base, self.members)
        out = self.base
        assigned = {}
        for member, result in zip(self.members, results):
            if member.columns is not None:
                assigned.update(member.columns(result))
        if assigned:
            out = out.assign(**assigned)
        for member, result in zip(self.members, results):
            if member.mask is not None:
                out = out[member.mask(result)]
        return out


def job_results(base: dd.DataFrame, members: tuple[Member, ...]) -> list[dd.DataFrame]:
    """Per member, its value and error for every row of ``base`` (aligned with it)."""
    ops = tuple(m.op for m in members)
    skip = len(os.path.commonprefix([head_text(m.op.template) for m in members]))
    rendered = [m.render(base) for m in members]
    calls = [(base[list(m.slots)].assign(**{KEY: r[KEY]}) if m.slots else r[[KEY]])
             .map_partitions(local_distinct, meta=_distinct_meta(base, m.slots))
             .map_partitions(job_calls, m.op, m.slots, number, skip, meta=CALLS_META, partition_info=True)
             for number, (m, r) in enumerate(zip(members, rendered))]
    npartitions = base.npartitions
    every = dd.concat(calls) if len(calls) > 1 else calls[0]
    parts = max(npartitions, max(_engines(op) for op in ops))
    # Task-based shuffles: P2P's per-shuffle bookkeeping (and its log lines) costs more than it
    # saves on columns of prompt strings.
    grouped = every.shuffle(on=GROUP, npartitions=parts, shuffle_method="tasks")
    here = tuple(not spread(parts, op) for op in ops)
    results = grouped.map_partitions(run_calls, ops, here, meta=RESULTS_META)
    divisions = list(range(npartitions)) + [npartitions - 1]
    back = results.set_index(ORIGIN, divisions=divisions, shuffle_method="tasks")
    meta = [pd.DataFrame({"value": pd.Series([], dtype=object if m.dtype is None else m.dtype),
                          "error": pd.Series([], dtype=STRING)}) for m in members]
    return [r.map_partitions(lookup_op, back, number, m.op.name, m.on_error, m.dtype, meta=meta[number],
                             align_dataframes=False)
            for number, (m, r) in enumerate(zip(members, rendered))]


def _distinct_meta(base: dd.DataFrame, slots: tuple) -> pd.DataFrame:
    return base._meta[list(slots)].assign(**{KEY: pd.Series([], dtype=STRING)})


def _engines(op: Op) -> int:
    return take_view().holding(op.model, "llm")
