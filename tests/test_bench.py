"""The benchmark harness and the scheduling model: they measure what they claim.

The scheduling cost model and its MILP are pure functions, checked against brute force on
small random instances. The harness runs end to end on two pipelines (tiny model) and must
report every system, exact outputs and sane ratios.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from attribution import summarize, tasks_window  # noqa: E402
from scheduling import BLOCK, Call, hit_rate, list_schedule, optimal, orders, shared, token_steps  # noqa: E402


def _instance(seed: int, n: int = 6) -> list[Call]:
    """Random calls: prompts that share prefixes (a few system blocks), outputs, a random DAG."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1 << 30) for _ in range(rng.randrange(1, 4))] for _ in range(2)]
    calls = []
    for i in range(n):
        blocks = list(rng.choice(systems)) + [rng.randrange(1 << 30) for _ in range(rng.randrange(0, 3))]
        preds = {j for j in range(i) if rng.random() < 0.3}
        calls.append(Call(f"c{i}", blocks, (rng.randrange(1 << 30), rng.randrange(0, BLOCK)), rng.randrange(2, 9),
                          preds, order=i))
    return calls


def _brute_force(calls: list[Call], capacity: int) -> float:
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(calls)))
    dag.add_edges_from((p, i) for i, c in enumerate(calls) for p in c.preds)
    return min(token_steps(calls, list(order), capacity) for order in nx.all_topological_sorts(dag))


@pytest.mark.parametrize("seed", range(4))
def test_milp_finds_the_brute_force_optimum(seed):
    calls = _instance(seed)
    capacity = 64  # small, so prefill differences matter in the cost
    best = optimal(calls, capacity, time_limit=60)
    assert best["proven"], best["status"]
    assert best["cost"] == pytest.approx(_brute_force(calls, capacity), rel=1e-6)
    # every heuristic order is a valid order, never better than the optimum
    for system, candidates in orders(calls, capacity, seeds=3).items():
        for order in candidates:
            assert sorted(order) == list(range(len(calls)))
            done = set()
            for i in order:
                assert calls[i].preds <= done, system
                done.add(i)
            assert token_steps(calls, order, capacity) >= best["cost"] - 1e-9


def test_cost_model_counts_shared_prefixes_and_delays():
    a = Call("a", [1, 2], (7, 4), 2, set())
    b = Call("b", [1, 2], (8, 4), 2, set())  # shares a's two full blocks
    c = Call("c", [9], (0, 0), 2, {0})  # needs a's output
    assert shared(a, b) == 2 * BLOCK and shared(None, b) == 0 and shared(a, a) == a.prompt
    capacity = 10
    cost_a = (2 * a.prompt + 3) / capacity
    cost_b = (2 * (b.prompt - 2 * BLOCK) + 3) / capacity
    assert token_steps([a, b, c], [0, 1, 2], capacity) == pytest.approx(
        max(cost_a + cost_b, cost_a + 2) + (2 * c.prompt + 3) / capacity)
    # a barrier makes the list schedule wait: c cannot run before a's group ends
    order = list_schedule([a, b, c], lambda j, p: j, capacity, barrier=lambda j: 0 if j < 2 else 1)
    assert order == [0, 1, 2]


def test_lru_hit_rate_depends_on_order():
    shared_prefix = [1, 2, 3, 4]
    calls = [Call(f"q{i}", shared_prefix + [100 + i], (0, 0), 1, set()) for i in range(2)]
    calls += [Call(f"r{i}", [50, 51, 52, 53, 200 + i], (0, 0), 1, set()) for i in range(2)]
    grouped, interleaved = [0, 1, 2, 3], [0, 2, 1, 3]
    small = 5 * BLOCK  # holds one prompt's blocks
    assert hit_rate(calls, grouped, small) > hit_rate(calls, interleaved, small)
    assert hit_rate(calls, grouped, 10**6) == hit_rate(calls, interleaved, 10**6)


@pytest.mark.bits
@pytest.mark.slow
def test_harness_runs_every_system_and_checks_exactness(tmp_path, daskllm_cache):
    out = tmp_path / "harness.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "harness.py"), "--quick", "--pipelines", "w2,adaptive_rag",
                           "--systems", "sequential,opwise,dask,daskllm,-prefix", "--json", str(out),
                           "--attribution", str(tmp_path / "attribution.png")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["pipeline"] for r in report["results"]] == ["w2", "adaptive_rag"]
    for result in report["results"]:
        systems = result["systems"]
        assert set(systems) == {"sequential", "opwise", "dask", "daskllm", "-prefix"}
        assert all(s["exact"] for s in systems.values())
        assert systems["daskllm"]["vs_daskllm"] == pytest.approx(1.0)
        assert all(s["seconds"] > 0 and s["tasks"] > 0 for s in systems.values())
        assert result["distinct_prompt_tokens"] > 0
        assert all(0 < s["efficiency"] < 1.5 for s in systems.values())
        for s in systems.values():  # where the time went: engines computed, threads waited on them
            a = s["attribution"]
            assert a["engine_busy"] > 0 and a["tasks_window"] > 0 and a["threads_engine_wait"] > 0
            assert a["outside_tasks"] + a["tasks_window"] == pytest.approx(a["wall"], abs=0.05)
    assert (tmp_path / "attribution.png").stat().st_size > 0
    # one query at a time cannot batch across queries
    assert report["results"][0]["systems"]["sequential"]["mean_batch"] <= 1.5
    assert "| w2 | daskllm |" in done.stdout
    _check_gpu_sweep_report(tmp_path / "sweep", out)


def _check_gpu_sweep_report(folder, harness_json):
    """bench/gpu_sweep.py's report over a real harness call (the one above: its harness runs
    are the harness's, so its own test would only repeat them): rows, targets, exactness."""
    import gpu_sweep
    from pipelines import registry

    # its small call runs every reference pipeline
    assert sorted(gpu_sweep.REFERENCE) == sorted(registry())
    folder.mkdir()
    (folder / "q4-all.json").write_text(harness_json.read_text())
    (folder / "q4-all.call.json").write_text(json.dumps(
        {"name": "q4-all", "kind": "small", "status": "ok", "returncode": 0, "json": "q4-all.json", "finished": 1.0, "seconds": 9.0,
         "machine": {"device": "cpu"}, "pipelines": ["w2", "adaptive_rag"], "queries": 4,
         "command": "python bench/harness.py --quick"}))
    argv = ["--report-only", "--pipelines", "w2,adaptive_rag", "--queries-small", "4", "--calls", "small",
            "--out", str(folder)]
    assert gpu_sweep.main(argv) == 0
    report = json.loads((folder / "sweep.json").read_text())
    assert [(r["pipeline"], r["queries"]) for r in report["rows"]] == [("w2", 4), ("adaptive_rag", 4)]
    for row in report["rows"]:
        assert row["exact"] is True
        assert all(row[k] > 0 for k in ("opwise_s", "dask_s", "daskllm_s", "vs_dask", "vs_opwise", "efficiency"))
    status = {t["target"]: t["status"] for t in report["targets"]}
    assert status["every output exact on every pipeline (every system, every call)"] == "met"
    assert set(status.values()) <= {"met", "not met", "incomplete"}
    assert "| pipeline | queries | daskllm s (batch) | op-wise s (batch) | Dask s (batch) | vs Dask | vs op-wise | " \
           "efficiency | exact |" in report["markdown"] and "| w2 | 4 |" in report["markdown"]
    # the plan: the small call first, daskllm first in it; the shared call on two workers sharing a GPU
    plan = {c["kind"]: c["argv"] for c in gpu_sweep.plan(gpu_sweep.parse_args(["--out", str(folder)]))}
    assert list(plan) == ["small", "large", "shared"]
    assert plan["small"][plan["small"].index("--systems") + 1].startswith("daskllm,")
    assert plan["shared"][plan["shared"].index("--workers-per-gpu") + 1] == "2"
    # one system's outputs differing anywhere: the report says so and the exit status is 1
    harness = json.loads((folder / "q4-all.json").read_text())
    harness["results"][0]["systems"]["dask"]["exact"] = False
    (folder / "q4-all.json").write_text(json.dumps(harness))
    assert gpu_sweep.main(argv) == 1
    report = json.loads((folder / "sweep.json").read_text())
    assert report["exact"] is False and "| NO |" in report["markdown"]
    assert report["targets"][0]["status"] == "not met"


def test_quality_scorer_counts_answers_that_name_the_module():
    import quality
    from daskllm.index import Hit

    assert quality.accuracy(["Use the json module.", "posix", "os.path.join", ""], ["json", "os", "os", "csv"]) == 0.5
    assert quality.accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="2 answers for 1 questions"):
        quality.accuracy(["a", "b"], ["json"])
    hits = [[Hit(id=3, score=0.9, text="a"), Hit(id=5, score=0.8, text="b")], [Hit(id=1, score=0.5, text="c")]]
    assert quality.recall(hits, [5, 2]) == 0.5
    assert quality.recall(hits, [None, 1]) == 1.0 and quality.recall(hits, [None, None]) is None


def test_quality_plans_remove_one_thing_each():
    import quality

    names = quality.plan_names()
    assert names[:2] == ["optimized", "naive"] and "-prefix" in names and "-placement" in names
    assert quality.plan_settings("naive") == ({"passes": [], "granularity": "query", "result_cache": False,
                                                  "release_threads": False}, "off")
    settings, policy = quality.plan_settings("-cse")
    assert "cse" not in settings["passes"] and "prefix" in settings["passes"] and policy == "cache_aware"
    assert quality.plan_settings("optimized") == ({"passes": None, "result_cache": False}, "cache_aware")


@pytest.mark.slow
def test_quality_benchmark_runs_and_compares_every_plan_with_naive(tmp_path, daskllm_cache):
    out = tmp_path / "quality.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--model", "tiny", "--questions", "3",
                           "--howto", "2", "--index-rows", "100", "--max-tokens", "3",
                           "--plans", "optimized,naive,-prefix,-placement", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["questions"] == {"stdlib-modules": 3, "stdlib-howto": 2} and report["passages"] == 100
    assert set(report["plans"]) == {"optimized", "naive", "-prefix", "-placement"}
    assert all(p["same_answers_as_naive"] for p in report["plans"].values())
    # the index always holds the generated questions' source rows: exact-sentence search finds them
    assert report["retrieval_recall"] == 1.0
    assert len(report["examples"]) == 5 and "every plan gives the naive plan's answers: True" in done.stdout


def test_attribution_sorts_worker_thread_time_by_what_the_threads_did():
    metrics = [(("execute", "decode", "thread-noncpu", "seconds"), 3.0),
               (("execute", "prefill", "thread-noncpu", "seconds"), 1.0),
               (("execute", "pmap", "thread-noncpu", "seconds"), 2.0),
               (("execute", "decode", "thread-cpu", "seconds"), 0.5),
               (("execute", "decode", "executor", "seconds"), 0.25),
               (("execute", "N/A", "idle or other spans", "seconds"), 1.25),
               (("execute", "decode", "memory-read", "bytes"), 4096.0),
               (("gather-dep", "decode", "network", "seconds"), 9.0)]
    found = summarize(metrics, window=1.0, wall=1.5, engine_busy=2.0, engines=2, thread_count=8)
    assert found["threads_engine_wait"] == 4.0 and found["threads_stream_wait"] == 2.0
    assert found["threads_cpu"] == 0.5 and found["threads_dask_overhead"] == 0.25 and found["threads_idle"] == 1.25
    assert found["outside_tasks"] == 0.5 and found["engine_idle"] == 1.0


def test_tasks_window_spans_the_first_start_to_the_last_stop():
    stream = [{"startstops": [{"action": "transfer", "start": 0.0, "stop": 9.0},
                              {"action": "compute", "start": 2.0, "stop": 3.0}]},
              {"startstops": [{"action": "compute", "start": 2.5, "stop": 4.5}]}]
    assert tasks_window(stream) == 2.5
    assert tasks_window([]) == 0.0


def test_engine_benchmark_ratios_pair_repetitions():
    import engine

    results = {e: {"decode": [{"rep": rep, "batch": b, "tokens_per_s": v}
                              for rep, b, v in rows]}
               for e, rows in {"llamacpp": [(0, 1, 10.0), (0, 32, 40.0), (1, 1, 20.0), (1, 32, 60.0)],
                               "transformers": [(0, 1, 5.0), (0, 32, 20.0), (1, 1, 5.0)]}.items()}
    # per-repetition ratios, then their median: (4 + 3) / 2
    assert engine.decode_ratio(results, ("llamacpp", 32), ("llamacpp", 1)) == pytest.approx(3.5)
    # only repetitions that measured both sides count
    assert engine.decode_ratio(results, ("llamacpp", 32), ("transformers", 32)) == pytest.approx(2.0)
    assert engine.decode_ratio(results, ("torch", 1), ("transformers", 1)) is None
    results["llamacpp"]["summary"] = {"prefix_speedup": 4.0}
    args = engine.parse_args(["--batch-sizes", "1", "32"])
    found = {r["ratio"]: r for r in engine.ratios(results, args)}
    assert found["llamacpp decode@32 / decode@1"]["met"] is True
    assert found["llamacpp TTFT cold / warm prefix"]["met"] is False
    assert found["llamacpp / transformers decode@1"]["target"] is None
    assert not any(name.startswith("torch") for name in found)
    assert engine._common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


@pytest.mark.bits
@pytest.mark.slow
def test_engine_benchmark_quick_mode_measures_engines_side_by_side(tmp_path, daskllm_cache):
    out = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["args"]["model"] == "tiny" and list(report["engines"]) == ["torch", "transformers"]
    for name, result in report["engines"].items():
        s = result["summary"]
        assert s["prefill_tokens_per_s"] > 0 and s["cold_ttft_s"] > 0, name
        assert set(s["decode_tokens_per_s"]) == {"1", "8"} and all(v > 0 for v in s["decode_tokens_per_s"].values())
        assert all(x["generated_tokens"] == x["batch"] * 8 for x in result["decode"])
    torch_summary = report["engines"]["torch"]["summary"]
    assert torch_summary["warm_ttft_s"] > 0 and torch_summary["cold_num_cached_tokens"] == [0]
    assert torch_summary["warm_num_cached_tokens"] == [128]
    # the torch engine is batch-invariant by construction
    assert torch_summary["agreement"]["identical"] == 16
    assert report["engines"]["transformers"]["summary"]["warm_ttft_s"] is None  # no prefix cache
    assert {"torch / transformers decode@1", "torch / transformers decode@8"} <= {r["ratio"] for r in report["ratios"]}
    assert "| measurement | torch | transformers |" in done.stdout and "no prefix cache" in done.stdout


@pytest.mark.bits
@pytest.mark.slow
def test_gpu_engine_benchmark_quick_mode_measures_both_systems(tmp_path, daskllm_cache):
    out = tmp_path / "gpu_engine.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_engine.py"), "--quick", "--nano-transformers",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["args"]["model"] == "tiny" and report["args"]["device"] == "cpu"
    assert list(report["engines"]) == ["daskllm", "transformers"]
    for name, result in report["engines"].items():
        s = result["summary"]
        assert set(s["decode_tokens_per_s"]) == {"1", "8"} and all(v > 0 for v in s["decode_tokens_per_s"].values())
        assert all(x["generated_tokens"] == x["batch"] * 8 for x in result["decode"]), name
        assert s["prefill_tokens_per_s"] > 0 and s["cold_ttft_s"] > 0, name
        assert s["nano_tokens_per_s"] > 0 and s["nano_bound_ratio"] > 0, name
        assert [x["output_tokens"] for x in result["nano"]] == [sum(report["nano_workload"]["output_lengths"])]
    daskllm = report["engines"]["daskllm"]["summary"]
    assert daskllm["warm_ttft_s"] > 0 and daskllm["prefix_speedup"] > 0 and daskllm["warm_num_cached_tokens"] == [128]
    assert report["engines"]["transformers"]["summary"]["warm_ttft_s"] is None  # no prefix cache
    # the torch engine is batch-invariant on the CPU: every comparison is exact
    assert daskllm["exactness"] == {"prompts": 8, "together": 8, "staggered": 8, "cached_prefix": 8}
    assert report["exact"] is True
    assert report["bound"]["bound_s"] > 0 and report["machine"]["copy_bandwidth_bytes_per_s"] > 0
    found = {r["ratio"]: r for r in report["ratios"]}
    assert {"daskllm / transformers decode@1 tokens/s", "daskllm / transformers decode@8 tokens/s",
            "daskllm / transformers nano tokens/s"} <= set(found)
    assert found["daskllm nano time / memory-traffic bound"]["value"] > 0
    assert "| measurement | daskllm | transformers |" in done.stdout and "no prefix cache" in done.stdout


def test_prefill_profile_splits_the_time_by_kind(tmp_path, tiny_model_dir, capsys):
    import prefill_profile

    out = tmp_path / "profile.json"
    assert prefill_profile.main(["--model", str(tiny_model_dir), "--lengths", "48", "96", "--step-tokens", "64",
                                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["results"]] == [48, 96]
    for r in report["results"]:
        assert r["seconds"] > 0 and sum(r["share"].values()) == pytest.approx(1.0)
        assert r["share"]["projections"] > 0 and r["share"]["attention products"] > 0  # the kinds are recognised
    assert "| 96 |" in capsys.readouterr().out


@pytest.mark.parametrize("isa", [None, "AVX2"], ids=["this-cpu", "onednn-avx2"])
def test_cpu_products_times_every_path_at_every_row_count(isa, capsys):
    """bench/cpu_products.py names the path it measured for each dtype and times every way; with
    oneDNN held to AVX2 (as on a CPU without AVX-512) bfloat16 runs widened to float32's path."""
    args = ["--threads", "1", "--rows", "1", "3", "--blocks", "8"]
    if isa is None:
        import cpu_products

        cpu_products.main(args)
        out = capsys.readouterr().out
    else:
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_products.py"), *args], check=True,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa}).stdout
        assert "bfloat16 products: oneDNN on prepared weights" in out and "(widened to float32" in out
    lines = out.splitlines()
    assert "float32 products: " in lines[0] and "bfloat16 products: " in lines[0]
    assert lines[1].split() == ["rows", "fp32", "fp32-path", "bf16", "bf16-path", "bf16-b8"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"]
    assert all(float(ms) > 0 for line in lines[2:] for ms in line.split()[1:])


def test_engine_startup_times_the_engines_phases_to_its_first_token(daskllm_cache, capsys):
    """bench/engine_startup.py's per-process start (``--child``), in this process: the engine's
    load phases and the time to the first token, and the table of a cold and a warm start."""
    import engine_startup

    args = engine_startup.parse_args(["--model", "tiny", "--device", "cpu"])
    start = engine_startup.child(args)
    assert set(start["phases"]) == {"recipe", "model", "kv_cache", "cuda_graphs"}  # no GPU: no kernels phase
    assert start["first_token_s"] >= start["engine_s"] > 0 and start["device"] == "cpu"
    table = engine_startup.markdown({"model": "tiny", "cold": start, "warm": start})
    assert "| kv_cache |" in table and "**`TorchEngine()` to the first token**" in table


@pytest.mark.slow
def test_the_gpu_compile_check_compiles_every_kernel_for_hopper(tmp_path):
    """bench/gpu_compile_check.py on this CPU machine: every kernel an engine launches for llama-1b
    compiles for sm_90 with Triton's own ptxas, within the GPU's shared memory; a product plan's
    configs all get wgmma; prefill attention tiles get wgmma, decode tiles mma.sync (which is why
    the engine checks their bits on the device before using them)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # other test modules set it
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_compile_check.py"), "--max-seqs", "64",
                           "--max-tokens", "4096", "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == []
    kinds = {(k["kernel"], k["constants"].get("ROWS"), k["constants"].get("SPLIT")): k["instruction"]
             for k in report["kernels"]}
    assert {"_matmul_kernel", "_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_and_cache_kernel",
            "_paged_attention_kernel", "_combine_paged_attention_kernel"} == {kernel for kernel, _, _ in kinds}
    assert {k["instruction"] for k in report["kernels"] if k["kernel"] == "_matmul_kernel"} == {"wgmma"}
    assert kinds[("_paged_attention_kernel", 128, False)] == "wgmma"
    assert kinds[("_paged_attention_kernel", 16, False)] == kinds[("_paged_attention_kernel", 16, True)] == "mma.sync"
    assert all(k["fits"] for k in report["kernels"])
    assert "| _matmul_kernel |" in done.stdout


class _FakeEngine:
    """An engine whose answer is a function of the prompt alone (as greedy decoding is): what
    both vLLM-alone orchestrations must then agree on, whatever they batch together."""

    def __init__(self):
        self.in_flight = self.most_in_flight = 0

    def answer(self, call):
        from daskllm.prompts import tokenizer_for
        from pipelines.vllm_alone import Output

        seed = sum(i * (k + 1) for k, i in enumerate(call.prompt_ids))
        if call.allowed_token_ids:  # choose: one of the options' first tokens
            token = call.allowed_token_ids[seed % len(call.allowed_token_ids)]
            return Output(tokenizer_for(call.model).tokenizer.decode([token]), 1)
        return Output(f"w{seed % 997}\nx{seed % 89}", call.max_tokens)

    async def generate(self, call):
        import asyncio

        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        return self.answer(call)


class _FakeRetrieval:
    def search(self, queries, k):
        from daskllm.index import Hit

        return [[Hit(i, 0.0, f"passage {i}") for i in sorted({sum(map(ord, q)) % (7 + j) for j in range(k)})][:k]
                for q in queries]

    def rerank(self, query, docs, k):
        from daskllm.prompts import render_value

        return sorted(map(render_value, docs))[:k]


def test_vllm_alone_orchestrations_agree_and_batch_as_their_baselines(tiny_model_dir):
    """vllm-opwise and vllm-batch (pipelines/vllm_alone.py) on a fake engine, every pipeline:
    the same outputs; op-wise sends an operator's calls in one batch, batch sends every ready
    call at once."""
    from pipelines import TWO_MODELS, registry
    from pipelines.data import Inputs
    from pipelines.ops import plain
    from pipelines.vllm_alone import EventLoopThread, Lockstep, RunUsage, VLLMBatch, VLLMOpwise

    inputs = Inputs([f"How does module {m} start?" for m in ("os", "re", "json")], None,
                    [[f"doc {q}.{d}" for d in range(4)] for q in range(3)])
    engine, loop = _FakeEngine(), EventLoopThread()
    try:
        for name, fn in registry().items():
            config = {"model": "tiny", "max_tokens": 4, **({"model2": "tiny"} if name in TWO_MODELS else {})}
            lockstep = Lockstep(lambda calls: [engine.answer(c) for c in calls])
            ops = VLLMOpwise("tiny", ignore_eos=True, lockstep=lockstep, retrieval=_FakeRetrieval())
            opwise = plain(fn(inputs, ops, **config))
            usage = RunUsage()
            engine.most_in_flight = 0
            batch = loop.run(VLLMBatch("tiny", engine.generate, _FakeRetrieval(), usage=usage, ignore_eos=True)
                             .run(fn, inputs, config), timeout=60)
            assert opwise == batch, name
            assert sum(lockstep.batches) == usage.calls > 0 and usage.distinct_prompt_tokens > 0, name
            if name == "w2":  # three operators over three queries, each waiting on the last
                assert lockstep.batches == [3, 3, 3] and engine.most_in_flight == 3
            if name == "w4":  # op-wise: one perspective's judgments at a time; batch: all of them at once
                assert lockstep.batches == [3, 3, 3, 3] and engine.most_in_flight == 9
    finally:
        loop.close()
