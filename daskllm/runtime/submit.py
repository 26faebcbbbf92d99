"""The one runtime entry: plan nodes (memoized) and submit them.

Every path that runs daskllm nodes comes here: :func:`daskllm.compute` and ``node.compute()``,
Dask's own ``dask.compute``/``client.compute`` through the collection protocol, the dataframe
accessor's tasks and the pmap consumers on workers. Each takes the settings
(:class:`~daskllm.plan.context.PlanOptions`, from dask config) and the
:class:`~daskllm.plan.context.ClusterView` once, and plans with the pure planner; both are
part of the plan-cache key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass

import dask

from daskllm import config
from daskllm.ops import engine_of
from daskllm.plan.context import ClusterView, PlanOptions
from daskllm.plan.ir import Node
from daskllm.plan.lower import Lowered
from daskllm.plan.planner import plan as plan_nodes
from daskllm.runtime.metering import note_lowering, note_planning
from daskllm.runtime.view import check_served, take_view
from daskllm.streaming.stages import Submitted
from daskllm.worker.results import RESULTS
from daskllm.worker.store import STORED

OVERRIDE_KEYS = {"passes": "rewrite.passes", "granularity": "rewrite.granularity",
                 "result_cache": "rewrite.result-cache", "release_threads": "rewrite.release-threads"}


@contextlib.contextmanager
def overrides(kwargs: dict):
    """Per-call overrides of the rewrite config, taken out of ``compute(**kwargs)``."""
    settings = {OVERRIDE_KEYS[k]: kwargs.pop(k) for k in list(kwargs) if k in OVERRIDE_KEYS}
    with config.overriding(settings):
        yield kwargs


def current_options() -> PlanOptions:
    """The rewrite settings in effect here (dask config, and any override)."""
    rewrite = dict(config.get("rewrite"))
    # result_cache=False: its calls skip the store, so what the store holds must not shape the plan.
    stored = STORED if rewrite.get("result-cache", True) else None
    return PlanOptions.from_settings(rewrite, config.get("engine.block-size"), results=RESULTS, stored=stored,
                                     submit_nested=submit_nested)


_cache_lock = threading.Lock()
_plans: dict = {}


def plan(nodes: list[Node], options: PlanOptions | None = None, view: ClusterView | None = None) -> Lowered:
    """Plan and lower ``nodes`` together, memoized per nodes, settings, remembered results and cluster view."""
    options = options if options is not None else current_options()
    view = view if view is not None else take_view()
    key = (tuple(n.key for n in nodes), options.cache_key, view)
    with _cache_lock:
        if key in _plans:
            return _plans[key]
    start = time.perf_counter()
    lowered = plan_nodes(list(nodes), options, view)
    note_planning(time.perf_counter() - start)
    with _cache_lock:
        if len(_plans) > 64:
            _plans.clear()
        _plans[key] = lowered
    return lowered


def planned(nodes: list[Node], client=None) -> Lowered:
    """:func:`plan`, for submission: a model no worker holds fails here, naming it."""
    view = take_view(client)
    lowered = plan(nodes, view=view)
    check_served(view, {engine for n in lowered.plan if (engine := engine_of(n)) is not None}, client)
    return lowered


@dataclass(frozen=True)
class Submission:
    futures: list  # one per node, in order
    lowered: Lowered


def plan_and_submit(nodes: list[Node], client, *, options: PlanOptions | None = None,
                    view: ClusterView | None = None, **restrictions) -> Submission:
    """Plan ``nodes`` together and submit them to ``client``'s cluster: one future per node."""
    lowered = planned(nodes, client) if options is None and view is None else plan(nodes, options, view)
    note_lowering(lowered)
    keys = [lowered.outputs[n.key] for n in nodes]
    return Submission(client.get(lowered.graph, keys, sync=False, **restrictions), lowered)


def submit_nested(client, values: list, planning, **restrictions) -> Submitted:
    """Start the lazy values a pmap item's stages returned, from the worker running the pmap:
    daskllm nodes planned together (CSE, shared prefixes across items) with the submitting
    computation's settings and cluster view (``planning``), anything else through Dask."""
    options, view = planning
    options = dataclasses.replace(options, results=RESULTS, submit_nested=submit_nested)
    nodes = list({v.key: v for v in values if isinstance(v, Node)}.values())
    by_key, requested, task_keys = {}, {}, set()
    if nodes:
        submission = plan_and_submit(nodes, client, options=options, view=view, **restrictions)
        by_key = dict(zip((n.key for n in nodes), submission.futures))
        requested = dict(submission.lowered.report.get("requested", {}))
        task_keys = set(submission.lowered.task_keys())
    others = [v for v in values if not isinstance(v, Node)]
    other_futures = iter(client.compute([_lazy(v) for v in others], **restrictions) if others else [])
    futures = [by_key[v.key] if isinstance(v, Node) else next(other_futures) for v in values]
    return Submitted(futures, requested, task_keys)


def _lazy(value):
    return value if dask.is_dask_collection(value) else dask.delayed(value)


def remember(lowered: Lowered, node_key: str, value) -> None:
    """Remember a computed node's deterministic results, under its calls' hashes."""
    calls = lowered.remember.get(node_key)
    if calls is not None:
        remember_calls(calls, value)


def remember_calls(calls: tuple[list[str], bool], value) -> None:
    if not config.get("rewrite.result-cache"):
        return
    item_hashes, batched = calls
    for h, v in zip(item_hashes, value if batched else [value]):
        if v is not None:  # a call that failed under on_error="null": nothing to remember
            RESULTS.put(h, v)
