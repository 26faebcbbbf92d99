"""Monitoring in the Dask dashboard: the ``/llm`` page, ``/llm/metrics.json`` and Prometheus lines.

:func:`install` adds them to a running scheduler (the scheduler preload and
``LocalLLMCluster`` call it): the Bokeh page joins the dashboard (and its menu), the JSON
route and the Prometheus collector read the same numbers, from one snapshot shared by every
request and rebuilt at a bounded rate (:mod:`daskllm.dashboard.cache`). Every route is
read-only, answers GET and HEAD, and matches its exact path only.
"""

from __future__ import annotations

import json
import logging
import re

from distributed import SchedulerPlugin
from distributed.http.utils import RequestHandler
from tornado.ioloop import IOLoop

from daskllm.dashboard.cache import snapshot
from daskllm.dashboard.prometheus import PrometheusCollector

logger = logging.getLogger(__name__)


class MetricsJSON(RequestHandler):
    """``GET /llm/metrics.json``: the LLM metrics snapshot (read-only)."""

    def get(self):
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(snapshot(self.server), default=str))

    head = get  # Tornado sends a HEAD response's headers (with the length) without its body


def route(path: str) -> str:
    """A Tornado pattern matching ``path`` exactly (Tornado anchors only the end; the dots must
    not match any character)."""
    return re.escape(path) + "$"


_collector = None


def install(scheduler) -> bool:
    """Add the page, the JSON route and the Prometheus collector; False if the scheduler has no
    dashboard (nothing to add to). Never raises: monitoring must not stop a scheduler."""
    try:
        application = getattr(scheduler, "http_application", None)
        if application is None:
            return False
        application.add_handlers(r".*", [(route("/llm/metrics.json"), MetricsJSON, {"dask_server": scheduler})])
        _install_prometheus(scheduler)
        _install_page(scheduler, application)
        return True
    except Exception:  # noqa: BLE001
        logger.exception("daskllm: could not add the dashboard page")
        return False


def _install_prometheus(scheduler) -> None:
    global _collector
    try:
        import prometheus_client  # optional: without it, no Prometheus lines
    except ImportError:
        return
    if _collector is None:
        _collector = PrometheusCollector(scheduler)
        prometheus_client.REGISTRY.register(_collector)
    _collector.scheduler = scheduler  # several schedulers in one process (tests): the latest


def _install_page(scheduler, application) -> None:
    try:  # bokeh is optional: without it Dask has no dashboard at all
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables

        from daskllm.dashboard.page import llm_doc, serve_pages
    except ImportError:
        return

    variables = template_variables(scheduler)
    if "llm" not in variables["pages"]:
        variables["pages"].append("llm")  # the dashboard's menu
    app = BokehApplication({"/llm": llm_doc}, scheduler, prefix="/", template_variables=variables)
    serve_pages(app, scheduler)
    application.add_application(app)
    app.initialize(IOLoop.current())


class DashboardPlugin(SchedulerPlugin):
    """Installs the LLM page and routes when the scheduler starts (its HTTP server is up by then)."""

    name = "daskllm-dashboard"

    async def start(self, scheduler) -> None:
        install(scheduler)


__all__ = ["DashboardPlugin", "MetricsJSON", "install", "route"]
