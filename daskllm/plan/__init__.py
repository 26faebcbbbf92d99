"""The pure planner: the IR, the rewrite passes and lowering.

:func:`daskllm.plan.planner.plan` turns the requested nodes, a
:class:`~daskllm.plan.context.PlanOptions` and a frozen
:class:`~daskllm.plan.context.ClusterView` into a Dask graph with typed annotations. It
imports nothing from the runtime and never talks to the scheduler.
"""
