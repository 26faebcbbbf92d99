"""Dask scheduler preload: ``dask scheduler --preload plugins/scheduler.py [--daskllm-placement POLICY]``.

Adds :class:`daskllm.placement.PlacementPlugin`, which places LLM tasks with model, cache
and load locality (policies: cache_aware, round_robin, least_loaded, prefix_affinity, off),
:class:`daskllm.streaming.StreamJanitor`, which deletes the queues of finished streams,
:class:`daskllm.adaptive.AdaptiveTarget`, which makes adaptive scaling see engine work,
:class:`daskllm.ledger.UsageLedger`, which keeps the tasks' usage records past a lost worker,
and the dashboard's LLM page (``/llm``), ``/llm/metrics.json`` and ``daskllm_*`` Prometheus lines.
``dask llm scheduler`` (:mod:`daskllm.dask_cli`) runs the same preload.
The dashboard has no authentication and ``dask scheduler`` serves it on every interface by
default: pass ``--dashboard-address 127.0.0.1:8787`` unless that network is trusted
(docs/dashboard.md).
"""

from daskllm.dask_cli import dask_setup  # noqa: F401 - the same preload `dask llm scheduler` runs
