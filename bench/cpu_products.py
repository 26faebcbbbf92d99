"""What batch invariance costs on this CPU: one smollm2 layer's four projections, by the paths
of ``daskllm.engines.invariant`` and the unprotected kernels beside them.

    python bench/cpu_products.py                 # 2 threads, rows 1 4 16 64 256 1024
    python bench/cpu_products.py --threads 1 --rows 1 2048
    ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_products.py   # as on a CPU with AVX2 and no AVX-512

It first prints the path the engine takes for each dtype on this CPU (``invariant.path_for``).
Each cell is the sum over the layer's products (QKV 576->960, output 576->576, gate/up
576->3072, down 1536->576) of the best of 7 timed calls (after 3 warm-up calls), in ms:

* ``fp32``: oneDNN on a prepared float32 weight, at the call's row count (not batch-invariant
  where the float32 floor is above 1);
* ``fp32-path``: the engine's float32 path (``invariant.Linear``);
* ``bf16``: bfloat16 at the call's row count, not batch-invariant: oneDNN on a prepared weight
  (AMX where the CPU has it), or ``F.linear`` where oneDNN has no bfloat16 kernels;
* ``bf16-path``: the engine's bfloat16 path (widened to float32's where oneDNN has no
  bfloat16 kernels);
* ``bf16-bN``: the unprotected bfloat16 product in calls of exactly N rows (the engine's path on
  AMX, with N = ``BLOCK_ROWS``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from daskllm.engines import invariant

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) of smollm2's projections


def in_blocks(product, rows: int):
    def run(x):
        n = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -n % rows)) if n % rows else x
        out = [product(part) for part in padded.split(rows)]
        return (out[0] if len(out) == 1 else torch.cat(out))[:n]
    return run


def unprotected(weight: torch.Tensor):
    """The product of ``weight``'s dtype at the call's row count: oneDNN's where it computes
    that dtype here, else ``F.linear``'s."""
    if invariant.path_for(weight.dtype).compute != weight.dtype:
        return lambda x: F.linear(x, weight)
    packed = invariant._reorder(weight)
    return lambda x: invariant._onednn_product(x, packed, None)


def best_ms(product, x) -> float:
    for _ in range(3):
        product(x)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        product(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, invariant.BLOCK_ROWS])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) * 0.1 for k, n in SHAPES]
    bf16 = [w.bfloat16() for w in weights]
    ways = {"fp32": ([unprotected(w) for w in weights], torch.float32),
            "fp32-path": ([invariant.Linear(w) for w in weights], torch.float32),
            "bf16": ([unprotected(w) for w in bf16], torch.bfloat16),
            "bf16-path": ([invariant.Linear(w) for w in bf16], torch.bfloat16)}
    for rows in args.blocks:
        ways[f"bf16-b{rows}"] = ([in_blocks(product, rows) for product in ways["bf16"][0]], torch.bfloat16)
    print(f"{args.threads} threads; {invariant.path_for(torch.float32)}; {invariant.path_for(torch.bfloat16)}")
    print("rows " + " ".join(f"{name:>11}" for name in ways))
    with torch.inference_mode():
        for m in args.rows:
            cells = [sum(best_ms(product, torch.randn(m, k).to(dtype)) for product, (k, _) in zip(products, SHAPES))
                     for products, dtype in ways.values()]
            print(f"{m:>4} " + " ".join(f"{ms:>11.3f}" for ms in cells))


if __name__ == "__main__":
    main()
