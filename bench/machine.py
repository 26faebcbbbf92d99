"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import contextlib
import os
import platform


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
