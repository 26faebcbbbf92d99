"""Benchmark of the embedded torch engine, measured directly (no Dask).

    python bench/engine.py --models tiny small --batch-sizes 1 8 32 --json out.json
    python bench/engine.py --quick          # smoke run: tiny only, batch sizes 1 and 8

What it measures, per model:

* prefill tokens/s at each batch size: B distinct random prompts of ``--prompt-tokens``
  tokens, ``max_tokens=1``; total prompt tokens / wall time of the batch. Every prompt
  is fresh (random token ids from a seeded RNG), so the prefix cache cannot help, and the
  run checks that it did not (``num_cached_tokens == 0``).
* decode tokens/s at each batch size: B short prompts, ``max_tokens=--decode-tokens``,
  ``ignore_eos``; total generated tokens / wall time of the batch. The wall time includes
  the one prefill step of the short prompts (which also yields the first token), so this
  slightly understates the pure decode rate.
* prefix cache: time to first token (``max_tokens=1``) of a ``--prefix-tokens`` prefix +
  a short suffix, cold versus after ``engine.prefill(prefix)``; each uses its own fresh
  prefix, so the cold one is really cold.
* batching: ``--batched-requests`` greedy requests of ``--batched-tokens`` tokens each,
  submitted together versus one after another (each waiting for the last) on the same
  engine; wall-time ratio, and a check that the tokens are identical both ways. The
  one-at-a-time run is slow (about a minute for ``small``), so only the first repetition
  always runs it; later ones do while ``--sequential-budget`` seconds are not spent.

Measurements are interleaved (every repetition runs every measurement once) and the
median of ``--repeats`` is reported, because the machine is shared and noisy. The JSON
keeps every raw number plus machine information. Exits with status 1 if batched and
sequential greedy tokens ever differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from machine import log
from machine import machine_info as shared_machine_info

from daskllm.engines.protocol import SamplingParams
from daskllm.engines.torch_engine import TorchEngine

FIRST_ORDINARY_TOKEN = 5  # ids 0..4 are the special tokens of the shared tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "small"], help="recipe names or model directories")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement; the median is reported")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length for the prefill measurement")
    p.add_argument("--short-prompt-tokens", type=int, default=16,
                   help="prompt length for the decode and batching measurements")
    p.add_argument("--decode-tokens", type=int, default=64, help="max_tokens for the decode measurement")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix length for the cache measurement")
    p.add_argument("--suffix-tokens", type=int, default=16, help="suffix length after the shared prefix")
    p.add_argument("--batched-requests", type=int, default=32, help="requests in the batched-vs-sequential test")
    p.add_argument("--batched-tokens", type=int, default=32, help="max_tokens in the batched-vs-sequential test")
    p.add_argument("--sequential-budget", type=float, default=20.0, metavar="SECONDS",
                   help="the slow one-at-a-time run always runs in the first repetition, and in later ones only "
                        "while the time spent on it so far is under this budget (small: once; tiny: every time)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt RNG")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny only, batch sizes 1 and 8, fewer and shorter requests")
    args = p.parse_args(argv)
    if args.quick:
        args.models = ["tiny"]
        args.batch_sizes = [1, 8]
        args.repeats = 1
        args.prompt_tokens = 64
        args.decode_tokens = 16
        args.prefix_tokens = 128
        args.batched_requests = 8
        args.batched_tokens = 8
    for name in ("repeats", "prompt_tokens", "short_prompt_tokens", "decode_tokens", "prefix_tokens",
                 "suffix_tokens", "batched_requests", "batched_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        p.error("--batch-sizes must be >= 1")
    return args


def machine_info() -> dict:
    return shared_machine_info(torch_interop_threads=torch.get_num_interop_threads())


class Prompts:
    """Fresh random token-id prompts: distinct from their first token, so nothing is cached."""

    def __init__(self, seed: int, vocab_size: int):
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def make(self, n: int, length: int) -> list[list[int]]:
        return self.rng.integers(FIRST_ORDINARY_TOKEN, self.vocab_size, size=(n, length)).tolist()


def run_together(engine: TorchEngine, prompts, params: SamplingParams) -> tuple[float, list]:
    """Submit all prompts at once and wait for all; returns (wall seconds, completions).

    ``submit_many`` queues them atomically, so the engine's first step holds all B requests.
    """
    start = time.perf_counter()
    completions = [f.result() for f in engine.submit_many(prompts, params)]
    return time.perf_counter() - start, completions


def run_one_at_a_time(engine: TorchEngine, prompts, params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    completions = [engine.submit(p, params).result() for p in prompts]
    return time.perf_counter() - start, completions


def stats_delta(before, after) -> dict:
    keys = ("steps", "batched_sequences", "prefill_tokens_computed", "prefill_tokens_cached", "decode_tokens",
            "busy_seconds", "preemptions", "evicted_blocks")
    d = {k: getattr(after, k) - getattr(before, k) for k in keys}
    d["mean_batch_size"] = d["batched_sequences"] / d["steps"] if d["steps"] else 0.0
    return d


def measured(engine, fn, *a):
    before = engine.stats()
    seconds, completions = fn(engine, *a)
    return seconds, completions, stats_delta(before, engine.stats())


def measure_prefill(engine, prompts: Prompts, batch: int, length: int) -> dict:
    seconds, completions, delta = measured(engine, run_together, prompts.make(batch, length),
                                           SamplingParams(max_tokens=1))
    cached = sum(c.num_cached_tokens for c in completions)
    if cached:
        raise RuntimeError(f"prefill prompts were meant to be uncached, but {cached} tokens came from the cache")
    tokens = batch * length
    return {"batch": batch, "prompt_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "stats": delta}


def measure_decode(engine, prompts: Prompts, batch: int, prompt_len: int, max_tokens: int) -> dict:
    seconds, completions, delta = measured(engine, run_together, prompts.make(batch, prompt_len),
                                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    generated = sum(len(c.token_ids) for c in completions)
    return {"batch": batch, "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "ms_per_step": 1000 * seconds / max_tokens, "stats": delta}


def measure_prefix_cache(engine, prompts: Prompts, prefix_len: int, suffix_len: int) -> dict:
    one = SamplingParams(max_tokens=1)
    cold_prefix, warm_prefix = prompts.make(2, prefix_len)
    cold_prompt = cold_prefix + prompts.make(1, suffix_len)[0]
    warm_prompt = warm_prefix + prompts.make(1, suffix_len)[0]
    cold_s, (cold,), _ = measured(engine, run_one_at_a_time, [cold_prompt], one)
    start = time.perf_counter()
    handle = engine.prefill(warm_prefix)
    prefill_s = time.perf_counter() - start
    warm_s, (warm,), _ = measured(engine, run_one_at_a_time, [warm_prompt], one)
    return {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len,
            "cold_ttft_s": cold_s, "warm_ttft_s": warm_s, "speedup": cold_s / warm_s,
            "prefill_call_s": prefill_s, "prefill_handle_tokens": handle.num_tokens,
            "cold_num_cached_tokens": cold.num_cached_tokens, "warm_num_cached_tokens": warm.num_cached_tokens}


def measure_batching(engine, prompts: Prompts, n: int, prompt_len: int, max_tokens: int, sequential: bool,
                     sequential_first: bool) -> dict:
    # ignore_eos: every request does the same work, whichever way it runs.
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    batch = prompts.make(n, prompt_len)
    runs = {}
    order = ("sequential", "batched") if sequential_first else ("batched", "sequential")
    for mode in order:
        if mode == "sequential" and not sequential:
            continue
        fn = run_together if mode == "batched" else run_one_at_a_time
        seconds, completions, delta = measured(engine, fn, batch, params)
        runs[mode] = {"seconds": seconds, "tokens": [c.token_ids for c in completions], "stats": delta,
                      "num_cached_tokens": sum(c.num_cached_tokens for c in completions)}
    out = {"requests": n, "max_tokens": max_tokens, "order": [m for m in order if m in runs],
           "batched_s": runs["batched"]["seconds"], "batched_stats": runs["batched"]["stats"]}
    if "sequential" in runs:
        out.update(sequential_s=runs["sequential"]["seconds"], sequential_stats=runs["sequential"]["stats"],
                   speedup=runs["sequential"]["seconds"] / runs["batched"]["seconds"],
                   identical=runs["sequential"]["tokens"] == runs["batched"]["tokens"],
                   num_cached_tokens={m: r["num_cached_tokens"] for m, r in runs.items()})
    return out


def warm_up(engine, prompts: Prompts, args) -> None:
    """One pass over the shapes the benchmark uses, so first-call costs are not timed."""
    run_together(engine, prompts.make(min(4, max(args.batch_sizes)), args.prompt_tokens), SamplingParams(max_tokens=1))
    run_together(engine, prompts.make(max(args.batch_sizes), args.short_prompt_tokens),
                 SamplingParams(max_tokens=4, ignore_eos=True))


def bench_model(model: str, args, log) -> dict:
    start = time.perf_counter()
    engine = TorchEngine(model, num_threads=args.threads)
    load_s = time.perf_counter() - start
    prompts = Prompts(args.seed, engine.model.config.vocab_size)
    cfg = engine.model.config
    weights = [engine.model.embed, engine.model.norm]
    weights += [t for layer in engine.model.layers for t in layer.values() if t is not None]
    if engine.model.lm_head is not engine.model.embed:
        weights.append(engine.model.lm_head)
    params = sum(t.numel() for t in weights)
    result = {"model": model, "load_s": load_s, "parameters": params, "layers": cfg.num_layers,
              "hidden_size": cfg.hidden_size, "block_size": engine.block_size,
              "max_num_batched_tokens": engine._scheduler.max_num_batched_tokens,
              "max_num_seqs": engine._scheduler.max_num_seqs,
              "kv_cache_tokens": engine.cache_state().num_blocks * engine.block_size,
              "device": str(engine.model.device), "dtype": str(engine.model.dtype),
              "prefill": [], "decode": [], "prefix_cache": [], "batching": []}
    try:
        warm_up(engine, prompts, args)
        sequential_spent = 0.0
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            for b in args.batch_sizes:
                result["prefill"].append({"rep": rep, **measure_prefill(engine, prompts, b, args.prompt_tokens)})
            for b in args.batch_sizes:
                result["decode"].append({"rep": rep, **measure_decode(engine, prompts, b, args.short_prompt_tokens,
                                                                      args.decode_tokens)})
            result["prefix_cache"].append({"rep": rep, **measure_prefix_cache(engine, prompts, args.prefix_tokens,
                                                                              args.suffix_tokens)})
            run_sequential = rep == 0 or sequential_spent < args.sequential_budget
            batching = measure_batching(engine, prompts, args.batched_requests, args.short_prompt_tokens,
                                        args.batched_tokens, run_sequential, sequential_first=rep % 2 == 1)
            sequential_spent += batching.get("sequential_s", 0.0)
            result["batching"].append({"rep": rep, **batching})
            log(f"  {model}: repetition {rep + 1}/{args.repeats} took {time.perf_counter() - t0:.1f}s")
        result["engine_stats"] = engine.stats().as_dict()
    finally:
        engine.close()
    result["summary"] = summarize(result)
    return result


def _median(values):
    values = list(values)
    return statistics.median(values) if values else float("nan")


def summarize(r: dict) -> dict:
    s = {"prefill_tokens_per_s": {}, "decode_tokens_per_s": {}, "decode_ms_per_step": {}}
    for b in sorted({x["batch"] for x in r["prefill"]}):
        s["prefill_tokens_per_s"][b] = _median(x["tokens_per_s"] for x in r["prefill"] if x["batch"] == b)
    for b in sorted({x["batch"] for x in r["decode"]}):
        s["decode_tokens_per_s"][b] = _median(x["tokens_per_s"] for x in r["decode"] if x["batch"] == b)
        s["decode_ms_per_step"][b] = _median(x["ms_per_step"] for x in r["decode"] if x["batch"] == b)
    pc = r["prefix_cache"]
    s["cold_ttft_s"] = _median(x["cold_ttft_s"] for x in pc)
    s["warm_ttft_s"] = _median(x["warm_ttft_s"] for x in pc)
    s["prefix_speedup"] = _median(x["speedup"] for x in pc)
    s["warm_num_cached_tokens"] = sorted({x["warm_num_cached_tokens"] for x in pc})
    s["cold_num_cached_tokens"] = sorted({x["cold_num_cached_tokens"] for x in pc})
    # Only repetitions that ran both ways, so the two columns and the ratio match up.
    seq = [x for x in r["batching"] if "sequential_s" in x]
    s["batched_s"] = _median(x["batched_s"] for x in seq)
    s["sequential_s"] = _median(x["sequential_s"] for x in seq)
    s["batching_speedup"] = _median(x["speedup"] for x in seq)
    s["batching_runs_compared"] = len(seq)
    s["batching_identical"] = all(x["identical"] for x in seq)
    return s


def markdown(results: list[dict], args) -> str:
    lines = []
    bs = args.batch_sizes
    lines.append("Prefill and decode throughput (tokens/s, median of %d)\n" % args.repeats)
    head = "| model | " + " | ".join(f"prefill B={b}" for b in bs) + " | " + " | ".join(
        f"decode B={b}" for b in bs) + " |"
    lines += [head, "|---|" + "---:|" * (2 * len(bs))]
    for r in results:
        s = r["summary"]
        cells = [f"{s['prefill_tokens_per_s'][b]:,.0f}" for b in bs] + [
            f"{s['decode_tokens_per_s'][b]:,.0f}" for b in bs]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Prefix cache: time to first token, {args.prefix_tokens}-token prefix + {args.suffix_tokens}-token "
                 f"suffix (median of {args.repeats}; speedup: median of per-repetition ratios)\n")
    lines += ["| model | cold TTFT | TTFT after prefill(prefix) | speedup | num_cached_tokens (cold / warm) |",
              "|---|---:|---:|---:|---|"]
    for r in results:
        s = r["summary"]
        lines.append(f"| {r['model']} | {1000 * s['cold_ttft_s']:.1f} ms | {1000 * s['warm_ttft_s']:.1f} ms | "
                     f"{s['prefix_speedup']:.1f}x | {_join(s['cold_num_cached_tokens'])} / "
                     f"{_join(s['warm_num_cached_tokens'])} |")
    lines.append("")
    lines.append(f"Batched vs one at a time: {args.batched_requests} greedy requests x {args.batched_tokens} tokens "
                 f"(median over the runs shown; each run does both, back to back)\n")
    lines += ["| model | together | one at a time | speedup | tokens identical |", "|---|---:|---:|---:|---|"]
    for r in results:
        s = r["summary"]
        lines.append(f"| {r['model']} | {s['batched_s']:.2f} s | {s['sequential_s']:.2f} s | "
                     f"{s['batching_speedup']:.1f}x | {'yes' if s['batching_identical'] else 'NO'} "
                     f"({_plural(s['batching_runs_compared'], 'run')}) |")
    lines.append("")
    for r in results:
        lines.append(f"{r['model']}: {r['parameters'] / 1e6:.1f}M parameters, {r['dtype'].replace('torch.', '')} on "
                     f"{r['device']}; block size {r['block_size']}, max-num-batched-tokens "
                     f"{r['max_num_batched_tokens']}, max-num-seqs {r['max_num_seqs']}, KV cache "
                     f"{r['kv_cache_tokens']} tokens.")
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    info = machine_info()
    log(f"torch {info['torch']}, {info['torch_threads']} threads on {info['cpu_count']} CPUs ({info['cpu_model']})")
    started = time.perf_counter()
    load_before = os.getloadavg()
    results = []
    for model in args.models:
        log(f"benchmarking {model} ...")
        results.append(bench_model(model, args, log))
    total_s = time.perf_counter() - started
    table = markdown(results, args)
    print(table)
    print(f"\ntotal {total_s:.0f}s; torch {info['torch']}, {info['torch_threads']} threads, "
          f"{info['cpu_count']} CPUs; load average before/after: "
          f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
    if args.json:
        payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args),
                   "machine": info, "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "total_seconds": total_s, "results": results, "markdown": table}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        log(f"wrote {args.json}")
    if not all(r["summary"]["batching_identical"] for r in results):
        log("ERROR: batched and one-at-a-time greedy tokens differ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
