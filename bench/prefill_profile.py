"""Where a long prompt's prefill time goes in the torch engine's forward pass, by kind of work.

    python bench/prefill_profile.py                          # smollm2, 512 / 2048 / 4096 tokens
    python bench/prefill_profile.py --model tiny --lengths 64 256

One fresh prompt per length through ``LlamaModel.forward`` (no Dask, no engine loop), in steps of
``--step-tokens`` (the engine's ``max-num-batched-tokens``, 2048 by default), under
``torch.profiler``; the operators' self CPU time is summed by kind:

* projections: the QKV, output, gate/up, down and LM-head products (oneDNN linear, mm, addmm);
* attention products: the batched matmuls of scores and of weighted values (bmm, matmul);
* attention softmax: exp, max, maximum, sum, masked_fill, the rescaling multiplies and adds;
* gathers and copies: index_select, copies, cat, pad (cache reads, layout changes);
* cache writes: index_put (each new token's K/V into the cache);
* everything else (RMSNorm, rotary embeddings, SiLU, residual adds, ...).

Per length it prints the wall time (under the profiler, which adds a little) and tokens/s,
and each kind's share, after one unmeasured short prefill; ``--json`` keeps the raw operator
table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from machine import log, machine_info

from daskllm import models
from daskllm.engines.llama import LlamaModel, StepInput

KINDS = {
    "projections": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear"),
    "attention products": ("aten::bmm", "aten::matmul"),
    "attention softmax": ("aten::exp", "aten::amax", "aten::maximum", "aten::sum", "aten::masked_fill",
                          "aten::masked_fill_", "aten::sub", "aten::div"),
    "gathers and copies": ("aten::index_select", "aten::copy_", "aten::cat", "aten::constant_pad_nd",
                           "aten::clone", "aten::_unsafe_view", "aten::reshape", "aten::contiguous"),
    "cache writes": ("aten::index_put_", "aten::_index_put_impl_"),
}


def kind_of(name: str) -> str:
    return next((k for k, names in KINDS.items() if name in names), "everything else")


def profile(model: LlamaModel, length: int, step_tokens: int, seed: int) -> dict:
    block = model.block_size
    table = list(range(-(-length // block) + 1))
    ids = torch.randint(100, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for first in range(0, length, step_tokens):
            n = min(step_tokens, length - first)
            slots = torch.tensor([table[p // block] * block + p % block for p in range(first, first + n)])
            model.forward(StepInput(ids[first:first + n], torch.arange(first, first + n), slots,
                                    [(0, n, first, table)], [n - 1]))
    seconds = time.perf_counter() - start
    by_kind: dict[str, float] = defaultdict(float)
    ops = {}
    for e in prof.key_averages():
        by_kind[kind_of(e.key)] += e.self_cpu_time_total / 1e6
        ops[e.key] = {"self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
    total = sum(by_kind.values()) or 1.0
    return {"tokens": length, "seconds": seconds, "tokens_per_s": length / seconds,
            "share": {k: by_kind[k] / total for k in (*KINDS, "everything else")}, "ops": ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 4096])
    p.add_argument("--step-tokens", type=int, default=2048, help="tokens per forward step (the engine's budget)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = LlamaModel(models.resolve(args.model))
    block = 16
    model.allocate_cache(-(-max(args.lengths) // block) + 2, block)
    profile(model, min(64, min(args.lengths)), args.step_tokens, args.seed + 1)  # warm-up: first-call costs
    results = []
    for length in args.lengths:
        log(f"profiling a {length}-token prefill ...")
        results.append(profile(model, length, args.step_tokens, args.seed))
    kinds = [*KINDS, "everything else"]
    lines = [f"Prefill of one fresh prompt, model {args.model}, {torch.get_num_threads()} threads, "
             f"steps of {args.step_tokens} tokens (share of operator self time)", "",
             "| tokens | seconds | tokens/s | " + " | ".join(kinds) + " |",
             "|---:|---:|---:|" + "---:|" * len(kinds)]
    for r in results:
        lines.append(f"| {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
                     + " | ".join(f"{100 * r['share'][k]:.0f}%" for k in kinds) + " |")
    table = "\n".join(lines)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "args": vars(args), "machine": machine_info(),
                       "results": results, "markdown": table}, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
