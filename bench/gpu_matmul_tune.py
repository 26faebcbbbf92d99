"""Tile configs of the batch-invariant matmul, timed against cuBLAS and the memory bound; the fastest exact plans.

    python bench/gpu_matmul_tune.py                                   # llama-1b's projections, bf16, on cuda
    python bench/gpu_matmul_tune.py --json tune.json --save plans.json
    python bench/gpu_matmul_tune.py --model llama-8b --rows 1 16 256 4096
    python bench/gpu_matmul_tune.py --shapes 3072x2048 2048x8192 --tma --persistent --block-k 64 128
    python bench/gpu_matmul_tune.py --device cpu                      # Triton's interpreter, tiny shapes: seconds

For each projection shape N x K of ``--model`` (a recipe of daskllm.models; default llama-1b:
qkv, o, gate_up, down, lm_head) or of ``--shapes``, and each of ``--rows``, on x [rows, K] by a
weight [N, K] (no bias):

* every candidate config (``daskllm.engines.triton_kernels.matmul.MatmulConfig``): the default
  plan's configs for the shape, and per ``--block-k`` a sweep: for 16-bit dtypes small-M tiles
  (64 rows, 16..128 columns, 4..8 stages) and large ones (128 x 128, 128 x 256, 256 x 128), for
  float32 FMA tiles of 16..128 rows; with ``--tma`` and ``--persistent``, each also with
  tensor-memory-accelerator loads and/or a persistent schedule;
* cuBLAS (``F.linear``), the memory bound (x, weight and output bytes over the measured copy
  bandwidth) and each time's compute rate (TFLOP/s);
* each candidate's bits against its family's anchor (the default plan's reference config, or
  the 128 x 256 tile of another ``block_k``) at ``--check-rows`` (default 1 7 64 200), on the
  rows taken first and taken last (``matmul.bit_differences``). A candidate with other bits is
  marked and never chosen.

Timing on cuda: after warm-up (compiling), each measurement is a CUDA graph of back-to-back
launches (so Python's launch cost is not timed) cycling through enough copies of x and the
weight to exceed three times the L2 cache, timed with CUDA events; the median of ``--repeats``
replays, per launch. On cpu (the interpreter, for the test suite) it is wall time and means
nothing.

The best invariant plan of a shape: in each family whose candidates share the anchor's bits,
the fastest candidate per row count, consecutive row counts with the same winner merged (a
winner covers the row counts up to its own); the family whose plan has the smallest geometric
mean of time over cuBLAS's wins. Printed: a markdown table per shape (microseconds and TFLOP/s
per row count, the best plan's cell per column in bold), then a summary of the best plans
against cuBLAS, the memory bound and the default plan. ``--json`` keeps every number,
``--save`` the chosen plans as ``matmul.load_plans`` reads them; both are rewritten after each
shape, so a killed run leaves what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from machine import log, machine_info

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_ROWS = (1, 8, 32, 128, 256, 1024, 8192)
CPU_ROWS = (1, 8, 40)
GPU_CHECK_ROWS = (1, 7, 64, 200)
CPU_CHECK_ROWS = (1, 7, 20)
CPU_SHAPES = ("96x64", "48x160")  # one K step and several, neither N a multiple of every block_n
GRAPH_MS = 2.0  # a timed graph replay lasts about this long
MAX_COPIES = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default where there is one) or cpu (Triton's interpreter, tiny shapes)")
    p.add_argument("--model", default="llama-1b", help="a recipe of daskllm.models whose projections to tune")
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="explicit weight shapes instead of --model's")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--rows", nargs="+", type=int, help=f"row counts (default: {GPU_ROWS}; cpu {CPU_ROWS})")
    p.add_argument("--check-rows", nargs="+", type=int,
                   help=f"row counts of the bits check (default: {GPU_CHECK_ROWS}; cpu {CPU_CHECK_ROWS})")
    p.add_argument("--block-k", nargs="+", type=int, help="families to sweep (default: the default plan's block_k)")
    p.add_argument("--tma", action="store_true", help="also each candidate with TMA loads (cuda capability >= 9)")
    p.add_argument("--persistent", action="store_true", help="also each candidate with a persistent schedule")
    p.add_argument("--repeats", type=int, help="timed replays per measurement, the median reported (default 7; cpu 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="every number, rewritten after each shape")
    p.add_argument("--save", metavar="PATH", help="the best invariant plans (matmul.load_plans), after each shape")
    args = p.parse_args(argv)
    on_cpu = args.device == "cpu"
    args.rows = sorted(set(args.rows or (CPU_ROWS if on_cpu else GPU_ROWS)))
    args.check_rows = sorted(set(args.check_rows or (CPU_CHECK_ROWS if on_cpu else GPU_CHECK_ROWS)))
    args.repeats = args.repeats or (1 if on_cpu else 7)
    if on_cpu and not args.shapes:
        args.shapes = list(CPU_SHAPES)
    if min(args.rows + args.check_rows) < 1:
        p.error("--rows and --check-rows must be positive")
    if args.shapes:
        sides = [s.lower().split("x") for s in args.shapes]
        if any(len(side) != 2 or not all(x.isdigit() and int(x) > 0 for x in side) for side in sides):
            p.error("--shapes are NxK, e.g. 3072x2048")
        args.shape_list = [("weight", int(n), int(k)) for n, k in sides]
    else:
        from daskllm import models

        if not isinstance(models.RECIPES.get(args.model), models.ModelRecipe):
            p.error(f"--model must be a generated recipe of daskllm.models, not {args.model!r}")
        args.shape_list = model_shapes(models.RECIPES[args.model])
    return args


def model_shapes(r) -> list[tuple[str, int, int]]:
    """(name, N, K) of each projection of a models.ModelRecipe: the weights a TorchEngine holds a Product for."""
    kv = 2 * r.num_key_value_heads * r.head_dim
    return [("qkv", r.hidden_size + kv, r.hidden_size), ("o", r.hidden_size, r.hidden_size),
            ("gate_up", 2 * r.intermediate_size, r.hidden_size), ("down", r.hidden_size, r.intermediate_size),
            ("lm_head", r.vocab_size, r.hidden_size)]


def candidates(mm, n: int, dtype: torch.dtype, capability, args) -> list[tuple[object, list]]:
    """(anchor, configs) per family of one block_k: every config obeys the plan rules with its anchor."""
    C = mm.MatmulConfig
    default = [cfg for _, cfg in mm.default_plan(n, dtype, capability)]
    reference = default[-1]
    precision = reference.precision
    families = []
    for bk in args.block_k or [reference.block_k]:
        if args.device == "cpu":  # the interpreter runs a program at a time: a few small tiles
            sweep = [C(64, 32, bk, 4, 2, precision=precision), C(128, 32, bk, 8, 2, precision=precision)]
        elif dtype == torch.float32:
            sweep = [C(m, bn, bk, 4, s, precision=precision) for m in (16, 32) for bn in (32, 64) for s in (3, 5)]
            sweep += [C(64, 64, bk, 4, 3, precision=precision), C(64, 128, bk, 4, 3, precision=precision),
                      C(128, 128, bk, 8, 3, precision=precision)]
        else:
            deep = (4, 6, 8) if bk <= 64 else (3, 4)
            sweep = [C(64, bn, bk, 4, s) for bn in (16, 32, 64, 128) for s in deep]
            sweep += [C(128, 128, bk, w, s) for w in (4, 8) for s in ((3, 4) if bk <= 64 else (2,))]
            sweep += [C(128, 256, bk, 8, 3 if bk <= 64 else 2), C(256, 128, bk, 8, 3 if bk <= 64 else 2)]
        anchor = reference if bk == reference.block_k else dataclasses.replace(
            reference, block_m=128 if dtype != torch.float32 else 64, block_k=bk, num_stages=2)
        family = [anchor] + [c for c in dict.fromkeys(default + sweep) if c.block_k == bk and c != anchor]
        for flag in ("tma", "persistent"):
            if getattr(args, flag):
                family += [dataclasses.replace(c, **{flag: True}) for c in family]
        families.append((anchor, [c for c in family if c == anchor or not mm.plan_problems(((1, c), (None, anchor)),
                                                                                            dtype)]))
    return families


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy rate in bytes/s, read + write, best of 5: what a memory-bound product can reach."""
    src = torch.ones((1 << 30) if device != "cpu" else (1 << 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocator, not bandwidth
    best = math.inf
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def time_ms(launch, copies: int, device: str, repeats: int) -> float:
    """Milliseconds per launch of ``launch(i)`` (copy i), median of ``repeats``; warmed up first."""
    for i in range(copies):
        launch(i)
    if device == "cpu":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            launch(0)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch(0)
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    n = copies * max(1, math.ceil(min(GRAPH_MS / once, 256) / copies))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            launch(i % copies)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def best_plan(family: list[dict], rows: list[int]) -> tuple | None:
    """The fastest invariant candidate per row count as a plan ((max_rows, config) ..., (None, config))."""
    exact = [c for c in family if c["same_bits"] and all(c["ms"].get(str(r)) is not None for r in rows)]
    if not exact:
        return None
    winners = [min(exact, key=lambda c: c["ms"][str(r)]) for r in rows]
    plan = []
    for r, winner in zip(rows, winners):
        if plan and plan[-1][1] is winner:
            plan[-1] = (r, winner)
        else:
            plan.append((r, winner))
    return tuple((limit, c) for limit, c in plan[:-1]) + ((None, plan[-1][1]),)


def tune_shape(mm, name: str, n: int, k: int, args, bandwidth: float) -> dict:
    device, dtype = args.device, DTYPES[args.dtype]
    capability = torch.cuda.get_device_capability(device) if device != "cpu" else None
    gen = torch.Generator().manual_seed(args.seed)
    weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype)
    size = dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device != "cpu" else 0
    copies_for = {r: max(1, min(MAX_COPIES, math.ceil(3 * l2 / ((r + n) * k * size)))) for r in args.rows}
    weights = [weight] + [weight.clone() for _ in range(max(copies_for.values()) - 1)]
    xs = {r: [torch.randn(r, k, generator=gen).to(device, dtype) for _ in range(copies_for[r])] for r in args.rows}

    def timed(product) -> dict:
        return {str(r): time_ms(lambda i, r=r: product(xs[r][i], weights[i]), copies_for[r], device, args.repeats)
                for r in args.rows}

    record = {"name": name, "n": n, "k": k, "dtype": args.dtype, "rows": args.rows, "copies": copies_for,
              "bound_ms": {str(r): (r * k + n * k + r * n) * size / bandwidth * 1e3 for r in args.rows},
              "cublas_ms": timed(F.linear), "families": [],
              "default_plan": [[limit, cfg.label] for limit, cfg in mm.default_plan(n, dtype, capability)]}
    families = candidates(mm, n, dtype, capability, args)
    if device != "cpu":  # every candidate compiled first, on 8 threads at once (M is never specialized)
        from daskllm.engines.triton_kernels import compile_only

        with compile_only(workers=8):
            for _, configs in families:
                for cfg in configs:
                    mm.run_config(xs[args.rows[0]][0], weight, None, cfg)
    for anchor, configs in families:
        family = []
        for cfg in configs:
            entry = {"config": dataclasses.asdict(cfg), "label": cfg.label, "ms": {}, "bits": [], "error": None}
            log(f"{name} {n}x{k}: {cfg.label}")
            try:
                entry["bits"] = mm.bit_differences(weight, None, cfg, anchor, args.check_rows, args.seed)
                entry["ms"] = timed(lambda x, w, cfg=cfg: mm.run_config(x, w, None, cfg))
            except Exception as error:  # e.g. more shared memory than the device has
                entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            entry["same_bits"] = entry["error"] is None and not any(f or la for _, f, la in entry["bits"])
            family.append(entry)
        plan = best_plan(family, args.rows)
        record["families"].append({"anchor": anchor.label, "block_k": anchor.block_k, "candidates": family,
                                   "plan": plan})
    scored = [(_score(f["plan"], record), f) for f in record["families"] if f["plan"]]
    best = min(scored, key=lambda s: s[0])[1] if scored else None
    record["best_plan"] = ([{"max_rows": limit, "label": c["label"], "config": c["config"]}
                            for limit, c in best["plan"]] if best else None)
    for f in record["families"]:  # JSON: a plan by labels (its candidates hold the numbers)
        f["plan"] = [[limit, c["label"]] for limit, c in f["plan"]] if f["plan"] else None
    return record


def _score(plan, record) -> float:
    """Geometric mean over the row counts of the plan's time over cuBLAS's."""
    ratios = [_plan_ms(plan, r) / record["cublas_ms"][str(r)] for r in record["rows"]]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _plan_ms(plan, rows: int) -> float:
    return next(c for limit, c in plan if limit is None or rows <= limit)["ms"][str(rows)]


def _cell(ms: float | None, flop: float, bold: bool = False) -> str:
    if ms is None:
        return "-"
    text = f"{ms * 1e3:.1f} µs {flop / ms / 1e9:.0f} TF/s"
    return f"**{text}**" if bold else text


def tables(record: dict) -> str:
    rows = record["rows"]
    flop = {r: 2.0 * r * record["n"] * record["k"] for r in rows}
    best = record["best_plan"] or []
    chosen = {r: next((e["label"] for e in best if e["max_rows"] is None or r <= e["max_rows"]), None) for r in rows}
    head = " | ".join(f"{r} rows" for r in rows)
    lines = [f"### {record['name']}: {record['n']}x{record['k']} {record['dtype']}", "",
             f"| config | bits | {head} |", "|---|---|" + "---:|" * len(rows),
             "| cuBLAS (F.linear) | - | " + " | ".join(_cell(record["cublas_ms"][str(r)], flop[r]) for r in rows)
             + " |",
             "| memory bound | - | " + " | ".join(_cell(record["bound_ms"][str(r)], flop[r]) for r in rows) + " |"]
    for family in record["families"]:
        for c in family["candidates"]:
            if c["error"]:
                bits = f"does not run: {c['error']}"
            elif c["same_bits"]:
                bits = "same" if c["label"] != family["anchor"] else "anchor"
            else:
                bits = "**differ**: " + ", ".join(f"{r} ({f}/{la})" for r, f, la in c["bits"] if f or la)
            cells = [_cell(c["ms"].get(str(r)), flop[r], chosen[r] == c["label"] and c["same_bits"]) for r in rows]
            lines.append(f"| {c['label']} | {bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    """Per shape and row count: the best invariant plan's time against cuBLAS, the bound and the default plan."""
    lines = ["| shape | rows | best invariant plan's config | µs | / cuBLAS | / memory bound | default plan µs |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for rec in records:
        ms_of = {c["label"]: c["ms"] for f in rec["families"] for c in f["candidates"]}
        for r in rec["rows"]:
            default = ms_of.get(next(label for limit, label in rec["default_plan"] if limit is None or r <= limit), {})
            default_us = f"{default[str(r)] * 1e3:.1f}" if str(r) in default else "-"
            if not rec["best_plan"]:
                lines.append(f"| {rec['name']} | {r} | no invariant candidate | - | - | - | {default_us} |")
                continue
            entry = next(e for e in rec["best_plan"] if e["max_rows"] is None or r <= e["max_rows"])
            ms = ms_of[entry["label"]][str(r)]
            lines.append(f"| {rec['name']} {rec['n']}x{rec['k']} | {r} | {entry['label']} | {ms * 1e3:.1f} | "
                         f"{ms / rec['cublas_ms'][str(r)]:.2f} | {ms / rec['bound_ms'][str(r)]:.2f} | {default_us} |")
    return "\n".join(lines)


def write(args, device_name: str, capability, bandwidth: float, records: list[dict]) -> None:
    if args.json:
        info = {"device": device_name, "capability": capability, "copy_bytes_per_s": bandwidth,
                "machine": machine_info(triton=_triton_version()),
                "args": {k: v for k, v in vars(args).items() if k != "shape_list"}, "shapes": records}
        pathlib.Path(args.json).write_text(json.dumps(info, indent=1))
    if args.save:
        plans = [{"n": rec["n"], "k": rec["k"], "dtype": rec["dtype"],
                  "plan": [{"max_rows": e["max_rows"], "config": e["config"]} for e in rec["best_plan"]]}
                 for rec in records if rec["best_plan"]]
        pathlib.Path(args.save).write_text(json.dumps({"device": device_name, "capability": capability,
                                                       "plans": plans}, indent=1))


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.triton_interpreter import on_device

    interpreter = on_device(args.device)
    if args.device == "cpu":
        device_name, capability = "cpu (Triton's interpreter)", None
    else:
        device_name, capability = torch.cuda.get_device_name(args.device), torch.cuda.get_device_capability(args.device)
        if args.tma and capability[0] < 9:
            sys.exit(f"--tma needs CUDA capability 9.0 or later; {device_name} has {capability}")
    bandwidth = copy_bandwidth(args.device)
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {device_name}")
    records = []
    with interpreter:
        mm = importlib.import_module("daskllm.engines.triton_kernels.matmul")
        for name, n, k in args.shape_list:
            records.append(tune_shape(mm, name, n, k, args, bandwidth))
            write(args, device_name, capability, bandwidth, records)
            print(tables(records[-1]) + "\n", flush=True)
    print(f"Best invariant plans on {device_name} ({args.dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s):\n")
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
