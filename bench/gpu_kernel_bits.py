"""Row by row, bit for bit: the torch engine's Triton kernels give a row the same bits whatever the batch.

    python bench/gpu_kernel_bits.py                       # on a GPU: bf16 and fp32, 1..512 rows
    python bench/gpu_kernel_bits.py --json bits.json --rows 1 7 64 65 1024
    python bench/gpu_kernel_bits.py --device cpu          # Triton's interpreter, small shapes: half a minute

For each dtype and kernel of ``daskllm.engines.triton_kernels``, the largest batch (the most of
``--rows``) runs once; then each smaller row count runs on the batch's first rows and on its
last rows (so a row sits at another place in its tile, or in another tile), and every row
must have the bits it had in the largest batch. Exit status 1 if any row differs, except on
an attention fast path that ``self_check`` found differing (the engine does not use it).

* ``matmul``: x [R, hidden] by a [out, hidden] weight and a bias (default: Llama-3.2-1B's
  q/k/v projection, 2,048 to 3,072).
* ``rms_norm``: x [R, hidden].
* ``paged_attention``: R query positions of one sequence after ``--prefix`` cached ones (a
  prefill chunk), tiled as the engine tiles them (``positions_per_tile(group)`` positions from
  the chunk's first, tiles of ``PREFILL_ROWS`` rows, one program per tile and KV head folding
  the context's chunks); the cache in blocks of ``--block-size``, its block table shuffled. A
  smaller count is the chunk's first or last positions, so its tiles start elsewhere and its
  key loop stops elsewhere.
* ``paged_attention/split``, ``paged_attention/decode``, ``paged_attention/decode+split``: the
  same rows split over the context (``--split-chunks`` programs a tile), each as a decode (a
  tile of one position, ``DECODE_ROWS`` rows: mma.sync rather than wgmma on a Hopper), and
  both. Their rows are compared with ``paged_attention``'s largest batch, so a row whose bits
  depend on the path differs. On a GPU, ``self_check`` (what the engine runs at load to choose
  its paths) is printed too.

On ``--device cpu`` the kernels run under Triton's interpreter as the test suite runs them
(tests/triton_interpreter.py: float products summed over K in index order), which checks the
kernels' logic, not a GPU's arithmetic. bench/gpu_check.sh runs this on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_ROWS = (1, 2, 3, 7, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 140, 255, 256, 257, 512)
CPU_ROWS = (1, 3, 21, 22)  # 22: two prefill tiles of the group of 6
# (hidden, out, heads, kv_heads, head_dim, block_size, prefix, chunk_keys): Llama-3.2-1B's
# shapes on a GPU (up to 1,512 keys: three chunks); small ones, none a power of two where the
# kernels allow it, under the interpreter, with chunks of one key tile so that they cross chunks.
GPU_SHAPES = (2048, 3072, 32, 8, 64, 16, 1000, None)
CPU_SHAPES = (72, 80, 12, 2, 24, 8, 100, 64)
# The attention's fast paths, by the self_check entry that says whether the engine uses them.
FAST_PATHS = {"paged_attention/split": "split", "paged_attention/decode": "decode_tile",
              "paged_attention/decode+split": "split_decode_tile"}
KERNELS = ("matmul", "rms_norm", "paged_attention", *FAST_PATHS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default where there is one) or cpu (Triton's interpreter, small shapes)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--rows", nargs="+", type=int, help=f"row counts (default: {GPU_ROWS} on cuda, {CPU_ROWS} on cpu)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--out", type=int, help="the matmul's output features")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--block-size", type=int, help="KV cache positions per block")
    p.add_argument("--prefix", type=int, help="cached positions before the attention's query rows")
    p.add_argument("--chunk-keys", type=int, help="the attention's chunk (default: CHUNK_KEYS on cuda, 64 on cpu)")
    p.add_argument("--split-chunks", type=int, default=2, help="programs a tile on the split attention paths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every comparison here")
    args = p.parse_args(argv)
    on_cpu = args.device == "cpu"
    args.rows = sorted(set(args.rows or (CPU_ROWS if on_cpu else GPU_ROWS)))
    names = ("hidden", "out", "heads", "kv_heads", "head_dim", "block_size", "prefix", "chunk_keys")
    for name, default in zip(names, CPU_SHAPES if on_cpu else GPU_SHAPES):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if min(args.rows) < 1 or args.split_chunks < 1:
        p.error("--rows and --split-chunks must be positive")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


def differing_rows(want: torch.Tensor, got: torch.Tensor) -> tuple[int, float]:
    """How many rows of ``got`` differ in any bit from ``want``'s, and the largest difference."""
    differs = (want.reshape(want.shape[0], -1) != got.reshape(got.shape[0], -1)).any(dim=1)
    return int(differs.sum()), float((want.float() - got.float()).abs().max()) if differs.any() else 0.0


def attention_cases(tk, args, dtype, device, gen) -> dict:
    """Each attention path: (rows [lo, hi) of the chunk's attention, torch's float32 softmax
    attention of the whole chunk, the path whose largest batch its rows must equal)."""
    attention = tk.attention
    rows = max(args.rows)
    n_blocks = -(-(args.prefix + rows) // args.block_size)
    shape = (n_blocks + 1, args.kv_heads, args.block_size, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    table = torch.randperm(n_blocks + 1, generator=gen)[:n_blocks].to(device, torch.int32)
    q = torch.randn(rows, args.heads, args.head_dim, generator=gen).to(device, dtype)
    group = args.heads // args.kv_heads
    per_tile, decode_rows = attention.positions_per_tile(group), attention.fast_layout(group).decode_rows
    chunk_keys = args.chunk_keys or attention.CHUNK_KEYS

    def path(decode: bool, split: int):
        def run(lo: int, hi: int) -> torch.Tensor:
            step = 1 if decode else per_tile
            tiles = [(0, t0 - lo, min(step, hi - t0), args.prefix + t0) for t0 in range(lo, hi, step)]
            return attention.paged_attention(q[lo:hi].contiguous(), k_cache, v_cache,
                                             torch.tensor(tiles, dtype=torch.int32, device=device), table[None, :],
                                             tile_rows=decode_rows if decode else attention.PREFILL_ROWS,
                                             split_chunks=split, chunk_keys=chunk_keys)
        return run

    def sequence(cache: torch.Tensor) -> torch.Tensor:  # [heads, positions, head_dim], float32
        flat = cache[table.long()].transpose(0, 1).reshape(args.kv_heads, -1, args.head_dim)
        return flat[:, :args.prefix + rows].float().repeat_interleave(args.heads // args.kv_heads, 0)

    positions = torch.arange(args.prefix + rows, device=device)
    causal = positions[None, :] <= positions[args.prefix:, None]
    reference = F.scaled_dot_product_attention(q.float().transpose(0, 1), sequence(k_cache), sequence(v_cache),
                                               attn_mask=causal).transpose(0, 1)
    paths = {"paged_attention": (False, 0), "paged_attention/split": (False, args.split_chunks),
             "paged_attention/decode": (True, 0), "paged_attention/decode+split": (True, args.split_chunks)}
    return {name: (path(*how), reference, "paged_attention") for name, how in paths.items()}


def kernel_cases(tk, args, dtype, device) -> dict:
    """Kernel name -> (a function computing rows [lo, hi) of its largest batch, torch's float32
    result, the kernel whose largest batch its rows are compared with)."""
    from daskllm.engines.backends import rms_norm

    gen = torch.Generator().manual_seed(args.seed)
    rows = max(args.rows)
    x = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    w = (torch.randn(args.out, args.hidden, generator=gen) * args.hidden ** -0.5).to(device, dtype)
    b = torch.randn(args.out, generator=gen).to(device, dtype)
    norm_w = torch.randn(args.hidden, generator=gen).to(device, dtype)
    return {
        "matmul": (lambda lo, hi: tk.matmul(x[lo:hi], w, b), F.linear(x.float(), w.float(), b.float()), "matmul"),
        "rms_norm": (lambda lo, hi: tk.rms_norm(x[lo:hi], norm_w, 1e-5), rms_norm(x.float(), norm_w.float(), 1e-5),
                     "rms_norm"),
        **attention_cases(tk, args, dtype, device, gen),
    }


def check(tk, args, checked: dict) -> list[dict]:
    """One record per kernel, dtype and row count: rows differing taken first and taken last.
    ``counted`` is False for a fast path that ``checked`` (self_check by dtype) found differing:
    the engine does not use it, so its rows differing fail nothing."""
    results = []
    rows = max(args.rows)
    for dtype_name in args.dtypes:
        cases = kernel_cases(tk, args, DTYPES[dtype_name], args.device)
        largest = {}
        for kernel in args.kernels:
            run, reference, baseline = cases[kernel]
            for name in dict.fromkeys((baseline, kernel)):  # a fast path's baseline, even if not selected
                if name not in largest:
                    largest[name] = cases[name][0](0, rows)
            off = float((largest[kernel].float() - reference).abs().max())
            counted = kernel not in FAST_PATHS or checked.get(dtype_name, {}).get(FAST_PATHS[kernel], True)
            for r in args.rows:
                first, first_diff = differing_rows(largest[baseline][:r], run(0, r))
                last, last_diff = differing_rows(largest[baseline][rows - r:], run(rows - r, rows))
                results.append({"kernel": kernel, "dtype": dtype_name, "rows": r, "first_differing": first,
                                "last_differing": last, "max_abs_diff": max(first_diff, last_diff),
                                "torch_abs_diff": off, "counted": counted})
    return results


def self_checks(tk, args) -> dict:
    """``attention.self_check`` for each dtype at the attention's shapes, its layout as a dict
    (a GPU's answer; the interpreter's is tests/test_triton_attention.py's)."""
    found = {name: tk.attention.self_check(args.device, DTYPES[name], args.heads, args.kv_heads, args.head_dim,
                                           args.block_size) for name in args.dtypes}
    return {name: {**result, "layout": dataclasses.asdict(result["layout"])} for name, result in found.items()}


def tables(results: list[dict], largest: int) -> str:
    def cell(n: int, r: int) -> str:
        return "same bits" if not n else f"**{n} of {r} differ**"

    def name(x: dict) -> str:
        return x["kernel"] if x["counted"] else f"{x['kernel']} (unused: self_check found it differ)"

    lines = [f"| kernel | dtype | rows | the first rows of {largest} | the last rows | max abs diff |",
             "|---|---|---:|---|---|---:|"]
    lines += [f"| {name(x)} | {x['dtype']} | {x['rows']} | {cell(x['first_differing'], x['rows'])} | "
              f"{cell(x['last_differing'], x['rows'])} | {x['max_abs_diff']:.3g} |" for x in results]
    lines += ["", f"| kernel | dtype | {largest} rows: max abs diff from torch in float32 |", "|---|---|---:|"]
    lines += [f"| {kernel} | {dtype} | {diff:.3g} |" for kernel, dtype, diff in
              dict.fromkeys((x["kernel"], x["dtype"], x["torch_abs_diff"]) for x in results)]
    return "\n".join(lines)


def summary(results: list[dict]) -> tuple[str, bool]:
    """The verdict's line, and whether it fails: a counted comparison with a row differing."""
    differ = [x for x in results if x["first_differing"] or x["last_differing"]]
    bad = [x for x in differ if x["counted"]]
    unused = f"; the {len(differ) - len(bad)} others on paths self_check turned off" if len(differ) > len(bad) else ""
    return f"{len(results) - len(differ)} of {len(results)} comparisons bit for bit equal{unused}", bool(bad)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.triton_interpreter import on_device

    interpreter = on_device(args.device)
    with interpreter:
        from daskllm.engines import triton_kernels

        attends = any(k.startswith("paged_attention") for k in args.kernels)
        if args.device != "cpu":  # every launch below compiled first, on 8 threads at once (nothing read)
            with triton_kernels.compile_only(workers=8):
                check(triton_kernels, args, self_checks(triton_kernels, args) if attends else {})
        checked = self_checks(triton_kernels, args) if args.device != "cpu" and attends else {}
        results = check(triton_kernels, args, checked)
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu (Triton's interpreter)"
    print(f"Triton kernels, row bits against the largest batch ({max(args.rows)} rows), on {device}:\n")
    print(tables(results, max(args.rows)))
    for name, found in checked.items():
        print(f"\nattention.self_check({name}): {found}")
    line, failed = summary(results)
    print(f"\n{line}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": device, "args": vars(args), "results": results,
                                                       "self_check": checked},
                                                      indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
