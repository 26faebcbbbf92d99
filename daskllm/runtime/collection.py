"""What users hold: IR nodes that are Dask collections.

A :class:`LazyNode` is a :class:`~daskllm.plan.ir.Node` (what the planner sees) and a Dask
collection: ``dask.compute``, ``client.compute``, ``persist`` and ``node.compute()`` plan,
lower and submit it through :mod:`daskllm.runtime.submit`. Several nodes computed together
are planned jointly on the client (:class:`Joint`), so CSE and shared prefixes work across
outputs: Dask 2026 may run collection optimizers on the scheduler, too late for that.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import dask
from dask.base import DaskMethodsMixin
from dask.highlevelgraph import HighLevelGraph

from daskllm.ops.values import PERSISTED
from daskllm.plan.ir import Node
from daskllm.plan.lower import OUTPUT, Lowered
from daskllm.runtime import submit
from daskllm.runtime.metering import note_lowering
from daskllm.worker.host import in_worker

# Output task key -> node, so Dask's optimizer hook can count the plans it is handed.
_outputs: weakref.WeakValueDictionary[str, LazyNode] = weakref.WeakValueDictionary()
# Node key -> the plan its graph was last given with (see LazyNode._lowered); a plan holds its
# nodes, so this is bounded rather than weak.
_last_plan: OrderedDict[str, Lowered] = OrderedDict()
_LAST_PLANS = 64


class LazyNode(Node, DaskMethodsMixin):
    """A node of the LLM IR that is a Dask collection: computing it plans, lowers and submits."""

    __slots__ = ()

    def _lowered(self, fresh: bool = False) -> Lowered:
        """This node's plan. Dask asks for the graph first, then keys and finalizers: the graph
        plans afresh (settings, cluster view and remembered results as they are now) and the
        other questions get that same plan, so keys always match the graph they come with."""
        lowered = None if fresh else _last_plan.get(self.key)
        if lowered is None:
            lowered = submit.planned([self])
            _last_plan[self.key] = lowered
            while len(_last_plan) > _LAST_PLANS:
                _last_plan.popitem(last=False)
            _outputs[lowered.outputs[self.key]] = self
        return lowered

    def __dask_graph__(self):
        return self._lowered(fresh=True).graph

    def __dask_keys__(self):
        return [self._lowered().outputs[self.key]]

    def __dask_layers__(self):
        return tuple(self._lowered().graph.layers)

    def __dask_tokenize__(self):
        return self.key

    def __dask_postcompute__(self):
        return _finalize, (self._lowered().remember.get(self.key),)

    def __dask_postpersist__(self):
        return _persisted, (self.__dask_keys__()[0], self.width)

    @staticmethod
    def __dask_optimize__(dsk, keys, **kwargs):
        return _count_plans(dsk)

    __dask_scheduler__ = staticmethod(dask.threaded.get)

    def compute(self, **kwargs):
        return compute(self, **kwargs)[0]

    def persist(self, **kwargs):
        with submit.overrides(kwargs):
            return super().persist(**kwargs)


class Joint(DaskMethodsMixin):
    """Several nodes planned and lowered together, on the client: one collection for Dask."""

    __slots__ = ("nodes", "lowered")

    def __init__(self, nodes: list[Node], lowered: Lowered):
        self.nodes, self.lowered = nodes, lowered

    def __dask_graph__(self):
        return self.lowered.graph

    def __dask_keys__(self):
        return [self.lowered.outputs[n.key] for n in self.nodes]

    def __dask_layers__(self):
        return tuple(self.lowered.graph.layers)

    def __dask_tokenize__(self):
        return tuple(self.__dask_keys__())

    def __dask_postcompute__(self):
        return tuple, ()

    @staticmethod
    def __dask_optimize__(dsk, keys, **kwargs):
        return dsk  # lowered already

    __dask_scheduler__ = staticmethod(dask.threaded.get)


def compute(*nodes, passes=None, granularity=None, result_cache=None, release_threads=None, **kwargs):
    """``dask.compute`` with per-call rewrite settings; daskllm nodes are planned together."""
    settings = {k: v for k, v in {"passes": passes, "granularity": granularity,
                                  "result_cache": result_cache,
                                  "release_threads": release_threads}.items() if v is not None}
    with submit.overrides({**settings, **kwargs}) as rest:
        ours = list(dict.fromkeys(n for n in nodes if isinstance(n, Node)))
        if not ours:
            return dask.compute(*nodes, **rest)
        lowered = submit.planned(ours)
        note_lowering(lowered)
        values, *others = dask.compute(Joint(ours, lowered), *[n for n in nodes if not isinstance(n, Node)], **rest)
        by_key = dict(zip((n.key for n in ours), values))
        others = iter(others)
        results = tuple(by_key[n.key] if isinstance(n, Node) else next(others) for n in nodes)
        for node in ours:
            # Here, on the client (Dask may finalize on a worker), and under this call's
            # settings: result_cache=False remembers nothing.
            submit.remember(lowered, node.key, by_key[node.key])
    return results


def _finalize(results, calls):
    if calls is not None and not in_worker():  # on a cluster Dask may finalize on a worker: remember nothing there
        submit.remember_calls(calls, results[0])
    return results[0]


def _persisted(dsk, key, width):
    """A node standing for an already computed (persisted) value."""
    return LazyNode(PERSISTED.name, value=(dict(dsk), key), width=width, identity=key)


def _count_plans(dsk):
    """Dask's collection optimizer hook: the graphs are lowered already, so this only counts
    their plans for :func:`daskllm.usage` (``dask.compute(node)`` comes here, not through
    :func:`compute`)."""
    if isinstance(dsk, HighLevelGraph):
        for name, layer in dsk.layers.items():
            if name.startswith(f"daskllm-{OUTPUT}-"):
                for key in layer:
                    node = _outputs.get(key)
                    if node is not None:
                        note_lowering(node._lowered())
    return dsk
