"""Parts: pieces of a plan that run whole inside one worker task, on that worker's engines.

A part is a subgraph of lowered tasks (engine calls and the small tasks between them) that
shares no task with the rest of its plan. Run in one worker task, each of its calls reaches
the engine the moment the values it needs exist: no scheduler round trip between a call and
the next. Its tasks run on threads (a part's independent calls wait on the engine together
and join the same engine steps), in the worker task's context, so cancelling that task
aborts its engine requests. Small plans run as parts (the ``parts`` rewrite pass); so do a
server's micro-batches.
"""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import dask.threaded
from distributed import worker_client
from distributed.worker import thread_state

from daskllm.annotations import DECODE_TASK, TaskAnnotation
from daskllm.worker.execute import in_place
from daskllm.worker.host import WORK_OF, host, in_worker, priority_of

_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


@dataclass(frozen=True)
class Part:
    """Tasks to run in one worker task: its graph, the keys whose values it returns, and the
    engines it needs. A plain object to Dask, which therefore ships it as an argument rather
    than reading its graph as tasks of its own."""

    graph: object
    keys: list
    engines: frozenset  # (kind, model)
    tokens: int = 0  # the work it brings an engine: its calls' prompt and output token estimates
    # The prompt prefix (block-hash chain) its largest group of calls shares, and how many
    # calls share it: what a worker already holding that prefix would serve from cache.
    prefix: tuple[str, ...] = ()
    calls: int = 1

    def annotation(self) -> dict:
        """Its ``daskllm`` task annotation: the placement plugin then places it like any engine
        task (with its policy: by the prefix its calls share, or not) and counts its tokens in
        that worker's queue (so work placed later sees them)."""
        kind, model = min(self.engines, key=lambda e: (e[0] != "llm", e)) if self.engines else (None, None)
        return TaskAnnotation(op=DECODE_TASK, engine=kind, model=model, prefix=self.prefix,
                              prompt_tokens=self.tokens, shard=self.calls).as_dict()


def run_part(part: Part) -> list:
    """The values of ``part.keys``, computed in this thread on this worker's engines (or
    submitted from here, where it lacks one). A key that fails does not fail the others: its
    slot holds its error."""
    plugin = host()
    plugin.wait_loaded()
    # Outside a worker (a plan made for a cluster, computed with a local scheduler), this
    # process's engines, loaded on first use, are the ones to run on.
    local = not in_worker() or all(plugin.resident(model, kind) is not None for kind, model in part.engines)
    try:
        return _run(part.graph, part.keys, local)
    except Exception:  # noqa: BLE001 - find which key failed, below
        if len(part.keys) == 1:
            raise
    values = []
    for key in part.keys:
        try:
            values.append(_run(part.graph, [key], local)[0])
        except Exception as exc:  # noqa: BLE001 - that key's value is its error
            values.append(exc)
    return values


def pick(values: list, i: int):
    """One value of a part's result; a key that failed raises its error here."""
    value = values[i]
    if isinstance(value, BaseException):
        raise value
    return value


def gathered(client, futures: list) -> list:
    """The values of work this task submitted; cancelling the task cancels that work too."""
    with host().abortable(thread_state.key, lambda: client.loop.add_callback(client._cancel, futures)):
        return client.gather(futures)


def _run(graph, keys: list, local: bool) -> list:
    if local:
        # Threads, not one after another: a part's independent calls (a workflow's parallel
        # branches) wait on the engine together and join the same engine steps. They carry this
        # task's priority (a request's deadline) into the engine's queue.
        with in_place(), priority_of(getattr(thread_state, "key", None)):
            return list(dask.threaded.get(graph, keys, pool=_InWorker(_pool())))
    with worker_client(separate_thread=True) as client:
        return gathered(client, client.get(graph, keys, sync=False))


def together(calls: list) -> list:
    """The values of ``calls`` (functions of no argument), run at once on this process's shared
    threads as work of this worker task (its engines, its usage log, its cancellation): their
    engine requests join the same engine steps. The first error is raised once all are done."""
    if len(calls) <= 1:
        return [c() for c in calls]
    pool = _InWorker(_pool())
    futures = [pool.submit(c) for c in calls]
    wait(futures)
    return [f.result() for f in futures]


def _pool() -> ThreadPoolExecutor:
    """This process's threads for the calls of parts (they wait on engines)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(64, thread_name_prefix="daskllm-part"))
        return _POOL[0]


class _InWorker:
    """The shared threads, running each call in a copy of the submitting worker task's context:
    ``get_worker()`` reads a context variable, and through it a call finds the worker's
    resident engines and usage log."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self._max_workers = pool._max_workers  # what dask.threaded.get reads
        self.context = contextvars.copy_context()
        # On a shared thread (work submitted by work of a task), the task it is work of.
        self.task_key = getattr(thread_state, "key", None) or WORK_OF.get()

    def submit(self, fn, *args, **kwargs):
        return self.pool.submit(self.context.copy().run, _in_task, self.task_key, fn, *args, **kwargs)


def _in_task(task_key, fn, *args, **kwargs):
    """``fn`` on a shared thread (in its own context copy) as work of the worker task
    ``task_key``: the engine requests it waits on are registered under that task
    (``host().abortable``), so cancelling the task aborts them."""
    WORK_OF.set(task_key)
    return fn(*args, **kwargs)
