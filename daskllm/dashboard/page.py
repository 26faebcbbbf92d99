"""The LLM page of the Dask dashboard (``/llm``): engines, caches, throughput, placement.

A Bokeh document like Dask's own pages, updated once per ``daskllm.dashboard.refresh`` from the
shared snapshot of the workers' heartbeats (:func:`daskllm.dashboard.cache.snapshot`):

* per worker: requests running and waiting (queue depth) and KV-cache use, as bars;
* over time: prefill and decode tokens/s, and the prefix-cache hit rate;
* a table of the models and indexes resident on each worker (GPU use where there is one);
* the placement plugin's decisions: tasks placed for cache, for model, for balance, by fallback.

Every page is a Bokeh session built on the scheduler's event loop (its charts take about a
tenth of a second to build) and updated there until it is closed, or, never connected, until
Bokeh drops it 15 s later. So at most ``daskllm.dashboard.max-pages`` pages with charts are open
per scheduler; a request beyond that is refused (503) before Bokeh builds anything, at the cost
of a JSON reply.
"""

from __future__ import annotations

import weakref

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataTable, Div, TableColumn
from bokeh.plotting import figure
from bokeh.server.views.doc_handler import DocHandler
from distributed.dashboard.components.scheduler import BOKEH_THEME, env
from tornado.web import authenticated

from daskllm import config
from daskllm.dashboard.cache import refresh_interval, snapshot
from daskllm.dashboard.metrics import _history


class LLMPage:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.drawn = None  # the snapshot last drawn: an update without a newer one does nothing
        self.workers = ColumnDataSource({"worker": [], "queued": [], "running": [], "cache_pct": []})
        self.series = ColumnDataSource({"time": [], "prefill": [], "decode": [], "hit_rate": []})
        self.models = ColumnDataSource({"worker": [], "models": [], "indexes": [], "gpu": []})
        self.decisions = ColumnDataSource({"reason": [], "tasks": []})

        queue = figure(title="Requests per worker (running + waiting)", x_range=[], height=260,
                       sizing_mode="stretch_width", toolbar_location=None)
        queue.vbar(x="worker", top="queued", width=0.6, source=self.workers, color="#c44e52")
        queue.vbar(x="worker", top="running", width=0.6, source=self.workers, color="#4c72b0")
        cache = figure(title="KV-cache use per worker (%)", x_range=[], y_range=(0, 100), height=260,
                       sizing_mode="stretch_width", toolbar_location=None)
        cache.vbar(x="worker", top="cache_pct", width=0.6, source=self.workers, color="#55a868")
        self.bar_figures = (queue, cache)
        tokens = figure(title="Tokens/s (all workers)", x_axis_type="datetime", height=260,
                        sizing_mode="stretch_width", toolbar_location=None)
        tokens.line("time", "prefill", source=self.series, legend_label="prefill", color="#8172b2", line_width=2)
        tokens.line("time", "decode", source=self.series, legend_label="decode", color="#dd8452", line_width=2)
        hits = figure(title="Prefix-cache hit rate", x_axis_type="datetime", y_range=(0, 1), height=260,
                      sizing_mode="stretch_width", toolbar_location=None)
        hits.line("time", "hit_rate", source=self.series, color="#55a868", line_width=2)
        placed = figure(title="Placement decisions (tasks)", x_range=[], height=260, sizing_mode="stretch_width",
                        toolbar_location=None)
        placed.vbar(x="reason", top="tasks", width=0.6, source=self.decisions, color="#937860")
        self.placed = placed
        table = DataTable(source=self.models, height=200, sizing_mode="stretch_width", index_position=None,
                          columns=[TableColumn(field="worker", title="worker"),
                                   TableColumn(field="models", title="resident models"),
                                   TableColumn(field="indexes", title="indexes (shard: vectors)"),
                                   TableColumn(field="gpu", title="GPU")])
        self.root = column(Div(text="<h2>daskllm: LLM engines</h2>"), row(queue, cache, sizing_mode="stretch_width"),
                           row(tokens, hits, sizing_mode="stretch_width"), row(placed, sizing_mode="stretch_width"),
                           table, sizing_mode="stretch_width")

    def update(self) -> None:
        snap = snapshot(self.scheduler)
        if snap is self.drawn:
            return
        self.drawn = snap
        names, queued, running, cache_pct, models, indexes, gpus = [], [], [], [], [], [], []
        for worker, w in sorted(snap["workers"].items()):
            llm = [e for e in w["engines"].values() if e["kind"] == "llm"]
            short = worker.split("//")[-1]
            names.append(short)
            running.append(sum(e.get("running") or 0 for e in llm))
            queued.append(running[-1] + sum(e.get("waiting") or 0 for e in llm))
            used = sum(e.get("cache_blocks_used") or 0 for e in llm)
            total = sum(e.get("cache_blocks_total") or 0 for e in llm)
            cache_pct.append(100.0 * used / total if total else 0.0)
            models.append("; ".join(f"{kind}: {', '.join(ms)}" for kind, ms in w["models"].items() if ms))
            indexes.append("; ".join(f"{name} {shards}" for name, shards in w["indexes"].items()))
            gpu = w.get("gpu") or {}
            gpus.append(f"{gpu.get('utilization', 0)}% busy, {gpu.get('memory_used', 0) / 2**30:.1f} of "
                        f"{gpu.get('memory_total', 0) / 2**30:.1f} GiB" if gpu else "-")
        for fig in self.bar_figures:
            fig.x_range.factors = names
        self.workers.data = {"worker": names, "queued": queued, "running": running, "cache_pct": cache_pct}
        self.models.data = {"worker": names, "models": models, "indexes": indexes, "gpu": gpus}
        decisions = snap["placement"]["decisions"]
        self.placed.x_range.factors = sorted(decisions)
        self.decisions.data = {"reason": sorted(decisions), "tasks": [decisions[r] for r in sorted(decisions)]}
        # Time series over the history the metrics keep (one point per snapshot built).
        times, prefill, decode, hit_rate = [], [], [], []
        for t, rates in list(_history.series):
            flat = [r for per_worker in rates.values() for r in per_worker.values()]
            p = sum(r["prefill_tokens_per_s"] for r in flat)
            times.append(t * 1000)
            prefill.append(p)
            decode.append(sum(r["decode_tokens_per_s"] for r in flat))
            hit_rate.append(sum(r["prefill_tokens_cached_per_s"] for r in flat) / p if p else 0.0)
        self.series.data = {"time": times, "prefill": prefill, "decode": decode, "hit_rate": hit_rate}


class PageBudget:
    """How many pages with charts are open on one scheduler (at most ``daskllm.dashboard.max-pages``)."""

    def __init__(self):
        self.open = 0
        self.built = 0  # pages with charts built, ever
        self.refused = 0  # requests refused for want of room

    def full(self) -> bool:
        return self.open >= int(config.get("dashboard.max-pages"))

    def take(self) -> bool:
        if self.full():
            self.refused += 1
            return False
        self.open += 1
        self.built += 1
        return True

    def give_back(self) -> None:
        self.open -= 1

    def message(self) -> str:
        return (f"<h2>daskllm: LLM engines</h2><p>{self.open} LLM pages are open on this scheduler, the most "
                "allowed (<code>daskllm.dashboard.max-pages</code>). Close one, or reload in a few seconds: "
                "pages never connected are dropped after a while.</p>")


_budgets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> PageBudget


def budget_of(scheduler) -> PageBudget:
    budget = _budgets.get(scheduler)
    if budget is None:
        budget = _budgets[scheduler] = PageBudget()
    return budget


def llm_doc(scheduler, extra, doc) -> None:
    doc.theme = BOKEH_THEME
    budget = budget_of(scheduler)
    if not budget.take():  # PageHandler refuses first; this holds if requests raced past it
        doc.title = "Dask: LLM (too many pages open)"  # Bokeh's plain template shows it, Dask's would not
        doc.add_root(Div(text=budget.message()))
        return
    try:
        page = LLMPage(scheduler)
        page.update()
    except Exception:
        budget.give_back()  # no session, so no destroy callback, if the page could not be built
        raise
    doc.on_session_destroyed(lambda session_context: budget.give_back())
    doc.title = "Dask: LLM"
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.add_periodic_callback(page.update, max(100, int(refresh_interval() * 1000)))
    doc.add_root(page.root)


class PageHandler(DocHandler):
    """Bokeh's handler of the page, and: HEAD answered with the headers alone (Bokeh: 405; a
    session for it would cost as much as a page), and, with ``max-pages`` pages open, a GET
    refused at once (503): even a one-line Bokeh page costs the event loop ten times a JSON reply."""

    def __init__(self, *args, budget: PageBudget, **kwargs):
        self.budget = budget
        super().__init__(*args, **kwargs)

    @authenticated
    def head(self, *args, **kwargs):
        self.set_header("Content-Type", "text/html")

    @authenticated
    async def get(self, *args, **kwargs):
        if self.budget.full():
            self.budget.refused += 1
            self.set_status(503)
            self.set_header("Retry-After", "15")  # Bokeh drops a page never connected after 15 s
            self.write(f"<!DOCTYPE html><html><head><title>Dask: LLM (too many pages open)</title></head>"
                       f"<body>{self.budget.message()}</body></html>")
            return
        await super().get(*args, **kwargs)


def serve_pages(app, scheduler) -> None:
    """Serve the page of ``app`` (the Bokeh server application of ``llm_doc``) with :class:`PageHandler`."""
    for rule in app.wildcard_router.rules:
        if rule.target is DocHandler:
            rule.target = PageHandler
            rule.target_kwargs["budget"] = budget_of(scheduler)


__all__ = ["LLMPage", "PageBudget", "PageHandler", "budget_of", "llm_doc", "serve_pages"]
