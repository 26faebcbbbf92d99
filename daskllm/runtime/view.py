"""The planner's view of the cluster, taken once per submission; and the check that its models are served."""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from collections.abc import Iterable

from distributed import default_client

from daskllm.models import model_name
from daskllm.plan.context import LOCAL, ClusterView
from daskllm.worker.host import in_worker


class ModelNotServedError(LookupError):
    """Work names a model that no worker of the cluster holds."""


def current_client():
    """The client work would be submitted with (Dask's default), or None."""
    try:
        return default_client()
    except ValueError:
        return None


VIEW_TTL = 2.0  # seconds a view is reused (distributed's own scheduler-info-interval)
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> (taken at, view)


def take_view(client=None, *, fresh: bool = False) -> ClusterView:
    """What the workers of ``client``'s cluster hold, from the scheduler's view of their
    heartbeats. Without a client: the local view. An asynchronous client cannot be asked from
    synchronous planning: on a cluster, holdings unknown.

    A view is reused for ``VIEW_TTL`` seconds (``fresh``: asked again), so a burst of small
    computations costs one round trip, not one each. A view only shapes plans (how many
    holders to split work among); one that says a model is missing is asked again before that
    is an error (:func:`check_served`)."""
    client = client if client is not None else current_client()
    if client is None:
        return LOCAL
    if client.asynchronous:
        return ClusterView(on_cluster=True)
    now = time.monotonic()
    taken = None if fresh else _views.get(client)
    if taken is not None and now - taken[0] < VIEW_TTL:
        return taken[1]
    view = _asked(client)
    _views[client] = (now, view)
    return view


def _asked(client) -> ClusterView:
    """The view, from the scheduler (one round trip)."""
    holders: Counter = Counter()
    fastest: dict[str, float] = {}  # model -> its holders' fastest decode step
    contexts: dict[str, int] = {}  # model -> its holders' smallest context length
    reporting = 0
    for info in _workers_info(client):
        metrics = (info.get("metrics") or {}).get("daskllm")
        if not metrics:
            continue
        reporting += 1
        for kind, names in (metrics.get("models") or {}).items():
            holders.update((kind, model_name(name)) for name in set(names))
        for name, length in (metrics.get("contexts") or {}).items():
            contexts[model_name(name)] = min(int(length), contexts.get(model_name(name), int(length)))
        for name, stats in ((metrics.get("engines") or {}).get("llm") or {}).items():
            if (seconds := float(stats.get("fastest_decode_step") or 0.0)) > 0.0:
                fastest[model_name(name)] = min(seconds, fastest.get(model_name(name), seconds))
    return ClusterView(on_cluster=True, holders=tuple(sorted(holders.items())), reporting=reporting,
                       step_seconds=tuple(sorted((model, _power_of_two(s)) for model, s in fastest.items())),
                       contexts=tuple(sorted(contexts.items())))


def _power_of_two(seconds: float) -> float:
    return 2.0 ** round(math.log2(seconds))


def model_workers(client) -> dict[tuple[str, str], list[str]]:
    """``(engine kind, model name)`` -> addresses of the workers holding it (one round trip)."""
    out: dict[tuple[str, str], list[str]] = {}
    for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
        metrics = (info.get("metrics") or {}).get("daskllm") or {}
        for kind, names in (metrics.get("models") or {}).items():
            for name in set(names):
                out.setdefault((kind, model_name(name)), []).append(address)
    return out


def _missing(view: ClusterView, needed: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    held = view.held()
    return sorted((kind, model) for kind, model in set(needed) if model_name(model) not in held.get(kind, {}))


def _workers_info(client) -> list[dict]:
    try:
        return list(client.scheduler_info(n_workers=-1)["workers"].values())
    except TypeError:  # older distributed: every worker without asking
        return list(client.scheduler_info()["workers"].values())


def check_served(view: ClusterView, needed: Iterable[tuple[str, str]], client=None) -> None:
    """Raise :class:`ModelNotServedError` if a ``(kind, model)`` in ``needed`` is held by no
    worker in ``view`` (asked again first, if it was reused), naming what the workers hold.
    Does nothing inside a task (its job was checked when it was submitted) or while no worker
    reports daskllm engines."""
    if not view.reporting or in_worker():
        return
    missing = _missing(view, needed)
    if missing:
        client = client if client is not None else current_client()
        if client is not None and not client.asynchronous and view is not LOCAL:
            view = take_view(client, fresh=True)
            missing = _missing(view, needed)
    if not missing:
        return
    held = view.held()
    holdings = "; ".join(f"{kind}: " + ", ".join(f"{name} ({count} worker{'s' * (count > 1)})"
                                                for name, count in sorted(models.items()))
                         for kind, models in sorted(held.items()) if models) or "nothing"
    wanted = ", ".join(f"{kind} model {model!r}" for kind, model in missing)
    names = [model for kind, model in missing if kind == "llm"]
    hint = (f"; start workers with it (LocalLLMCluster(models={names!r}), or `dask worker ... --preload "
            f"daskllm.preload --daskllm-model {names[0]}`) or name a model they hold (model=...)" if names
            else "; start workers with it (LocalLLMCluster(embedders=..., rerankers=...)) or name one they hold")
    reporting = view.reporting
    raise ModelNotServedError(f"no worker serves the {wanted}; the cluster's {reporting} worker"
                              f"{'s hold' if reporting > 1 else ' holds'} {holdings}{hint}")
