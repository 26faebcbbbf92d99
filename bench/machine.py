"""What every benchmark shares: the record of the machine it ran on, and progress logging."""

from __future__ import annotations

import contextlib
import os
import platform
import sys

import dask

# Benchmarks measure computing, never reading results a previous run stored: the persistent
# result store is off here, in the clusters started here (they inherit this config) and in
# subprocesses (the variable).
os.environ["DASK_DASKLLM__RESULT_STORE__ENABLED"] = "False"
dask.config.set({"daskllm.result-store.enabled": False})


def log(msg) -> None:
    """Progress on stderr, so stdout stays the Markdown report."""
    print(msg, file=sys.stderr, flush=True)


def machine_info(**extra) -> dict:
    import dask
    import distributed
    import numpy as np
    import torch

    cpu_model = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_model)
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        **extra,
    }
