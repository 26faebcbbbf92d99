"""Which vector kernels torch, MKL and numpy use in this environment, on this CPU.

    python scripts/cpu_kernels.py              # print them
    python scripts/cpu_kernels.py --baseline   # also exit 1 unless torch's and numpy's are the
                                               # x86-64 baseline ones and oneDNN's at most AVX2
                                               # (make test-baseline-cpu)

* torch: the capability of its ATen kernels (``ATEN_CPU_CAPABILITY=default``: no AVX).
* oneDNN, torch's kernels for the engine's products: the instruction set it runs, as
  ``ONEDNN_VERBOSE`` reports it (``ONEDNN_MAX_CPU_ISA=AVX2``: no AVX-512, no bfloat16 kernels).
* MKL, torch's BLAS: its numerical-reproducibility branch as ``MKL_VERBOSE`` reports it on a
  product (``OFF``: the kernels MKL picks for the CPU; ``MKL_CBWR`` sets another).
* numpy: the SIMD targets it dispatches to beyond its x86-64-v2 baseline
  (``NPY_DISABLE_CPU_FEATURES`` removes them).
* numpy's BLAS (OpenBLAS): the kernels it picked for the CPU, or by ``OPENBLAS_CORETYPE``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys


def _verbose(probe: str, variable: str, pattern: str) -> str | None:
    """The first group of ``pattern`` in what ``probe`` prints in a fresh process with the
    library's verbose ``variable`` set (the libraries write to the process's stdout)."""
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, variable: "1"},
                          capture_output=True, text=True, check=True, timeout=120)
    found = re.search(pattern, done.stdout)
    return found.group(1).strip() if found else None


def mkl_branch() -> str:
    """MKL's CNR branch for a product."""
    return _verbose("import torch; torch.ones(2, 2) @ torch.ones(2, 2)", "MKL_VERBOSE", r"CNR:(\w+)") or "no MKL"


# oneDNN's names for the instruction sets up to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 on any x86-64 CPU)
UP_TO_AVX2 = ("Intel SSE4.1", "Intel AVX", "Intel AVX2")


def onednn_isa() -> str:
    """The instruction set oneDNN runs."""
    probe = ("import torch; from daskllm.engines import invariant; "
             "invariant._onednn_product(torch.ones(2, 8), invariant._reorder(torch.ones(8, 8)), None)")
    return _verbose(probe, "ONEDNN_VERBOSE", r"info,cpu,isa:([^\n]+)") or "no oneDNN"


def numpy_blas() -> str:
    """numpy's BLAS and the kernels it picked (threadpoolctl reads them from OpenBLAS)."""
    import numpy as np

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (no threadpoolctl)"
    np.ones((2, 2)) @ np.ones((2, 2))  # loads it
    libraries = [f"{x['internal_api']} {x.get('version')}, {x.get('architecture') or '?'} kernels"
                 for x in threadpool_info() if x["user_api"] == "blas"]
    return f"{'; '.join(libraries) or 'none'} (OPENBLAS_CORETYPE {os.environ.get('OPENBLAS_CORETYPE', 'unset')})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", action="store_true",
                   help="exit 1 unless torch's ATen kernels and numpy's loops are the baseline ones (no AVX) "
                        "and oneDNN's at most AVX2")
    args = p.parse_args(argv)
    import numpy as np
    import torch
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    numpy_simd = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    found = {"torch (ATen)": torch.backends.cpu.get_cpu_capability(), "oneDNN": onednn_isa(),
             "MKL branch": mkl_branch(),
             "numpy SIMD past its baseline": ", ".join(numpy_simd) or "none",
             "numpy's BLAS": numpy_blas()}
    for what, value in found.items():
        print(f"{what}: {value}")
    if not args.baseline:
        return 0
    wrong = [what for what, ok in (("torch (ATen)", found["torch (ATen)"] == "DEFAULT"),
                                   ("oneDNN", found["oneDNN"] in UP_TO_AVX2),
                                   ("numpy SIMD past its baseline", not numpy_simd)) if not ok]
    if wrong:
        print(f"not the baseline kernels: {', '.join(wrong)} (see the Makefile's test-baseline-cpu)",
              file=sys.stderr)
    return 1 if wrong else 0

if __name__ == "__main__":
    sys.exit(main())
