"""Dask worker preload: ``dask worker SCHEDULER --preload plugins/worker.py --daskllm-model tiny``.

The logic lives in :mod:`daskllm.preload` (also usable as ``--preload daskllm.preload``);
this file exists so a checkout can be deployed by path. See that module for the options.
"""

from daskllm.preload import dask_setup, dask_teardown  # noqa: F401
