"""Dask scheduler preload: ``dask scheduler --preload plugins/scheduler.py [--daskllm-placement POLICY]``.

Adds :class:`daskllm.placement.PlacementPlugin`, which places LLM tasks with model, cache
and load locality (policies: cache_aware, round_robin, least_loaded, prefix_affinity, off),
and :class:`daskllm.streaming.StreamJanitor`, which deletes the queues of finished streams,
and the dashboard's LLM page (``/llm``), ``/llm/metrics.json`` and ``daskllm_*`` Prometheus lines.
The dashboard has no authentication and ``dask scheduler`` serves it on every interface by
default: pass ``--dashboard-address 127.0.0.1:8787`` unless that network is trusted
(docs/dashboard.md).
"""

import click

from daskllm.dashboard import DashboardPlugin
from daskllm.placement import POLICIES, PlacementPlugin
from daskllm.streaming import StreamJanitor


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--daskllm-placement", "policy", default=None, type=click.Choice(POLICIES),
              help="Placement policy (default: daskllm.placement.policy in dask config).")
def dask_setup(scheduler, policy):
    scheduler.add_plugin(PlacementPlugin(policy), name=PlacementPlugin.name)
    scheduler.add_plugin(StreamJanitor(), name=StreamJanitor.name)
    scheduler.add_plugin(DashboardPlugin(), name=DashboardPlugin.name)
