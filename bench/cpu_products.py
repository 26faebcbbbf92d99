"""What batch invariance costs on this CPU: one smollm2 layer's four projections, by the ways of
``daskllm.engines.invariant`` and the unprotected kernels beside them.

    python bench/cpu_products.py                 # 2 threads, rows 1 4 16 64 256 1024
    python bench/cpu_products.py --threads 1 --rows 1 2048

Each cell is the sum over the layer's products (QKV 576->960, output 576->576, gate/up
576->3072, down 1536->576) of the best of 7 timed calls (after 3 warm-up calls), in ms:

* ``fp32``: oneDNN on a prepared float32 weight, at the call's row count;
* ``fp32-floor``: the same with rows padded to ``invariant.min_rows(float32)`` (the engine's way
  where the probe found a floor);
* ``bf16``: oneDNN on a prepared bfloat16 weight (AMX where the CPU has it), at the call's row
  count: not batch-invariant on AMX;
* ``bf16-bN``: the same in calls of exactly N rows (the engine uses N = ``BLOCK_ROWS``).
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


def padded_to(product, floor: int):
    return lambda x: product(F.pad(x, (0, 0, 0, max(0, floor - x.shape[0]))))[:x.shape[0]]


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
    fp32 = [invariant.Linear(w) for w in weights]
    bf16 = [invariant.Linear(w.bfloat16()) for w in weights]
    onednn = lambda linear: (lambda x: invariant._onednn_product(x, linear.weight, None))  # noqa: E731
    floor = invariant.min_rows(torch.float32) or invariant.BLOCK_ROWS
    ways = {"fp32": (fp32, torch.float32, onednn),
            "fp32-floor": (fp32, torch.float32, lambda lin: padded_to(onednn(lin), floor)),
            "bf16": (bf16, torch.bfloat16, onednn)}
    for rows in args.blocks:
        ways[f"bf16-b{rows}"] = (bf16, torch.bfloat16, lambda lin, rows=rows: in_blocks(onednn(lin), rows))
    print(f"{args.threads} threads; float32 floor {invariant.min_rows(torch.float32)}, "
          f"bfloat16 floor {invariant.min_rows(torch.bfloat16)} (None: fixed-size calls)")
    print("rows " + " ".join(f"{name:>11}" for name in ways))
    with torch.inference_mode():
        for m in args.rows:
            cells = [sum(best_ms(way(lin), torch.randn(m, k).to(dtype)) for lin, (k, _) in zip(linears, SHAPES))
                     for linears, dtype, way in ways.values()]
            print(f"{m:>4} " + " ".join(f"{ms:>11.3f}" for ms in cells))

if __name__ == "__main__":
    main()
