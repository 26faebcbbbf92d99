"""Computing daskllm nodes from inside a task: on this worker's own engines where it can.

A task that already sits where its work belongs (a table partition Dask placed, a server's
micro-batch sent to one worker) gains nothing from planning its calls as new tasks for the
scheduler to place: each stage's calls would wait for a scheduler round trip before reaching
the engine. Where this worker serves every engine the nodes need, their plan runs in the
task's own thread (``dask.local.get_sync``): each stage's calls go to the engine the moment
the previous stage's values exist. The same tasks run either way: the same tokens and usage.
"""

from __future__ import annotations

import dataclasses

from dask.local import get_sync
from distributed import worker_client

from daskllm.plan.context import LOCAL
from daskllm.plan.ir import Node
from daskllm.plan.lower import Lowered
from daskllm.plan.parts import parts_of
from daskllm.plan.passes.parts import local_engines
from daskllm.runtime import submit
from daskllm.worker.execute import in_place
from daskllm.worker.host import host, in_worker
from daskllm.worker.parts import Part, gathered


def compute_nested(nodes: list[Node], here: bool = True) -> tuple[list, Lowered]:
    """Compute daskllm nodes from inside a task: ``(values, plan)``.

    ``here``: where this worker serves every engine the nodes need, their plan runs in this
    task's thread against them, keeping the task's thread slot (so Dask balances such tasks
    like any other). Otherwise (or without ``here``) the plan is submitted from the task,
    placed by the scheduler plugin; cancelling the task cancels that work too."""
    if in_worker() and not (here and all(served_here(n) for n in nodes)):
        with worker_client(separate_thread=True) as client:
            submission = submit.plan_and_submit(list(nodes), client)
            return gathered(client, submission.futures), submission.lowered
    # No stage split: shards would run one after another in this thread; the engine batches each call whole.
    lowered = _local_plan(nodes, drop=("stage",))
    with in_place():
        return list(get_sync(lowered.graph, [lowered.outputs[n.key] for n in nodes])), lowered


def served_here(node: Node) -> bool:
    """Whether this worker can compute ``node`` in a task's thread: only ops of
    :data:`~daskllm.plan.passes.parts.LOCAL_OPS`, each engine resident here."""
    plugin = host()
    plugin.wait_loaded()
    needed = engines_needed([node])
    return needed is not None and all(plugin.resident(model, kind) is not None for kind, model in needed)


def engines_needed(nodes: list[Node]) -> set[tuple[str, str]] | None:
    """The ``(kind, model)`` engines computing ``nodes`` takes; None where it takes more than
    engines (an op outside :data:`~daskllm.plan.passes.parts.LOCAL_OPS`: an index shard, a stream)."""
    closure: dict[str, Node] = {}
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.key not in closure:
            closure[n.key] = n
            todo.extend(n.inputs.values())
    return local_engines(closure.values())


def plan_here(nodes: list[Node]) -> tuple[list[Part], Lowered]:
    """Plan ``nodes`` together, as parts that share no task (each to run in one worker task,
    :func:`~daskllm.worker.parts.run_part`): nodes that share a call (CSE) are one part,
    independent ones are separate parts, so a quick request is never held back by a slow one
    planned beside it. Without the stage split (see :func:`compute_nested`) and without
    prefill tasks: one engine runs all the calls, and its prefix cache computes a prefix they
    share once, so a prefill task would only add an engine round trip before each stage."""
    lowered = _local_plan(nodes, drop=("stage", "prefix"))
    outputs = list(dict.fromkeys(lowered.outputs[n.key] for n in nodes))  # CSE may merge two nodes' outputs
    return parts_of(lowered, dict(lowered.graph), outputs), lowered


def _local_plan(nodes: list[Node], drop: tuple[str, ...]) -> Lowered:
    """``nodes`` planned for this process's engines (the local view), without the passes ``drop``."""
    options = submit.current_options()
    options = dataclasses.replace(options, passes=tuple(p for p in options.passes if p not in drop))
    return submit.plan(list(nodes), options, LOCAL)
