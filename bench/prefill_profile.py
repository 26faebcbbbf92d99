"""Where a long prompt's prefill time goes in the torch engine's forward pass, by kind of work.

    python bench/prefill_profile.py                          # smollm2, 512 / 2048 / 4096 tokens
    python bench/prefill_profile.py --model tiny --lengths 64 256
    python bench/prefill_profile.py --model llama-1b --device cuda --lengths 512 4096 16384

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

On ``--device cuda`` (bfloat16 unless ``--dtype``) the kernels' device time is summed instead,
by kernel name: the Triton backend's ``_matmul_kernel`` (projections), ``_paged_attention_kernel``
(attention: products and softmax in one kernel, and the split's fold), its fused
``_add_rms_norm_kernel``, ``_rms_norm_kernel``, ``_silu_mul_kernel`` and ``_rope_and_cache_kernel``,
or with ``--no-batch-invariant`` cuBLAS ``gemm`` kernels (projections).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
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


# Device kernels by name fragment (the Triton backend's kernels, cuBLAS, torch's own copies).
KERNEL_KINDS = {
    "projections": ("_matmul_kernel", "gemm", "gemv", "cutlass", "sm90_xmma", "nvjet"),
    "attention": ("_paged_attention_kernel", "flash", "fmha"),  # and its split's fold, _combine_paged_...
    "fused norms, rotary and SiLU": ("_rms_norm_kernel", "_silu_mul_kernel", "_rope_and_cache_kernel"),
    "gathers and copies": ("copy", "gather", "index_select", "cat"),
    "cache writes": ("index_put", "scatter"),
}


def kind_of(name: str, device: bool = False) -> str:
    if device:
        return next((k for k, parts in KERNEL_KINDS.items() if any(p in name for p in parts)), "everything else")
    return next((k for k, names in KINDS.items() if name in names), "everything else")


def profile(model: LlamaModel, length: int, step_tokens: int, seed: int) -> dict:
    on_device = model.device.type == "cuda"
    block = model.block_size
    table = list(range(-(-length // block) + 1))
    ids = torch.randint(100, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    start = time.perf_counter()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_device else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        for first in range(0, length, step_tokens):
            n = min(step_tokens, length - first)
            slots = torch.tensor([table[p // block] * block + p % block for p in range(first, first + n)])
            model.forward(StepInput(ids[first:first + n].to(model.device), torch.arange(first, first + n).to(model.device),
                                    slots.to(model.device), [(0, n, first, table)], [n - 1]))
        if on_device:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    by_kind: dict[str, float] = defaultdict(float)
    ops = {}
    for e in prof.key_averages():
        # On a GPU, the kernels' own device time: a CPU-side operator reports its kernels' time
        # too (it would count twice), and its own time is launch overhead.
        if on_device and e.device_type == DeviceType.CPU:
            continue
        spent = e.self_device_time_total if on_device else e.self_cpu_time_total
        if not spent:
            continue
        by_kind[kind_of(e.key, on_device)] += spent / 1e6
        ops[e.key] = {"self_s": spent / 1e6, "calls": e.count}
    total = sum(by_kind.values()) or 1.0
    return {"tokens": length, "seconds": seconds, "tokens_per_s": length / seconds,
            "device_s": total if on_device else None,
            "share": {k: by_kind[k] / total for k in (*(KERNEL_KINDS if on_device else KINDS), "everything else")},
            "ops": ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 4096])
    p.add_argument("--step-tokens", type=int, default=2048, help="tokens per forward step (the engine's budget)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on cuda, else float32")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="the exact backend (default) or, with --no-batch-invariant, the vendor's products")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = LlamaModel(models.resolve(args.model), device=args.device, dtype=dtype,
                       batch_invariant=args.batch_invariant)
    block = 16
    model.allocate_cache(-(-max(args.lengths) // block) + 2, block)
    profile(model, min(64, min(args.lengths)), args.step_tokens, args.seed + 1)  # warm-up: first-call costs
    results = []
    for length in args.lengths:
        log(f"profiling a {length}-token prefill ...")
        results.append(profile(model, length, args.step_tokens, args.seed))
    kinds = [*(KERNEL_KINDS if model.device.type == "cuda" else KINDS), "everything else"]
    where = (f"{torch.cuda.get_device_name()}, {dtype}, kernel device time" if model.device.type == "cuda"
             else f"{torch.get_num_threads()} threads, operator self time")
    lines = [f"Prefill of one fresh prompt, model {args.model}, {where}, "
             f"steps of {args.step_tokens} tokens (shares)", "",
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
