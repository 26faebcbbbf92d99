"""Benchmark of daskllm's embedded torch engine on a GPU against transformers' ``generate``.

    python bench/gpu_engine.py --json gpu.json                  # llama-1b on cuda, both systems
    python bench/gpu_engine.py --model llama-8b --batch-sizes 1 32 256 --repeats 5
    python bench/gpu_engine.py --no-cuda-graphs --no-batch-invariant   # the engine's other paths
    python bench/gpu_engine.py --quick                          # smoke run: tiny on the CPU, seconds

The systems (``--systems``: on cuda all three by default, on cpu daskllm and transformers), on the
same model (``--model``, default ``llama-1b``: Llama-3.2-1B's shapes, a
16K vocabulary, dummy weights drawn at load), device (``--device``) and dtype (``--dtype``:
bfloat16 on cuda, float32 on cpu):

* ``daskllm``: ``TorchEngine(model, device, dtype, kv_cache_tokens, max_num_seqs,
  max_num_batched_tokens, batch_invariant, cuda_graphs)``. The KV cache and the batch limits
  default to what the largest workload below needs; ``--batch-invariant`` and ``--cuda-graphs``
  default to the engine's configuration (both on).
* ``daskllm-fast``: the same engine with ``batch_invariant=False`` (cuBLAS products; greedy
  tokens may then depend on the batch). Beside ``daskllm`` in the same run, its times give
  what exactness costs (``daskllm-fast / daskllm`` tokens/s).
* ``transformers``: ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` on a
  left-padded batch (pad = eos), its default attention. A recipe with dummy weights has no
  checkpoint, so the model is built from its config and loaded with ``models.dummy_weights``:
  the same tensors the engine draws.

What it measures (prompts are random token ids in [100, vocab) from a seeded RNG):

1. decode tokens/s at each of ``--batch-sizes``: B prompts of ``--short-prompt-tokens`` tokens,
   ``--decode-tokens`` greedy tokens each (``ignore_eos``); generated tokens / wall time (the
   prompts' one prefill step included).
2. prefill tokens/s: ``--prefill-batch`` prompts of ``--prompt-tokens``, ``max_tokens=1``.
3. time to first token of a ``--prefix-tokens`` prefix + ``--suffix-tokens`` suffix: cold, and
   warm (another prefix, after ``engine.prefill(prefix)``); cold / warm. Transformers has no
   prefix cache: its warm row is its cold time, marked so.
4. nano-vllm's workload (daskllm; transformers with ``--nano-transformers``): ``--nano-seqs``
   sequences whose prompt and output lengths are drawn uniformly from ``--nano-lengths``
   (seeded, the same every repetition), ``ignore_eos``; output tokens / wall time. Transformers
   runs them as one padded batch of max(output) steps, counting only the wanted tokens.
   The memory-traffic bound: the bytes the workload must move at least, over the measured copy
   bandwidth. Counted: the prefill reads every weight once and writes every prompt token's K/V
   once; then, with all sequences starting together and each leaving when its output is done,
   every decode step reads every weight once plus, per running sequence, its context's K/V
   (prompt + tokens so far, times ``kv_bytes_per_token``). Not counted: activations, logits,
   the prefill's compute. Reported: actual time / bound time (the aim on a GPU: within 2x).
5. exactness (daskllm; the run exits 1 unless every count is full): ``--exact-prompts`` prompts
   of 20..300 tokens, 32 greedy tokens each, (a) each alone, against (b) all submitted together,
   (c) shuffled, in 4 groups, each submitted once the engine has stepped twice since the last
   (they join a running batch), and (d) the prompts behind a shared ``--exact-prefix-tokens``
   prefix, all together after ``engine.prefill(prefix)``, against each alone on an empty cache.

6. start-up (``--startup``, on by default on cuda): ``bench/engine_startup.py``'s two fresh
   processes, ``TorchEngine(model)`` to the first token on empty caches (recipe, Triton) and
   then on warm ones, before the other measurements load anything.

The copy bandwidth: ``dst.copy_(src)`` of a 1 GiB tensor on the device (256 MiB on cpu),
best of 5, counting 2 x bytes (read and write). Every repetition runs every measurement on both
systems, interleaved (the order alternates), the median of ``--repeats`` is reported, and the
engine's prefix cache is emptied (untimed) before each. ``--json`` keeps every raw number and
the machine information; the markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time

import engine as cpu_bench
import engine_startup
import numpy as np
import torch
from engine import FIRST_TOKEN, Prompts, _median, _plural, measure_decode, measure_prefill, measure_ttft
from machine import log, machine_info

from daskllm import config, models
from daskllm.engines import sizing
from daskllm.engines.protocol import SamplingParams

EXACT_LENGTHS = (20, 300)  # prompt lengths in the exactness check
EXACT_TOKENS = 32
EXACT_GROUPS = 4
# The targets on a GPU (docs/benchmarks.md): ratio name -> (comparison, value).
GPU_TARGETS = {
    "daskllm decode@1 tokens/s": (">=", 700.0),
    "daskllm / transformers decode@128 tokens/s": (">=", 3.0),
    "daskllm / transformers prefill tokens/s": (">=", 0.85),
    "daskllm warm-prefix TTFT ms": ("<=", 3.0),
    "daskllm TTFT cold / warm prefix": (">=", 5.0),
    "daskllm nano time / memory-traffic bound": ("<=", 2.5),
    "daskllm-fast / daskllm nano tokens/s": ("<=", 1.3),
    "daskllm-fast / daskllm decode@128 tokens/s": ("<=", 1.3),
    "daskllm start-up to first token, empty caches s": ("<=", 30.0),
    "daskllm start-up to first token, warm caches s": ("<=", 10.0),
}
SYSTEMS = ("daskllm", "daskllm-fast", "transformers")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b", help="recipe name or model directory (default: llama-1b)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on cuda, else float32")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 128, 256], help="decode batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement; the median is reported")
    p.add_argument("--short-prompt-tokens", type=int, default=16, help="prompt length for the decode measurement")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens per prompt in the decode measurement")
    p.add_argument("--prefill-batch", type=int, default=8, help="prompts in the prefill measurement")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length for the prefill measurement")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="prefix length for the TTFT measurement")
    p.add_argument("--suffix-tokens", type=int, default=16, help="suffix length after the prefix")
    p.add_argument("--nano-seqs", type=int, default=256, help="sequences in nano-vllm's workload")
    p.add_argument("--nano-lengths", nargs=2, type=int, default=[100, 1024], metavar=("LO", "HI"),
                   help="prompt and output lengths of the nano workload are drawn from [LO, HI]")
    p.add_argument("--nano-transformers", action="store_true", help="run the nano workload on transformers too (slow)")
    p.add_argument("--exact-prompts", type=int, default=64, help="prompts in the exactness check")
    p.add_argument("--exact-prefix-tokens", type=int, default=512, help="shared prefix in the exactness check")
    p.add_argument("--systems", help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all on cuda; "
                   "daskllm,transformers on cpu)")
    p.add_argument("--startup", action=argparse.BooleanOptionalAction,
                   help="measure start-up on empty and warm caches first (default: on cuda)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, help="daskllm's batch_invariant")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help="engine's cuda_graphs")
    p.add_argument("--kv-cache-tokens", type=int, help="engine KV cache (default: what the largest workload needs)")
    p.add_argument("--max-num-seqs", type=int, help="default: the largest batch of any measurement")
    p.add_argument("--max-num-batched-tokens", type=int, help="default: 8192 on cuda, the engine's on cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt RNG")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny on the CPU, small shapes, one repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.device = "tiny", args.device or "cpu"
        args.batch_sizes, args.decode_tokens, args.repeats = [1, 8], 8, 1
        args.prefill_batch, args.prompt_tokens, args.prefix_tokens = 2, 64, 128
        args.nano_seqs, args.nano_lengths = 8, [16, 64]
        args.exact_prompts, args.exact_prefix_tokens = 8, 128
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.systems = args.systems.split(",") if args.systems else list(SYSTEMS if on_cuda else ("daskllm", "transformers"))
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    if "daskllm" not in args.systems:
        p.error("--systems must include daskllm")
    args.startup = on_cuda if args.startup is None else args.startup
    for name in ("repeats", "short_prompt_tokens", "decode_tokens", "prefill_batch", "prompt_tokens",
                 "prefix_tokens", "suffix_tokens", "nano_seqs", "exact_prompts", "exact_prefix_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be >= 1")
    if not 1 <= args.nano_lengths[0] <= args.nano_lengths[1]:
        p.error("--nano-lengths: need 1 <= LO <= HI")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, tries: int = 5) -> dict:
    """Device-to-device copy rate, read + write bytes: what a memory-bound step can reach."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocator, not bandwidth
    best = float("inf")
    for _ in range(tries):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return {"bytes": nbytes, "best_s": best, "bytes_per_s": 2 * nbytes / best}


class DaskllmRunner(cpu_bench.DaskllmRunner):
    """The torch engine built directly, on the chosen device; runs, prefill and reset as on the CPU."""

    def __init__(self, args, engine_kwargs: dict, name: str = "daskllm"):
        from daskllm.engines.torch_engine import TorchEngine

        self.name = name
        start = time.perf_counter()
        self.engine = TorchEngine(args.model, **engine_kwargs)
        self.load_s = time.perf_counter() - start
        self.vocab_size = self.engine.vocab_size
        self.model_dir = models.resolve(args.model)

    def run_ragged(self, prompts, outputs) -> dict:
        """Each prompt with its own output length, all queued before the results are awaited."""
        before = self.engine.stats()
        start = time.perf_counter()
        futures = [self.engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                   for p, n in zip(prompts, outputs)]
        tokens = [f.result().token_ids for f in futures]
        return {"seconds": time.perf_counter() - start, "tokens": tokens,
                "stats": cpu_bench.stats_delta(before, self.engine.stats())}

    def info(self) -> dict:
        e, model, scheduler = self.engine, getattr(self.engine, "model", None), getattr(self.engine, "_scheduler", None)
        out = {"engine": type(e).__name__, "load_s": self.load_s, "block_size": e.block_size,
               "kv_cache_tokens": e.cache_state().num_blocks * e.block_size,
               "dtype": str(getattr(model, "dtype", None)).replace("torch.", ""),
               "device": str(getattr(model, "device", None)),
               **{k: getattr(scheduler, k, None) for k in ("max_num_seqs", "max_num_batched_tokens")}}
        out["backend"] = model.backend.name
        out["batch_invariant"] = getattr(model.backend, "batch_invariant", True)
        out["cuda_graphs"] = e._graphs is not None
        out["load_phases"] = e.load_phases
        out["matmul_plans"] = config.get("engine.matmul-plans")  # None: the built-in plans
        check = getattr(e, "kernel_check", None)  # which attention paths the device computes exactly
        out["kernel_check"] = check and {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                         for k, v in check.items()}
        return out


class TransformersRunner(cpu_bench.TransformersRunner):
    """``generate`` on the device, timed between device synchronizations."""

    def __init__(self, args):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generation-config notes on every call
        hf_logging.disable_progress_bar()
        self.device = torch.device(args.device)
        start = time.perf_counter()
        self.model = load_hf_model(models.resolve(args.model), getattr(torch, args.dtype), self.device)
        self.load_s = time.perf_counter() - start
        eos = self.model.generation_config.eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        self.eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.vocab_size = self.model.config.vocab_size

    def run(self, prompts, max_tokens: int) -> dict:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=self.eos)
        sync(self.device)
        return {"seconds": time.perf_counter() - start, "tokens": out[:, width:].tolist()}

    def run_ragged(self, prompts, outputs) -> dict:
        """One static batch runs until its longest output: a sequence's extra tokens are waste."""
        run = self.run(prompts, max(outputs))
        return {"seconds": run["seconds"], "tokens": [t[:n] for t, n in zip(run["tokens"], outputs)]}


def load_hf_model(path, dtype: torch.dtype, device: torch.device):
    """from_pretrained, or for a dummy-weight recipe (no checkpoint) the config + the engine's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = models.dummy_weights(path)
    if state is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with device:  # initialized where it runs: fast, and overwritten below
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{path}: dummy weights do not fit transformers' model: {missing=} {unexpected=}")
    model.tie_weights()
    return model.eval()


def engine_kwargs(args, nano: dict) -> dict:
    """The TorchEngine arguments of this run."""
    block = config.get("engine.block-size")
    needs = [[args.short_prompt_tokens + args.decode_tokens] * max(args.batch_sizes),
             [args.prompt_tokens + 1] * args.prefill_batch,
             [args.prefix_tokens + args.suffix_tokens + 1] * 3,  # cold prompt, warm prefix, warm prompt
             [p + o for p, o in zip(nano["prompt_lengths"], nano["output_lengths"])],
             [args.exact_prefix_tokens + EXACT_LENGTHS[1] + EXACT_TOKENS] * (args.exact_prompts + 1)]
    kv_tokens = max(sum(-(-n // block) + 1 for n in lengths) for lengths in needs) * block
    wanted = {"device": args.device, "dtype": args.dtype,
              "kv_cache_tokens": args.kv_cache_tokens or max(kv_tokens, sizing.CPU["kv-cache-tokens"]),
              "max_num_seqs": args.max_num_seqs or max(*args.batch_sizes, args.prefill_batch, args.nano_seqs,
                                                       args.exact_prompts),
              "max_num_batched_tokens": args.max_num_batched_tokens or (8192 if args.device.startswith("cuda")
                                                                        else None),
              "batch_invariant": args.batch_invariant, "cuda_graphs": args.cuda_graphs}
    return {k: v for k, v in wanted.items() if v is not None}


def nano_workload(args, vocab: int) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    lo, hi = args.nano_lengths
    prompt_lengths = rng.integers(lo, hi + 1, args.nano_seqs).tolist()
    output_lengths = rng.integers(lo, hi + 1, args.nano_seqs).tolist()
    prompts = [rng.integers(FIRST_TOKEN, vocab, n).tolist() for n in prompt_lengths]
    return {"prompts": prompts, "prompt_lengths": prompt_lengths, "output_lengths": output_lengths}


def traffic_bound(prompt_lengths, output_lengths, weight_bytes: int, kv_bytes: int, bandwidth: float) -> dict:
    """The least bytes the workload moves (see the docstring) and that over the copy bandwidth."""
    p, o = np.asarray(prompt_lengths, dtype=np.int64), np.asarray(output_lengths, dtype=np.int64)
    prefill = weight_bytes + int(p.sum()) * kv_bytes
    decode = 0
    for step in range(1, int(o.max())):  # the prefill made each first token; step s makes token s + 1
        running = o > step
        decode += weight_bytes + int((p[running] + step).sum()) * kv_bytes
    total = prefill + decode
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes, "prefill_bytes": prefill,
            "decode_bytes": decode, "decode_steps": int(o.max()) - 1, "total_bytes": total,
            "bound_s": total / bandwidth}


def measure_nano(runner, workload: dict, bound_s: float) -> dict:
    run = runner.run_ragged(workload["prompts"], workload["output_lengths"])
    if [len(t) for t in run["tokens"]] != workload["output_lengths"]:
        raise RuntimeError(f"{runner.name}: nano workload generated other lengths than asked")
    tokens = sum(workload["output_lengths"])
    return {"output_tokens": tokens, "seconds": run["seconds"], "tokens_per_s": tokens / run["seconds"],
            "bound_ratio": run["seconds"] / bound_s, "stats": run.get("stats")}


def measure_exactness(runner: DaskllmRunner, args, vocab: int) -> dict:
    """Greedy outputs alone against together, staggered, and behind a cached prefix: x/n identical."""
    eng, rng = runner.engine, np.random.default_rng(args.seed + 2)
    params = SamplingParams(max_tokens=EXACT_TOKENS, temperature=0.0, ignore_eos=True)
    n = args.exact_prompts
    prompts = [rng.integers(FIRST_TOKEN, vocab, k).tolist() for k in rng.integers(*EXACT_LENGTHS, n, endpoint=True)]

    def alone(ps):
        out = []
        for prompt in ps:
            eng.reset_prefix_cache()
            out.append(eng.generate([prompt], params)[0].token_ids)
        return out

    def together(ps):
        eng.reset_prefix_cache()
        return [c.token_ids for c in eng.generate(ps, params)]

    def staggered(ps):
        eng.reset_prefix_cache()
        order = rng.permutation(n)
        futures = {}
        for group in np.array_split(order, EXACT_GROUPS):
            steps = eng.stats().steps
            futures.update(zip(group.tolist(), eng.submit_many([ps[i] for i in group], params)))
            while eng.stats().steps < steps + 2 and not all(f.done() for f in futures.values()):
                time.sleep(0.001)  # let the batch run a little before the next group joins it
        return [futures[i].result().token_ids for i in range(n)]

    base = alone(prompts)
    prefix = rng.integers(FIRST_TOKEN, vocab, args.exact_prefix_tokens).tolist()
    shared = [prefix + p for p in prompts]
    shared_alone = alone(shared)
    eng.reset_prefix_cache()
    eng.prefill(prefix)
    cached = eng.generate(shared, params)
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    return {"prompts": n, "max_tokens": EXACT_TOKENS, "together": same(base, together(prompts)),
            "staggered": same(base, staggered(prompts)),
            "cached_prefix": same(shared_alone, [c.token_ids for c in cached]),
            "cached_prefix_min_cached_tokens": min(c.num_cached_tokens for c in cached)}


def bench(runners: dict, args, workload: dict, bound: dict, vocab: int, checkpoint=lambda results: None) -> dict:
    prompts = Prompts(args.seed, vocab)
    results = {name: {"prefill": [], "decode": [], "ttft": [], "nano": []} for name in runners}
    for name, runner in runners.items():
        log(f"warming up {name} ...")
        cpu_bench.warm_up(runner, prompts, args)
    names = list(runners)
    engines = [n for n in names if n != "transformers"]

    def each(rep, key, measure, *a, only=names):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # alternated: no system always first
            if name in only:
                runner = runners[name]
                if runner.has_prefix_cache:
                    runner.reset()
                results[name][key].append(row := {"rep": rep, **measure(runner, *a)})
                log(f"  {name} {key}: " + ", ".join(f"{k} {v:,.4g}" for k, v in row.items()
                                                    if k != "rep" and isinstance(v, (int, float))))

    for rep in range(args.repeats):
        t0 = time.perf_counter()
        for b in args.batch_sizes:
            each(rep, "decode", measure_decode, prompts, b, args.short_prompt_tokens, args.decode_tokens)
        each(rep, "prefill", measure_prefill, prompts, args.prefill_batch, args.prompt_tokens)
        each(rep, "ttft", measure_ttft, prompts, args.prefix_tokens, args.suffix_tokens)
        each(rep, "nano", measure_nano, workload, bound["bound_s"],
             only=names if args.nano_transformers else engines)
        log(f"  repetition {rep + 1}/{args.repeats} took {time.perf_counter() - t0:.1f}s")
        checkpoint(results)
    for name in engines:
        log(f"exactness of {name} ...")
        runners[name].reset()
        results[name]["exactness"] = measure_exactness(runners[name], args, vocab)
        log(f"  exactness: {results[name]['exactness']}")
        results[name]["engine_stats"] = runners[name].engine.stats().as_dict()
    for name, runner in runners.items():
        results[name]["info"] = runner.info()
    return results


def summarize(r: dict) -> dict:
    s = {"prefill_tokens_per_s": _median(x["tokens_per_s"] for x in r["prefill"]),
         "decode_tokens_per_s": {b: _median(x["tokens_per_s"] for x in r["decode"] if x["batch"] == b)
                                 for b in sorted({x["batch"] for x in r["decode"]})},
         "cold_ttft_s": _median(x["cold_ttft_s"] for x in r["ttft"]),
         "warm_ttft_s": _median(x.get("warm_ttft_s") for x in r["ttft"]),
         "prefix_speedup": _median(x.get("speedup") for x in r["ttft"])}
    for key in ("tokens_per_s", "seconds", "bound_ratio"):
        s[f"nano_{key}"] = _median(x[key] for x in r["nano"])
    if "exactness" in r:
        s["warm_num_cached_tokens"] = sorted({x["warm_num_cached_tokens"] for x in r["ttft"]})
        s["exactness"] = {k: r["exactness"][k] for k in ("prompts", "together", "staggered", "cached_prefix")}
    return s


def ratios(results: dict, args, startup: dict | None = None) -> list[dict]:
    """daskllm over transformers and over daskllm-fast (medians of per-repetition ratios), the
    nano time over its bound, the warm-prefix TTFT and the start-up times."""
    def paired(key, field, batch=None, of=("daskllm", "transformers")):
        if not all(n in results for n in of):
            return None
        a, b = ({x["rep"]: x[field] for x in results[n][key] if batch in (None, x.get("batch"))} for n in of)
        return _median(a[r] / b[r] for r in a if r in b)

    values = {f"daskllm / transformers decode@{b} tokens/s": paired("decode", "tokens_per_s", b)
              for b in args.batch_sizes}
    values["daskllm / transformers prefill tokens/s"] = paired("prefill", "tokens_per_s")
    values["daskllm / transformers cold TTFT (lower: daskllm faster)"] = paired("ttft", "cold_ttft_s")
    values["daskllm / transformers nano tokens/s"] = paired("nano", "tokens_per_s")
    summary = results["daskllm"]["summary"]
    values["daskllm decode@1 tokens/s"] = summary["decode_tokens_per_s"].get(1)
    values["daskllm warm-prefix TTFT ms"] = summary["warm_ttft_s"] and 1000 * summary["warm_ttft_s"]
    values["daskllm TTFT cold / warm prefix"] = summary["prefix_speedup"]
    values["daskllm nano time / memory-traffic bound"] = summary["nano_bound_ratio"]
    if "daskllm-fast" in results:  # what exactness costs
        values["daskllm-fast / daskllm nano tokens/s"] = paired("nano", "tokens_per_s", of=("daskllm-fast", "daskllm"))
        for b in args.batch_sizes:
            values[f"daskllm-fast / daskllm decode@{b} tokens/s"] = paired("decode", "tokens_per_s", b,
                                                                           of=("daskllm-fast", "daskllm"))
    if startup:
        values["daskllm start-up to first token, empty caches s"] = startup["cold"]["first_token_s"]
        values["daskllm start-up to first token, warm caches s"] = startup["warm"]["first_token_s"]
    gpu = args.device.startswith("cuda")  # the targets are for GPUs; a small model's CPU step is compute-bound
    out = []
    for name, value in values.items():
        if value is None:
            continue
        op, target = GPU_TARGETS.get(name, (None, None)) if gpu else (None, None)
        met = None if target is None else (value >= target if op == ">=" else value <= target)
        out.append({"ratio": name, "value": value, "target": None if target is None else f"{op} {target:g}",
                    "met": met})
    return out


def markdown(report: dict, args) -> str:
    results, names = report["engines"], list(report["engines"])
    ms = lambda s: f"{1000 * s:,.1f} ms"  # noqa: E731
    lines = [f"daskllm's torch engine against transformers: model {args.model}, {args.dtype} on "
             f"{report['machine']['device_name']}, median of {_plural(args.repeats, 'repetition')} (interleaved)\n",
             "| measurement | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label, cell):
        lines.append(f"| {label} | " + " | ".join(cell(results[n]["summary"]) for n in names) + " |")

    for b in args.batch_sizes:
        row(f"decode tokens/s, B={b} ({args.decode_tokens} tokens each)",
            lambda s, b=b: f"{s['decode_tokens_per_s'][b]:,.0f}")
    row(f"prefill tokens/s ({args.prefill_batch} x {args.prompt_tokens}-token prompts)",
        lambda s: f"{s['prefill_tokens_per_s']:,.0f}")
    row(f"TTFT cold ({args.prefix_tokens}-token prefix + {args.suffix_tokens})", lambda s: ms(s["cold_ttft_s"]))
    row("TTFT warm (after `prefill(prefix)`)", lambda s: ms(s["warm_ttft_s"]) if s["warm_ttft_s"] is not None
        else f"{ms(s['cold_ttft_s'])} (full prompt: no prefix cache)")
    row("TTFT cold / warm", lambda s: f"{s['prefix_speedup']:.1f}x" if s["prefix_speedup"] is not None else "n/a")
    lo, hi = args.nano_lengths
    row(f"nano workload output tokens/s ({args.nano_seqs} seqs, lengths {lo}..{hi})",
        lambda s: f"{s['nano_tokens_per_s']:,.0f}" if s["nano_tokens_per_s"] else "not run (--nano-transformers)")
    row(f"nano time / memory-traffic bound ({ms(report['bound']['bound_s'])})",
        lambda s: f"{s['nano_bound_ratio']:.2f}x ({ms(s['nano_seconds'])})" if s["nano_bound_ratio"] else "n/a")
    for key, label in (("together", "all together"), ("staggered", f"shuffled, {EXACT_GROUPS} staggered groups"),
                       ("cached_prefix", f"behind a cached {args.exact_prefix_tokens}-token prefix")):
        row(f"exact: alone = {label} ({EXACT_TOKENS} greedy tokens)",
            lambda s, key=key: f"{s['exactness'][key]}/{s['exactness']['prompts']}" if "exactness" in s else "n/a")
    lines += ["", "| ratio | value | wanted |", "|---|---:|---|"]
    for r in report["ratios"]:
        wanted = "" if r["target"] is None else f"{r['target']} ({'met' if r['met'] else 'NOT met'})"
        name = r["ratio"]
        value = (f"{r['value']:,.0f}" if name.endswith("tokens/s") and "/" not in name.split(" tokens")[0]
                 else f"{r['value']:.2f} {name.rsplit(' ', 1)[1]}" if name.endswith((" ms", " s"))
                 else f"{r['value']:.2f}x")
        lines.append(f"| {r['ratio']} | {value} | {wanted} |")
    b, m = report["bound"], report["machine"]
    lines += ["", f"- copy bandwidth {m['copy_bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s; weights "
                  f"{b['weight_bytes'] / 2**20:,.1f} MiB, KV {b['kv_bytes_per_token'] / 2**10:.1f} KiB/token, "
                  f"bound {b['total_bytes'] / 2**30:.2f} GiB over {b['decode_steps']} decode steps."]
    d = results["daskllm"]["info"]
    lines.append(f"- daskllm: {d['engine']} {d['dtype']} on {d['device']}; engine arguments {report['engine_kwargs']}"
                 + ("; daskllm-fast: the same with batch_invariant=False" if "daskllm-fast" in results else "") + ".")
    if "transformers" in results:
        t = results["transformers"]["info"]
        lines.append(f"- transformers {m['transformers']}: {t['engine']}, {t['parameters'] / 1e6:.1f}M parameters, "
                     f"attention {t['attn_implementation']}, left-padded batch, no prefix cache.")
    if report.get("startup"):
        lines += ["", engine_startup.markdown(report["startup"])]
    return "\n".join(lines)


def device_info(device: str, bandwidth: dict) -> dict:
    import transformers

    extra = {"device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"}
    with contextlib.suppress(ImportError):
        import triton

        extra["triton"] = triton.__version__
    return machine_info(transformers=transformers.__version__, cuda=torch.version.cuda, device=device, **extra,
                        copy_bandwidth_bytes_per_s=bandwidth["bytes_per_s"], copy_bandwidth=bandwidth)


def measure_startup(args) -> dict:
    """bench/engine_startup.py's cold and warm starts of the engine at its defaults (on this device, in this dtype)."""
    log(f"start-up of {args.model}: two fresh processes, empty caches then warm ...")
    startup = engine_startup.measure(argparse.Namespace(
        model=args.model, device=args.device, engine_kwargs=json.dumps({"dtype": args.dtype}),
        keep_triton_cache=False, timeout=300))
    log(engine_startup.markdown(startup))
    return startup


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("daskllm").setLevel(logging.WARNING)
    started = time.perf_counter()
    payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args)}

    def save(**fields) -> None:  # after every stage: a run cut short keeps what it measured
        payload.update(fields, total_seconds=time.perf_counter() - started)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)

    startup = measure_startup(args) if args.startup else None
    save(startup=startup, partial=True)
    copy_mib = 1024 if args.device.startswith("cuda") else 64 if args.quick else 256
    bandwidth = copy_bandwidth(args.device, copy_mib * 2**20)
    info = device_info(args.device, bandwidth)
    log(f"{info['device_name']}: copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
    runners = {}
    if "transformers" in args.systems:
        log(f"loading {args.model} on transformers ({args.dtype}, {args.device}) ...")
        runners["transformers"] = TransformersRunner(args)
    if runners:
        vocab = runners["transformers"].vocab_size
    else:
        from daskllm.engines.llama import LlamaConfig

        vocab = LlamaConfig.from_dir(models.resolve(args.model)).vocab_size
    workload = nano_workload(args, vocab)
    kwargs = engine_kwargs(args, workload)
    for name in (n for n in SYSTEMS if n in args.systems and n != "transformers"):
        engine_args = {**kwargs, "batch_invariant": False} if name == "daskllm-fast" else kwargs
        log(f"loading {args.model} on {name} ({engine_args}) ...")
        runners[name] = DaskllmRunner(args, engine_args, name)
    runners = {n: runners[n] for n in SYSTEMS if n in runners}  # daskllm first
    model = runners["daskllm"].engine.model
    bound = traffic_bound(workload["prompt_lengths"], workload["output_lengths"], model.weight_bytes,
                          model.kv_bytes_per_token, bandwidth["bytes_per_s"])
    vocab = min(r.vocab_size for r in runners.values())
    save(machine=info, bound=bound, engine_kwargs=kwargs)
    try:
        results = bench(runners, args, workload, bound, vocab, checkpoint=lambda r: save(engines=r))
    finally:
        for runner in runners.values():
            runner.close()
    for r in results.values():
        r["summary"] = summarize(r)
    report = {"machine": info, "engines": results, "bound": bound, "engine_kwargs": kwargs, "vocab_size_used": vocab,
              "nano_workload": {k: workload[k] for k in ("prompt_lengths", "output_lengths")}, "startup": startup}
    report["ratios"] = ratios(results, args, startup)
    exact = results["daskllm"]["summary"]["exactness"]
    report["exact"] = all(exact[k] == exact["prompts"] for k in ("together", "staggered", "cached_prefix"))
    table = markdown(report, args)
    print(table)
    print(f"\ntotal {time.perf_counter() - started:.0f}s; torch {info['torch']}, CUDA {info['cuda']}, "
          f"{info['device_name']}")
    save(**report, markdown=table, partial=False)
    if args.json:
        log(f"wrote {args.json}")
    if not report["exact"]:
        log(f"exactness FAILED: {exact}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
