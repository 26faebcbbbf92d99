"""Computing daskllm nodes from inside a task: on this worker's own engines where it can.

A task that already sits where its work belongs (a table partition Dask placed, a server's
micro-batch sent to one worker) gains nothing from planning its calls as new tasks for the
scheduler to place: each stage's calls would wait for a scheduler round trip before reaching
the engine. Where this worker serves every engine the nodes need, their plan runs in the
task's own thread (``dask.local.get_sync``): each stage's calls go to the engine the moment
the previous stage's values exist. The same tasks run either way: the same tokens and usage.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dask.threaded

from dask.local import get_sync
from distributed import worker_client
from distributed.worker import thread_state

from daskllm.annotations import DECODE_TASK, TaskAnnotation
from daskllm.ops import engine_of
from daskllm.plan.context import LOCAL
from daskllm.plan.ir import Node
from daskllm.plan.lower import Lowered
from daskllm.runtime import submit
from daskllm.worker.execute import in_place
from daskllm.worker.host import WORK_OF, host, in_worker, priority_of

_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """This process's threads for the calls of parts computed here (they wait on engines)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(64, thread_name_prefix="daskllm-here"))
        return _POOL[0]


class _InWorker:
    """The shared threads, running each call in a copy of the submitting worker task's context:
    ``get_worker()`` reads a context variable, and through it a call finds the worker's
    resident engines and usage log."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self._max_workers = pool._max_workers  # what dask.threaded.get reads
        self.context = contextvars.copy_context()
        self.task_key = getattr(thread_state, "key", None)

    def submit(self, fn, *args, **kwargs):
        return self.pool.submit(self.context.copy().run, _in_task, self.task_key, fn, *args, **kwargs)


def _in_task(task_key, fn, *args, **kwargs):
    """``fn`` on a shared thread (in its own context copy) as work of the worker task
    ``task_key``: the engine requests it waits on are registered under that task
    (``host().abortable``), so cancelling the task aborts them."""
    WORK_OF.set(task_key)
    return fn(*args, **kwargs)


# What a task can compute in its own thread: no index shard, stream or other task's value to wait for.
HERE_OPS = frozenset({"const", "gather", "generate", "prefill", "embed", "rerank"})


def compute_nested(nodes: list[Node], here: bool = True) -> tuple[list, Lowered]:
    """Compute daskllm nodes from inside a task: ``(values, plan)``.

    ``here``: where this worker serves every engine the nodes need, their plan runs in this
    task's thread against them, keeping the task's thread slot (so Dask balances such tasks
    like any other). Otherwise (or without ``here``) the plan is submitted from the task,
    placed by the scheduler plugin; cancelling the task cancels that work too."""
    if in_worker() and not (here and all(served_here(n) for n in nodes)):
        with worker_client(separate_thread=True) as client:
            submission = submit.plan_and_submit(list(nodes), client)
            return _gathered(client, submission.futures), submission.lowered
    # No stage split: shards would run one after another in this thread; the engine batches each call whole.
    lowered = _local_plan(nodes, drop=("stage",))
    with in_place():
        return list(get_sync(lowered.graph, [lowered.outputs[n.key] for n in nodes])), lowered


def served_here(node: Node) -> bool:
    """Whether this worker can compute ``node`` in a task's thread: only ops of
    :data:`HERE_OPS`, each engine resident here."""
    plugin = host()
    plugin.wait_loaded()
    needed = engines_needed([node])
    return needed is not None and all(plugin.resident(model, kind) is not None for kind, model in needed)


def engines_needed(nodes: list[Node]) -> set[tuple[str, str]] | None:
    """The ``(kind, model)`` engines computing ``nodes`` takes; None where it takes more than
    engines (an op outside :data:`HERE_OPS`: an index shard, a stream)."""
    needed: set = set()
    todo, seen = list(nodes), set()
    while todo:
        n = todo.pop()
        if n.key in seen:
            continue
        seen.add(n.key)
        if n.op not in HERE_OPS:
            return None
        if (engine := engine_of(n)) is not None:
            needed.add(engine)
        todo.extend(n.inputs.values())
    return needed


@dataclass(frozen=True)
class PlannedHere:
    """A plan made on the client to run in one task's thread on a worker: its graph, the keys
    of its nodes' values, and the engines it needs. A plain object to Dask, which therefore
    ships it as an argument rather than reading its graph as tasks of its own."""

    graph: object
    keys: list
    engines: frozenset  # (kind, model)
    tokens: int = 0  # the work it brings an engine: its calls' prompt and output token estimates

    def annotation(self) -> dict:
        """Its ``daskllm`` task annotation: the placement plugin then places it like any engine
        task, among the workers it is restricted to, and counts its tokens in that worker's
        queue (so a streamed request placed later sees them)."""
        kind, model = min(self.engines, key=lambda e: (e[0] != "llm", e)) if self.engines else (None, None)
        return TaskAnnotation(op=DECODE_TASK, engine=kind, model=model, prompt_tokens=self.tokens).as_dict()


def plan_here(nodes: list[Node]) -> tuple[list[PlannedHere], Lowered]:
    """Plan ``nodes`` together, as parts that share no task (each to run in one worker task,
    :func:`run_here`): nodes that share a call (CSE) are one part, independent ones are
    separate parts, so a quick request is never held back by a slow one planned beside it.
    Without the stage split (see :func:`compute_nested`) and without prefill tasks: one engine runs all
    the calls, and its prefix cache computes a prefix they share once (a request waits a step
    for a block another is computing), so a prefill task would only add an engine round trip
    before each stage."""
    lowered = _local_plan(nodes, drop=("stage", "prefix"))
    engines = frozenset(e for n in lowered.plan if (e := engine_of(n)) is not None)
    graph = dict(lowered.graph)
    parts = []
    outputs = list(dict.fromkeys(lowered.outputs[n.key] for n in nodes))  # CSE may merge two nodes' outputs
    work = _work(lowered)
    for keys, tasks in _independent(graph, outputs):
        parts.append(PlannedHere({k: graph[k] for k in tasks}, keys, engines,
                                 sum(work.get(k, 0) for k in tasks)))
    return parts, lowered


def _work(lowered: Lowered) -> dict:
    """Task key -> prompt plus output tokens, from the tasks' placement annotations."""
    return {key: int(a.get("prompt_tokens", 0)) + int(a.get("max_tokens", 0)) for key, a in lowered.annotations.items()}


def _independent(graph: dict, outputs: list) -> list[tuple[list, set]]:
    """``outputs`` grouped so that no two groups share a task: ``(keys, their tasks)`` each."""
    groups: list[tuple[list, set]] = []
    for key in outputs:
        tasks, todo = set(), [key]
        while todo:
            k = todo.pop()
            if k in tasks or k not in graph:
                continue
            tasks.add(k)
            todo.extend(getattr(graph[k], "dependencies", ()))
        joined = [g for g in groups if g[1] & tasks]
        for g in joined:
            groups.remove(g)
        groups.append(([k for g in joined for k in g[0]] + [key], set().union(tasks, *(g[1] for g in joined))))
    return groups


def run_here(planned: PlannedHere) -> list:
    """The task a server sends a worker: the values of a planned micro-batch's nodes, computed
    in this thread on this worker's engines (or submitted from here, where it lacks one). A
    node that fails does not fail the others: its slot holds its error."""
    plugin = host()
    plugin.wait_loaded()
    local = all(plugin.resident(model, kind) is not None for kind, model in planned.engines)
    try:
        return _run(planned.graph, planned.keys, local)
    except Exception:  # noqa: BLE001 - find which node failed, below
        if len(planned.keys) == 1:
            raise
    values = []
    for key in planned.keys:
        try:
            values.append(_run(planned.graph, [key], local)[0])
        except Exception as exc:  # noqa: BLE001 - that node's answer is its error
            values.append(exc)
    return values


def _run(graph, keys: list, local: bool) -> list:
    if local:
        # Threads, not one after another: a part's independent calls (a workflow's parallel
        # branches) wait on the engine together and join the same engine steps. They carry this
        # task's priority (a request's deadline) into the engine's queue.
        with in_place(), priority_of(thread_state.key):
            return list(dask.threaded.get(graph, keys, pool=_InWorker(_pool())))
    with worker_client(separate_thread=True) as client:
        return _gathered(client, client.get(graph, keys, sync=False))


def _local_plan(nodes: list[Node], drop: tuple[str, ...]) -> Lowered:
    """``nodes`` planned for this process's engines (the local view), without the passes ``drop``."""
    options = submit.current_options()
    options = dataclasses.replace(options, passes=tuple(p for p in options.passes if p not in drop))
    return submit.plan(list(nodes), options, LOCAL)


def _gathered(client, futures: list) -> list:
    """The values of work this task submitted; cancelling the task cancels that work too."""
    with host().abortable(thread_state.key, lambda: client.loop.add_callback(client._cancel, futures)):
        return client.gather(futures)
