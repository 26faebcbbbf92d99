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
   tokens fit in ``WAVE_SHARE`` of its engine's KV cache. A wave first computes the prefixes its
   calls share, each once, in one prefill-only engine step (vLLM's scheduler would have calls
   sent in one step each compute a prefix they share); then it sends every operator's calls at
   once, so they share engine steps and read those prefixes. The next wave may evict those
   prefixes, since nothing later needs them: that is the order that uses the cache before it
   evicts, however much larger than the cache the job is. A gate lets two waves (of one task
   or two) fill an engine's cache together, so one computes prefixes while the other reads its
   own. Calls the result store answers take no
   prefill: they run last, outside the gate. A *conditional* call (an operator after a filter
   of the job, on the rows it keeps) is shuffled with its row's filter call and runs in that
   call's wave once the filter has said yes: the document they share is still in the cache.
4. **back**: the results go back to the row partitions that asked (a shuffle on ``origin``:
   partition i holds origin i), where each operator's rows look their values up.

Several operators are one job where a user adds them one after another to the same rows
(``ddf.llm.map(a).llm.filter(b).llm.map(c)``): see :class:`TableJob`. Whatever the grouping, a
call is the same call (the same prompt and sampling), so it returns the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed.worker import thread_state

from daskllm import config
from daskllm.dataframe.calls import CallCounts, call_sampling, record, run, spread
from daskllm.dataframe.dedupe import local_distinct
from daskllm.dataframe.ops import KEY, STRING, WHEN, Op, full_template, prompt_ids
from daskllm.dataframe.rows import lookup
from daskllm.prompts import Text, parse_template
from daskllm.runtime.view import take_view
from daskllm.worker.execute import run_prefill_many
from daskllm.worker.host import host, in_worker
from daskllm.worker.parts import together
from daskllm.worker.store import are_stored
from daskllm.worker.usage import JOB_BOUND, JOB_HEAD

logger = logging.getLogger(__name__)

ORDER = "_daskllm_order"  # the sort key: model, chat flag, whole prompt text
GROUP = "_daskllm_group"  # the shuffle key: model, chat flag, the prompt's first characters past the templates' head
GROUP_CHARS = 256  # prompts sharing more than this past the head share a partition (~64 tokens)
OP = "_daskllm_op"  # the operator's number in its job
ORIGIN = "_daskllm_origin"  # the row partition that asked
WHEN_GROUP = "_daskllm_when_group"  # a conditional call's shuffle key: its first condition's
GATE_SHARE = 0.8  # of an engine's KV cache the waves running on it may fill together
WAVE_SHARE = GATE_SHARE / 2  # of it one wave's distinct prefix tokens may fill: two waves at once

CALLS_META = pd.DataFrame({ORDER: pd.Series([], dtype=STRING), GROUP: pd.Series([], dtype=STRING),
                           OP: pd.Series([], dtype="int64"), KEY: pd.Series([], dtype=STRING),
                           ORIGIN: pd.Series([], dtype="int64"), WHEN: pd.Series([], dtype=STRING)})
WHEN_META = pd.DataFrame({WHEN: pd.Series([], dtype=STRING), WHEN_GROUP: pd.Series([], dtype=STRING)})
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


def order_head(op: Op) -> str:
    """What a call's sort and group keys start with: its model and chat flag."""
    return f"{op.model}\x1f{int(op.chat)}\x1f"


def group_key(op: Op, key: str, skip: int) -> str:
    """The shuffle key of the call of ``op`` whose rendered template is ``key`` (as
    :func:`job_calls` makes it, for one call)."""
    return order_head(op) + (key + suffix_text(op))[skip:skip + GROUP_CHARS]


def job_calls(distinct: pd.DataFrame, op: Op, slots: tuple, number: int, skip: int,
              partition_info=None) -> pd.DataFrame:
    """A row partition's distinct prompts of operator ``number`` (``slots`` names the columns
    they were filled from: what :mod:`daskllm.dataframe.estimate` reads) as calls to group and
    sort; ``skip``: the characters every prompt of the job starts with."""
    keys = distinct[KEY].astype(STRING)
    head, tail = order_head(op), suffix_text(op)
    text = keys + tail
    if WHEN in distinct.columns:  # conditional: grouped with the filter call it waits for
        when, group = distinct[WHEN].astype(STRING), distinct[WHEN_GROUP].astype(STRING)
    else:
        when = pd.Series(None, index=keys.index, dtype=STRING)
        group = (head + text.str.slice(skip, skip + GROUP_CHARS)).astype(STRING)
    return pd.DataFrame({ORDER: (head + text).astype(STRING), GROUP: group,
                         OP: pd.Series(number, index=keys.index, dtype="int64"), KEY: keys,
                         ORIGIN: pd.Series(partition_info["number"], index=keys.index, dtype="int64"), WHEN: when})


def key_hash(key: str) -> str:
    """A prompt's short name in a conditional call's conditions."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def conditions(*keys: pd.Series, numbers: tuple[int, ...], first: Op, skip: int) -> pd.DataFrame:
    """Per row, the filter calls (of members ``numbers``, whose prompts are ``keys``) an
    operator after them runs on: its call's ``WHEN``, and its shuffle key, that of the first
    filter's call (``first``), so it lands in the partition that runs that call. A row one of
    whose filters has no prompt (a render error) has none: the filter drops it."""
    columns = [k.tolist() for k in keys]
    whens, groups = [], []
    for row in zip(*columns):
        if all(isinstance(k, str) for k in row):
            whens.append(";".join(f"{n}:{key_hash(k)}" for n, k in zip(numbers, row)))
            groups.append(group_key(first, row[0], skip))
        else:
            whens.append(None)
            groups.append(None)
    index = keys[0].index
    return pd.DataFrame({WHEN: pd.Series(whens, index=index, dtype=STRING),
                         WHEN_GROUP: pd.Series(groups, index=index, dtype=STRING)})


def run_calls(calls: pd.DataFrame, ops: tuple[Op, ...], here: tuple[bool, ...]) -> pd.DataFrame:
    """A partition of sorted calls: each distinct one run once, in waves (module docstring);
    a result for every ``(op, KEY, origin)`` that asked (no value for a conditional call whose
    filter said no)."""
    if calls.empty:
        return RESULTS_META.copy()
    started = time.time()
    calls = calls.sort_values(ORDER, kind="stable")
    conditional = calls[WHEN].notna()
    distinct = calls[~conditional].drop_duplicates(subset=[OP, KEY])
    if in_worker():  # tokenizing loads a tokenizer: transformers' lazy imports race with the engines' loading
        host().wait_loaded()
    every = waves(distinct, ops)
    runs = Runs(ops, here)
    runs.waves(every, attach(calls[conditional].drop_duplicates(subset=[OP, KEY, WHEN]), every))
    block = next((w.gate.block for w in every if w.gate is not OPEN), None)
    bound = partition_bound([ids for w in every if not w.stored for ids in w.ids or ()] + runs.fresh_ids, block) \
        if block is not None and all(w.ids is not None for w in every) else {}
    prefills = runs.prefill_keys
    for number, (op, c) in enumerate(zip(ops, runs.counts)):
        if c.distinct:
            counts = dataclasses.asdict(c)
            counts["children"] = counts["children"] + prefills
            record(op.name, started=started, tag=f"-{number}", extra=bound, **counts)
            bound, prefills = {}, []  # one record of the partition carries them
    values = pd.concat(runs.results, ignore_index=True) if runs.results else RESULTS_META[[KEY, "value", "error", OP]]
    asked = calls[[OP, KEY, ORIGIN]].drop_duplicates().reset_index(drop=True)
    out = asked.merge(values.drop_duplicates(subset=[OP, KEY]), on=[OP, KEY], how="left")[list(RESULTS_META.columns)]
    # A conditional call its filter said no to has no value: None, as a failed call's (not the merge's NaN).
    out["value"] = out["value"].astype(object).where(out["value"].notna(), None)
    return out


class Runs:
    """A partition's calls as they run: their results and counts per operator, and what each
    filter said of each prompt (the conditions of the calls after it)."""

    def __init__(self, ops: tuple[Op, ...], here: tuple[bool, ...]):
        self.ops, self.here = ops, here
        self.counts = [CallCounts() for _ in ops]
        self.results: list[pd.DataFrame] = []
        self.said: dict[str, bool] = {}  # "number:hash" -> the filter said yes
        self.done: set[tuple[int, str]] = set()  # conditional calls run
        self.fresh_ids: list = []  # prompts of conditional calls the result store did not answer
        self.prefill_keys: list[str] = []  # the usage records of the waves' shared prefixes
        # The task running them, read here, on its thread: a stage runs on a shared thread,
        # which has no task key of its own (and records under one name would replace each other).
        self.task_key = getattr(thread_state, "key", None) or f"table-job-{uuid.uuid4().hex[:12]}"

    def run(self, calls: pd.DataFrame, ids: list | None = None) -> None:
        """Run ``calls``: one run per operator, all at once (their requests join the same engine steps)."""
        if calls.empty:
            return
        numbers = calls[OP].tolist()
        mine = {n: [i for i, m in enumerate(numbers) if m == n] for n in sorted(set(numbers))}
        done = together([functools.partial(run, calls.iloc[rows][[KEY]], keyed(self.ops[n]), (KEY,), self.here[n],
                                           None if ids is None else [ids[i] for i in rows])
                         for n, rows in mine.items()])
        for n, (frame, c) in zip(mine, done):
            self.counts[n].add(c)
            self.results.append(frame.assign(**{OP: n}))
            if self.ops[n].kind == "filter":
                self.said.update((f"{n}:{key_hash(k)}", v is True) for k, v in zip(frame[KEY], frame["value"]))

    def waves(self, every: list[Wave], afters: list[pd.DataFrame]) -> None:
        """The waves in order, two at once where the engine's gate has room for both (and no
        other task waits for it). A wave's stages run one after another: its shared prefixes,
        its calls, then the calls after its filters once they have said yes (:meth:`stages`).
        A wave joins a stage after the other, and each round sends the next stage of both to
        the engine together (one wave's calls beside the other's prefixes, or its calls after a
        filter beside the other's filter calls), so they share engine steps and no step waits
        on one wave alone. A wave's tokens leave the gate once its last stage is done."""
        pending = list(zip(every, afters))[::-1]
        active: list[tuple[Iterator, TokenGate, int]] = []
        try:
            while pending or active:
                # One wave joins per round, so two waves are a stage apart. A task holding a wave
                # never waits for a second (two such tasks would wait on each other).
                if pending and len(active) < 2:
                    wave, after = pending[-1]
                    tokens = wave.gate.try_take(wave.tokens) if active else wave.gate.take(wave.tokens)
                    if tokens is not None:
                        pending.pop()
                        active.append((self.stages(wave, after), wave.gate, tokens))
                prefixes: dict[str, list] = {}
                frames, ids = [], []
                for entry in list(active):
                    stage = next(entry[0], None)
                    if stage is None:  # its last stage is done
                        active.remove(entry)
                        entry[1].give(entry[2])
                        continue
                    if isinstance(stage, Prefixes):
                        prefixes.setdefault(stage.model, []).extend(stage.prefixes)
                    else:
                        frames.append(stage[0])
                        ids.append(stage[1])
                steps = [functools.partial(self.prefill, model, p) for model, p in prefixes.items()]
                if frames:
                    steps.append(functools.partial(self.run, pd.concat(frames) if len(frames) > 1 else frames[0],
                                                   None if any(i is None for i in ids) else [t for i in ids for t in i]))
                together(steps)
        finally:
            for _, gate, tokens in active:
                gate.give(tokens)

    def stages(self, wave: Wave, after: pd.DataFrame) -> Iterator[Prefixes | tuple[pd.DataFrame, list | None]]:
        """A wave's stages, each once the one before it is done: its shared prefixes to
        compute, then its calls (with their token ids), then the calls ``after`` its filters
        that they said yes to."""
        prefixes = wave.prefixes() if all(self.here) else []
        if prefixes:
            yield Prefixes(self.ops[int(wave.calls[OP].iat[0])].model, prefixes)
        for phase in wave.phases():
            yield wave.calls.iloc[phase], wave.ids_of(phase)
        while not after.empty:
            ready, ids, after = self.decided(after)
            if ready.empty:
                return
            yield ready, ids

    def prefill(self, model: str, prefixes: list[tuple[int, ...]]) -> None:
        """Compute ``prefixes`` in the engine's cache at once (each wave's usage its own record).
        A prefill that fails costs only time: the calls compute their prefixes themselves."""
        self.prefill_keys.append(f"{self.task_key}-prefix-{len(self.prefill_keys)}")
        try:
            run_prefill_many(self.task_key, model, prefixes, record_key=self.prefill_keys[-1])
        except Exception:  # noqa: BLE001 - an optimization; the calls that follow report real failures
            logger.warning("table job: prefilling %d shared prefixes failed; the calls compute them", len(prefixes),
                           exc_info=True)

    def decided(self, after: pd.DataFrame) -> tuple[pd.DataFrame, list | None, pd.DataFrame]:
        """Of the conditional calls ``after``, those every filter of has said yes to (each once)
        with their prompts' token ids where the engine is here (so they are not tokenized again;
        those the result store does not answer go to the bound), and those still waiting for a
        filter; the rest (a filter said no) are dropped."""
        conditions = [w.split(";") for w in after[WHEN]]
        known = [all(c in self.said for c in cs) for cs in conditions]
        passed = [k and all(self.said[c] for c in cs) for k, cs in zip(known, conditions)]
        ready = after[np.array(passed, dtype=bool)]
        fresh = np.array([(n, k) not in self.done for n, k in zip(ready[OP], ready[KEY])], dtype=bool)
        ready = ready[fresh].drop_duplicates(subset=[OP, KEY])
        self.done.update(zip(ready[OP], ready[KEY]))
        ids = None
        if in_worker() and not ready.empty and gate(self.ops[int(ready[OP].iat[0])].model) is not OPEN:
            ids = [None] * len(ready)
            numbers = ready[OP].tolist()
            for n in sorted(set(numbers)):
                where = [i for i, m in enumerate(numbers) if m == n]
                mine = prompt_ids(ready.iloc[where][[KEY]], keyed(self.ops[n]))
                stored = are_stored(self.ops[n].model, mine, call_sampling(self.ops[n]))
                self.fresh_ids += [i for i, s in zip(mine, stored) if not s]
                for i, tokens in zip(where, mine):
                    ids[i] = tokens
        return ready, ids, after[~np.array(known, dtype=bool)]


@dataclass(frozen=True)
class Prefixes:
    """A wave's stage that computes the prefixes its calls share (token ids) on ``model``'s engine."""

    model: str
    prefixes: list


def attach(conditional: pd.DataFrame, every: list[Wave]) -> list[pd.DataFrame]:
    """Per wave, the conditional calls whose first filter call it runs (so a call after a filter
    runs while the prompt it shares with that filter's is in the cache); the last wave takes
    those whose filter call none runs."""
    where = {}
    for i, wave in enumerate(every):
        where.update((f"{n}:{key_hash(k)}", i) for n, k in zip(wave.calls[OP], wave.calls[KEY]))
    at = [where.get(w.split(";", 1)[0], len(every) - 1) for w in conditional[WHEN]]
    at = np.array(at, dtype=int)
    return [conditional[at == i] for i in range(len(every))]


@dataclass(frozen=True)
class Wave:
    """A run of sorted distinct calls, and what it takes of its engine's cache.

    ``shared[i]``: the tokens call ``i`` shares with the call before it (None where its
    engine is not resident here, so its prompts were not tokenized)."""

    calls: pd.DataFrame
    ids: list | None
    shared: list[int] | None
    gate: TokenGate
    tokens: int
    stored: bool = False  # calls the result store answers (no prefill)

    def ids_of(self, rows: list[int]) -> list | None:
        return None if self.ids is None else [self.ids[i] for i in rows]

    def phases(self) -> list[list[int]]:
        """The calls to send together, step after step: all of them (their shared prefixes are
        computed first, :meth:`prefixes`); where the prompts are unknown, one step per
        operator, in order."""
        if self.shared is None and not self.stored:
            numbers = self.calls[OP].tolist()
            return [[i for i, n in enumerate(numbers) if n == number] for number in sorted(set(numbers))]
        return [list(range(len(self.calls)))]

    def prefixes(self) -> list[tuple[int, ...]]:
        """The prefixes to compute before the wave's calls, once each: the full KV blocks a
        call shares with the one before it (at least ``prefix-min-tokens``), the deepest only
        (computing one computes those it starts with). Sent in one engine step with the calls,
        vLLM would compute a shared prefix once per call: it does not wait for a prefix
        another request of the step is computing."""
        if self.stored or self.shared is None:
            return []
        least, block = int(config.get("rewrite.prefix-min-tokens")), max(1, self.gate.block)
        found = sorted({tuple(self.ids[i][:n // block * block]) for i, n in enumerate(self.shared)
                        if n // block * block >= max(least, 1)})
        # Sorted, a prefix another one starts with comes right before it (or before those between).
        return [p for p, q in zip(found, found[1:] + [()]) if q[:len(p)] != p]


def waves(distinct: pd.DataFrame, ops: tuple[Op, ...]) -> list[Wave]:
    """Sorted calls cut into runs whose distinct prefix tokens (each prompt's tokens past its
    common prefix with the one before it: the nodes of their prefix tree) fit in ``WAVE_SHARE``
    of the engine's KV cache, each with its prompts' token ids (so they are not tokenized
    again), the gate its tokens pass and their count; one run where the engine is not
    resident here (its calls tokenize their prompts themselves)."""
    gates = {op.model: gate(op.model) for op in ops}
    if len(set(gates.values())) != 1 or next(iter(gates.values())) is OPEN:  # several models, or none here
        return [Wave(distinct, None, None, OPEN, 0)]
    the_gate = next(iter(gates.values()))
    ids: list = [None] * len(distinct)
    stored = [False] * len(distinct)
    numbers = distinct[OP].tolist()
    for number in set(numbers):
        where = [i for i, n in enumerate(numbers) if n == number]
        mine = prompt_ids(distinct.iloc[where][[KEY]], keyed(ops[number]))
        answered = are_stored(ops[number].model, mine, call_sampling(ops[number]))
        for i, tokens, known in zip(where, mine, answered):
            ids[i], stored[i] = tokens, known
    # Calls the result store answers take no prefill: they run last, together, outside the gate.
    fresh = [i for i in range(len(ids)) if not stored[i]]
    kept = [i for i in range(len(ids)) if stored[i]]
    tail = [Wave(distinct.iloc[kept], [ids[i] for i in kept], None, OPEN, 0, stored=True)] if kept else []
    calls, ids = distinct.iloc[fresh], [ids[i] for i in fresh]
    shared = [0] * len(ids)
    out, start, filled, previous = [], 0, 0, ()
    for i, tokens in enumerate(ids):
        shared[i] = len(os.path.commonprefix([previous, tokens]))
        new = len(tokens) - shared[i]
        if i > start and filled + new > the_gate.limit * WAVE_SHARE / GATE_SHARE:
            out.append(Wave(calls.iloc[start:i], ids[start:i], [0] + shared[start + 1:i], the_gate, filled))
            start, filled = i, len(tokens)
        else:
            filled += new
        previous = tokens
    if ids:
        out.append(Wave(calls.iloc[start:], ids[start:], [0] + shared[start + 1:], the_gate, filled))
    return out + tail


def partition_bound(prompts: list, block: int) -> dict:
    """What a partition's record says of the distinct-prefix bound of the prompts it computed:
    the bound past the full blocks all of them share, and those blocks, named (``JOB_HEAD``):
    every partition of a job shares them (a chat template's preamble, the templates' first
    words), and usage counts them once."""
    if not prompts:
        return {JOB_BOUND: 0}
    head = len(os.path.commonprefix(prompts)) // block
    # The last token of a prompt is always computed: a head block is one all prompts extend.
    head = min([head] + [(len(p) - 1) // block for p in prompts])
    named = [hash(tuple(prompts[0][:(i + 1) * block])) for i in range(head)]  # ints and tuples hash alike everywhere
    return {JOB_BOUND: prefix_bound(prompts, block) - head * block, JOB_HEAD: [[h, block] for h in named]}


def prefix_bound(prompts: list, block: int) -> int:
    """The least prefill a paged prefix cache of ``block``-token blocks can do for ``prompts``
    (token ids): their distinct full blocks (the nodes of their prefix tree), plus each distinct
    prompt's partial last block (no other prompt can read it)."""
    total, previous = 0, ()
    for tokens in sorted(set(map(tuple, prompts))):
        shared = len(os.path.commonprefix([previous, tokens])) // block
        total += (len(tokens) // block - min(shared, len(tokens) // block)) * block + len(tokens) % block
        previous = tokens
    return total


class TokenGate:
    """The distinct prompt tokens of the waves running on one engine at a time, at most
    ``limit``: tasks on one worker share its engine's cache, so a wave waits while the others'
    would leave it no room (it would evict their prefixes before they are read)."""

    def __init__(self, limit: int, block: int = 1):
        self.limit = limit
        self.block = block  # its engine's KV block size
        self._used = 0
        self._waiting = 0  # tasks waiting for room
        self._changed = threading.Condition()

    def take(self, tokens: int) -> int:
        """Wait until ``tokens`` fit, and take them (a wave larger than the limit runs alone):
        what to :meth:`give` back."""
        tokens = min(tokens, self.limit)
        with self._changed:
            self._waiting += 1
            self._changed.notify_all()  # try_take now defers to it
            try:
                self._changed.wait_for(lambda: self._used + tokens <= self.limit)
            finally:
                self._waiting -= 1
            self._used += tokens
        return tokens

    def try_take(self, tokens: int) -> int | None:
        """:meth:`take` if ``tokens`` fit now and no one waits for room (else None): a task
        already holding a wave never waits for a second (two such tasks would wait on each other)."""
        tokens = min(tokens, self.limit)
        with self._changed:
            if self._waiting or self._used + tokens > self.limit:
                return None
            self._used += tokens
        return tokens

    def give(self, tokens: int) -> None:
        with self._changed:
            self._used -= tokens
            self._changed.notify_all()


OPEN = TokenGate(0)  # no engine here to fill: nothing waits (every hold is of 0 tokens)
_gates: dict[tuple[str, int], TokenGate] = {}
_gates_lock = threading.Lock()


def gate(model: str) -> TokenGate:
    """This worker's gate for ``model``'s engine (``GATE_SHARE`` of its KV cache), or
    :data:`OPEN` where it has no such engine."""
    if not in_worker():
        return OPEN
    engine = host().resident(model, "llm")
    if engine is None:
        return OPEN
    state = engine.cache_state()
    limit = int(state.num_blocks * state.block_size * GATE_SHARE)
    with _gates_lock:
        return _gates.setdefault((engine.name, limit), TokenGate(limit, state.block_size))


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
    when: tuple[int, ...] = ()  # the filter members before it: it runs on the rows they keep


@dataclass(frozen=True)
class TableJob:
    """The operators added one after another to the same rows (``base``): one plan computes all
    their calls. A frame an operator returns carries its job, so the next operator on it joins
    the job where it reads only ``base``'s columns (not another member's output); after a
    filter it joins as a conditional member, called only for the rows the filter keeps."""

    base: dd.DataFrame
    members: tuple[Member, ...]

    def joins(self, slots: tuple) -> bool:
        made = {c for m in self.members for c in m.made}
        return all(s in self.base.columns and s not in made for s in slots)

    def joined(self, member: Member) -> TableJob:
        """The job with ``member`` added: on the rows its filters keep."""
        filters = tuple(i for i, m in enumerate(self.members) if m.mask is not None)
        return TableJob(self.base, self.members + (dataclasses.replace(member, when=filters),))

    def frame(self) -> dd.DataFrame:
        """``base`` with every member's columns, and the rows every filter member kept."""
        results = job_results(self.base, self.members)
        out = self.base
        assigned = {}
        for member, result in zip(self.members, results):
            if member.columns is not None:
                assigned.update(member.columns(result))
        # With the table's divisions known, dask aligns the results by them for free, and a
        # column no later step reads is dropped before it is generated. Unknown (a parquet
        # dataset's), dask would shuffle the whole table on its index to align each column:
        # the results are assigned partition by partition instead, and every column is made.
        aligned = self.base.known_divisions
        if assigned and aligned:
            out = out.assign(**assigned)
        elif assigned:
            meta = out._meta.assign(**{name: column._meta for name, column in assigned.items()})
            out = zipped(_assign, out, *assigned.values(), names=tuple(assigned), meta=meta)
        for member, result in zip(self.members, results):
            if member.mask is not None:
                mask = member.mask(result)
                out = out[mask] if aligned else zipped(_keep, out, mask, meta=out._meta)
        return out


def job_results(base: dd.DataFrame, members: tuple[Member, ...]) -> list[dd.DataFrame]:
    """Per member, its value and error for every row of ``base`` (aligned with it; none for a
    row a filter before it dropped)."""
    ops = tuple(m.op for m in members)
    skip = len(os.path.commonprefix([head_text(m.op.template) for m in members]))
    rendered = [m.render(base) for m in members]
    calls = []
    for number, (m, r) in enumerate(zip(members, rendered)):
        frame = zipped(_assign, base[list(m.slots)], r[KEY], names=(KEY,), meta=_distinct_meta(base, m.slots)) \
            if m.slots else r[[KEY]]
        if m.when:
            when = dd.map_partitions(conditions, *[rendered[i][KEY] for i in m.when], numbers=m.when,
                                     first=ops[m.when[0]], skip=skip, meta=WHEN_META, align_dataframes=False)
            frame = zipped(_assign, frame, when[WHEN], when[WHEN_GROUP], names=(WHEN, WHEN_GROUP),
                           meta=frame._meta.assign(**{WHEN: WHEN_META[WHEN], WHEN_GROUP: WHEN_META[WHEN_GROUP]}))
        calls.append(frame.map_partitions(local_distinct, meta=frame._meta)
                     .map_partitions(job_calls, m.op, m.slots, number, skip, meta=CALLS_META, partition_info=True))
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


def zipped(fn: Callable, *frames, meta, **kwargs) -> dd.DataFrame:
    """``fn`` over the frames' partitions, the i-th of each together: they hold the same rows
    (each is derived from the job's table partition by partition), so they are never aligned.
    With the table's divisions unknown (a parquet dataset's), dask would otherwise shuffle them
    on their index to align them: the whole table, once per column assigned."""
    return dd.map_partitions(fn, *frames, meta=meta, align_dataframes=False, **kwargs)


def _assign(frame: pd.DataFrame, *columns: pd.Series, names: tuple) -> pd.DataFrame:
    """``columns`` assigned by position: each holds a value per row of ``frame``, in its order
    (by index, a table whose index repeats a label could not take them)."""
    for name, column in zip(names, columns):
        if len(column) != len(frame):
            raise ValueError(f"column {name!r}: {len(column)} values for {len(frame)} rows")
    return frame.assign(**{name: column.array for name, column in zip(names, columns)})


def _keep(frame: pd.DataFrame, mask: pd.Series) -> pd.DataFrame:
    return frame[mask.to_numpy(dtype=bool)]


def _distinct_meta(base: dd.DataFrame, slots: tuple) -> pd.DataFrame:
    return base._meta[list(slots)].assign(**{KEY: pd.Series([], dtype=STRING)})


def _engines(op: Op) -> int:
    return take_view().holding(op.model, "llm")
