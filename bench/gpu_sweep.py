"""The papers' pipelines on a GPU: daskllm against op-wise and plain Dask at full width, as two commands.

    python bench/gpu_sweep.py --calls small --deadline 320 --out $OUT         # command 1: 17 pipelines at 64
    python bench/gpu_sweep.py --calls large,shared --deadline 320 --out $OUT  # command 2: 256 queries; 2 workers
    python bench/gpu_sweep.py --dry-run                      # the plan: every harness call and its command
    python bench/gpu_sweep.py --report-only --merge one/ two/ --out all/    # one report from both commands
    python bench/gpu_sweep.py --quick --out /tmp/sweep       # on the CPU: tiny, 4 and 8 queries, 3 pipelines

What it runs, each call one ``bench/harness.py`` process with one cluster (each model built,
the index built and the engines calibrated once per call; a subprocess killed with its workers
after ``--call-timeout`` seconds or what is left of ``--deadline``):

- ``small``: all 17 reference pipelines (docs/pipelines.md) at ``--queries-small`` (64), one
  worker of ``--threads`` (16) Dask threads;
- ``large``: w2, mapred, naive_rag and factool at ``--queries-large`` (256), the same worker;
- ``shared``: the prefix-heavy mapred, debate, trading and w4 at ``--queries-small`` on two
  workers sharing the GPU (``--workers-per-gpu 2``: each engine half the memory), daskllm
  against the harness's ``-placement`` (plain Dask placement): cache- and load-aware placement
  measured on a GPU.

``small`` and ``large`` run ``daskllm`` first, then the full-width baselines ``opwise`` and
``dask`` (every ready call dispatched; ``--held`` adds ``opwise-held`` and ``dask-held``, the
thread-capped baselines of earlier measurements). The harness rewrites its JSON after every
run, so a call cut short still leaves each finished pipeline's rows, daskllm's first. Each
pipeline's unmeasured warm-up runs daskllm on all its queries (``--warmup-queries`` fewer, to
save time; on CPU, factool at 64 queries took daskllm 79.4 s after a 16-query warm-up and
68.8 s after a full one, back to back, the same 1,732 tasks: the warm-up's size is part of the
method).

What it writes in ``--out``: per call ``<call>.json`` (the harness's ``--json``), ``.md`` (its
table), ``.log`` (its progress) and ``.call.json`` (the command, exit status, wall time and the
machine: device, torch/transformers/triton/dask versions); then, merged over every call found
in ``--out`` and the ``--merge`` folders (the latest per pipeline, query size and call kind),
``sweep.json`` and ``sweep.md``: the calls with their exact commands, one row per pipeline and
query size (each system's wall seconds and mean engine batch, the baselines' time over
daskllm's, daskllm's efficiency, exactness), the shared-GPU rows, and the targets, each met, not
met or incomplete (not every pipeline it needs measured yet):

- every output exact on every pipeline (every system returned the first run's tokens);
- at 64 queries over the 17 pipelines, daskllm >= 1.5x (geometric mean) over each full-width
  baseline, and no pipeline below 1.0x of either;
- at 256 queries, >= 1.5x over each baseline on w2, mapred, naive_rag and factool, and
  daskllm's mean engine batch >= 200;
- daskllm's efficiency >= 0.7 on w2 and mapred at 256 queries, >= 0.4 on every RAG pipeline at 64;
- two workers on one GPU: daskllm >= 1.2x over ``-placement`` on mapred and trading.

The report is rewritten after every call. Exit status 1 if any output is not exact, 2 if a
call failed, timed out or was skipped by ``--deadline`` (and every output found was exact),
else 0: unmet speed targets are reported, not failures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARNESS = "bench/harness.py"
SYSTEMS = ("daskllm", "opwise", "dask")  # daskllm first: a call cut short still has its runs
HELD = ("opwise-held", "dask-held")  # the thread-capped baselines (--held)
REFERENCE = ("naive_rag", "advanced_rag", "w1", "w2", "w3", "w4", "w5", "w6", "mapred", "debate", "reflect",
             "iterative", "parallel", "trading", "factool", "corrective_rag", "adaptive_rag")
LARGE = ("w2", "mapred", "naive_rag", "factool")  # the pipelines measured at the large query size
EFFICIENT = ("w2", "mapred")  # efficiency >= 0.7 at the large query size
RAG = ("naive_rag", "advanced_rag", "corrective_rag", "adaptive_rag")  # efficiency >= 0.4 at the small size
SHARED = ("mapred", "debate", "trading", "w4")  # prefix-heavy: two workers sharing the GPU
SHARED_TARGETS = ("mapred", "trading")  # daskllm >= 1.2x over -placement there
CALLS = ("small", "large", "shared")
TARGET_SPEEDUP, TARGET_FLOOR, TARGET_BATCH = 1.5, 1.0, 200
TARGET_EFFICIENCY, TARGET_RAG_EFFICIENCY, TARGET_PLACEMENT = 0.7, 0.4, 1.2
QUICK_PIPELINES = ("w2", "naive_rag", "factool")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-sweep",
                   help="folder for every call's files and the report (default: $OUT, else /tmp/gpu-sweep)")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--model2", default="tiny", help="the second model of w3 and w5 (the harness's default)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=16, help="Dask threads per worker (the GPU machine's cores)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="repetitions per call (the harness reports medians)")
    p.add_argument("--index-docs", type=int, default=2000, help="passages in the search index")
    p.add_argument("--queries-small", type=int, default=64, help="queries for every pipeline")
    p.add_argument("--queries-large", type=int, default=256, help=f"queries for {', '.join(LARGE)}")
    p.add_argument("--pipelines", default=None, help="comma-separated subset of the reference pipelines")
    p.add_argument("--calls", default=",".join(CALLS), help=f"which calls, comma-separated from {', '.join(CALLS)}")
    p.add_argument("--held", action="store_true", help=f"also the thread-capped baselines {', '.join(HELD)}")
    p.add_argument("--warmup-queries", type=int, default=None,
                   help="queries of the harness's unmeasured warm-up run per pipeline (default: all, as the harness)")
    p.add_argument("--call-timeout", type=float, default=540, help="seconds per harness call")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for this whole command: each call's timeout shrinks to fit, and calls "
                        "that would start with under --min-call seconds left are skipped")
    p.add_argument("--min-call", type=float, default=60)
    p.add_argument("--harness-args", default="", help="more harness options, one string (e.g. '--source stdlib')")
    p.add_argument("--merge", nargs="*", default=[], help="more folders of earlier calls to report on")
    p.add_argument("--report-only", action="store_true", help="run nothing: report on --out and --merge")
    p.add_argument("--dry-run", action="store_true", help="print the plan (calls and commands) and stop")
    p.add_argument("--quick", action="store_true",
                   help=f"a CPU try: tiny, 4 and 8 queries, 4 tokens, an index of 200 passages, "
                        f"{', '.join(QUICK_PIPELINES)}, 4 threads, the small and large calls")
    if p.parse_args(argv).quick:  # new defaults: options given explicitly still win
        p.set_defaults(model="tiny", queries_small=4, queries_large=8, max_tokens=4, index_docs=200, threads=4,
                       repeats=1, pipelines=",".join(QUICK_PIPELINES), calls="small,large")
    args = p.parse_args(argv)
    selected = REFERENCE if not args.pipelines else tuple(args.pipelines.split(","))
    unknown = [n for n in selected if n not in REFERENCE]
    unknown += [c for c in args.calls.split(",") if c not in CALLS]
    if unknown:
        p.error(f"unknown pipelines or calls {unknown}: pipelines from {', '.join(REFERENCE)}; "
                f"calls from {', '.join(CALLS)}")
    args.selected = [n for n in REFERENCE if n in selected]
    args.chosen_calls = [c for c in CALLS if c in args.calls.split(",")]
    return args


# --- the plan ------------------------------------------------------------------------------


def plan(args) -> list[dict]:
    """Every harness call this sweep makes, in order."""
    kinds = {"small": (args.queries_small, REFERENCE, args.workers, None, SYSTEMS + (HELD if args.held else ())),
             "large": (args.queries_large, LARGE, args.workers, None, SYSTEMS + (HELD if args.held else ())),
             "shared": (args.queries_small, SHARED, 2, 2, ("daskllm", "-placement"))}
    calls = []
    for kind in args.chosen_calls:
        queries, wanted, workers, per_gpu, systems = kinds[kind]
        names = [n for n in wanted if n in args.selected]
        if not names:
            continue
        name = f"q{queries}-{kind}"
        cmd = [sys.executable, HARNESS, "--pipelines", ",".join(names), "--systems", ",".join(systems),
               "--queries", str(queries), "--model", args.model, "--model2", args.model2,
               "--workers", str(workers), *(["--workers-per-gpu", str(per_gpu)] if per_gpu else []),
               "--threads", str(args.threads), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
               *(["--warmup-queries", str(args.warmup_queries)] if args.warmup_queries is not None else []),
               "--index-docs", str(args.index_docs),
               *shlex.split(args.harness_args), "--json", str(pathlib.Path(args.out).resolve() / f"{name}.json")]
        calls.append({"name": name, "kind": kind, "queries": queries, "pipelines": names, "argv": cmd,
                      "command": shlex.join(cmd)})
    return calls


# --- running -------------------------------------------------------------------------------

PROBE = r"""
import json, platform
info = {"python": platform.python_version(), "host": platform.node()}
try:
    import torch
    info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
except ImportError:
    info["torch"], info["device"] = None, "unknown (no torch)"
for name in ("transformers", "triton", "dask", "distributed"):
    try:
        info[name] = __import__(name).__version__
    except ImportError:
        info[name] = None
print(json.dumps(info))
"""


def probe() -> dict:
    """The device and the versions that matter, from a child (this process stays free of CUDA)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode:
        return {"device": "unknown", "probe_error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_line(m: dict) -> str:
    cuda = f" (CUDA {m['cuda']})" if m.get("cuda") else ""
    return (f"{m.get('device')}: torch {m.get('torch')}{cuda}, transformers {m.get('transformers')}, "
            f"triton {m.get('triton') or 'none'}, dask {m.get('dask')}, distributed {m.get('distributed')}, "
            f"Python {m.get('python')}")


def _stop(proc: subprocess.Popen) -> None:
    """End the harness and everything it started (its workers share its process group)."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            # the harness has gone: make sure nothing of its group lingers
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_call(call: dict, out: pathlib.Path, timeout: float, machine: dict) -> dict:
    """One harness call: its table to <name>.md, its progress to <name>.log (and to our stderr)."""
    stem = out / call["name"]
    json_path = stem.with_suffix(".json")
    json_path.unlink(missing_ok=True)
    log(f"[{call['name']}] {call['command']}  (timeout {timeout:.0f} s)")
    start = time.perf_counter()
    with open(stem.with_suffix(".md"), "w") as md, open(stem.with_suffix(".log"), "w") as err:
        proc = subprocess.Popen(call["argv"], cwd=ROOT, stdout=md, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

        def pump():
            for line in proc.stderr:
                err.write(line)
                err.flush()
                sys.stderr.write(f"[{call['name']}] {line}")

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
        try:
            rc = proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, timed_out = proc.returncode, True
        pumping.join(10)
    seconds = time.perf_counter() - start
    found = json_path.exists()
    if timed_out:
        status = "timed out"
    elif rc == 0 and found:
        status = "ok"
    elif rc == 1 and found:
        status = "not exact"  # the harness wrote its numbers and exits 1 when outputs differ
    else:
        status = f"failed (exit {rc})"
    record = {**{k: v for k, v in call.items() if k != "argv"}, "status": status, "returncode": rc,
              "seconds": seconds, "timeout": timeout, "finished": time.time(), "machine": machine,
              "json": json_path.name if found else None}
    stem.with_suffix(".call.json").write_text(json.dumps(record, indent=1))
    log(f"[{call['name']}] {status} after {seconds:.0f} s")
    return record


def skipped(call: dict, out: pathlib.Path, why: str, machine: dict) -> dict:
    record = {**{k: v for k, v in call.items() if k != "argv"}, "status": f"skipped ({why})", "returncode": None,
              "seconds": 0.0, "finished": time.time(), "machine": machine, "json": None}
    (out / f"{call['name']}.call.json").write_text(json.dumps(record, indent=1))
    log(f"[{call['name']}] skipped: {why}")
    return record


# --- the report ----------------------------------------------------------------------------


def load(folders: list[pathlib.Path]) -> list[dict]:
    """Every call record in the folders, each with its harness report (``harness``) where there is one."""
    records = []
    for folder in folders:
        for path in sorted(folder.glob("*.call.json")):
            record = json.loads(path.read_text())
            record["folder"] = str(folder)
            if record.get("json") and (folder / record["json"]).exists():
                record["harness"] = json.loads((folder / record["json"]).read_text())
            records.append(record)
    return sorted(records, key=lambda r: r.get("finished", 0))


def rows_from(records: list[dict]) -> list[dict]:
    """One row per pipeline, query size and call kind, from the latest call that measured it
    (a call cut short: the systems it ran)."""
    found: dict[tuple[str, int, str], dict] = {}
    for record in records:  # oldest first: later calls replace earlier ones
        harness = record.get("harness")
        if not harness:
            continue
        queries, kind = harness["args"]["queries"], record.get("kind", "small")
        for result in harness["results"]:
            s = result["systems"]
            if "daskllm" not in s:
                continue
            row = {"pipeline": result["pipeline"], "queries": queries, "kind": kind, "call": record["name"],
                   "efficiency": s["daskllm"]["efficiency"], "exact": all(x["exact"] for x in s.values()),
                   "daskllm_hit_rate": s["daskllm"]["hit_rate"]}
            for system, x in s.items():
                row[f"{system}_s"], row[f"{system}_batch"] = x["seconds"], x["mean_batch"]
                if system != "daskllm":
                    row[f"vs_{system}"] = x["vs_daskllm"]
            found[(result["pipeline"], queries, kind)] = row
    order = {n: i for i, n in enumerate(REFERENCE)}
    return sorted(found.values(), key=lambda r: (CALLS.index(r["kind"]) if r["kind"] in CALLS else 9, r["queries"],
                                                 order.get(r["pipeline"], 99)))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _verdict(measured: int, wanted: int, ok: bool, decided_early: bool = False) -> str:
    """met / not met / incomplete: a floor broken on a subset is already not met."""
    if decided_early:
        return "not met"
    if measured < wanted:
        return "incomplete"
    return "met" if ok else "not met"


def _floor(rows: list[dict], key: str, wanted: list, text: str, bound: float, fmt: str = ".2f", unit: str = "x") -> dict:
    """Target: every wanted row's ``key`` at least ``bound`` (decided early by one below it)."""
    vals = [(r[key], r["pipeline"]) for r in rows if r.get(key) is not None and r["pipeline"] in wanted]
    low = min(vals) if vals else None
    return {"target": text, "value": (f"min {low[0]:{fmt}}{unit} ({low[1]}); " + ", ".join(
                f"{n} {v:{fmt}}" for v, n in vals)) if low else "-",
            "status": _verdict(len(vals), len(wanted), bool(low) and low[0] >= bound,
                               decided_early=bool(low) and low[0] < bound)}


def targets(rows: list[dict], records: list[dict], args) -> list[dict]:
    """The targets on the pipelines measured so far (reference sets cut to the selected ones)."""
    sel = args.selected
    want_small, want_large = [n for n in REFERENCE if n in sel], [n for n in LARGE if n in sel]
    small = [r for r in rows if r["kind"] == "small"]
    large = [r for r in rows if r["kind"] == "large"]
    shared = [r for r in rows if r["kind"] == "shared"]
    out = []
    inexact = [f"{r['pipeline']}@{r['queries']}/{r['kind']}" for r in rows if not r["exact"]]
    broken = [r["name"] for r in records if r["status"] not in ("ok", "not exact")
              and not any(row["call"] == r["name"] for row in rows)]
    wanted = len(want_small) * ("small" in args.chosen_calls) + len(want_large) * ("large" in args.chosen_calls)
    out.append({"target": "every output exact on every pipeline (every system, every call)",
                "value": f"{sum(r['exact'] for r in rows)} of {len(rows)} exact"
                         + (f"; differ: {', '.join(inexact)}" if inexact else ""),
                "status": _verdict(len(small) + len(large), wanted, not inexact and not broken,
                                   decided_early=bool(inexact))})
    q_small, q_large = args.queries_small, args.queries_large
    for baseline, label in (("dask", "plain Dask"), ("opwise", "op-wise")):
        vals = [r[f"vs_{baseline}"] for r in small if r.get(f"vs_{baseline}")]
        g = geomean(vals) if vals else None
        out.append({"target": f"{q_small} queries, {len(want_small)} pipeline(s): daskllm >= {TARGET_SPEEDUP:g}x "
                              f"over {label} at full width (geometric mean)",
                    "value": f"{g:.2f}x over {len(vals)}" if g else "-",
                    "status": _verdict(len(vals), len(want_small), bool(g) and g >= TARGET_SPEEDUP)})
    for baseline, label in (("dask", "plain Dask"), ("opwise", "op-wise")):
        out.append(_floor(small, f"vs_{baseline}", want_small,
                          f"{q_small} queries: no pipeline below {TARGET_FLOOR:g}x of {label}", TARGET_FLOOR))
    for baseline, label in (("dask", "plain Dask"), ("opwise", "op-wise")):
        out.append(_floor(large, f"vs_{baseline}", want_large,
                          f"{q_large} queries, {', '.join(want_large)}: each >= {TARGET_SPEEDUP:g}x over {label}",
                          TARGET_SPEEDUP))
    out.append(_floor(large, "daskllm_batch", want_large,
                      f"{q_large} queries: daskllm's mean engine batch >= {TARGET_BATCH}", TARGET_BATCH, ".0f", ""))
    out.append(_floor(large, "efficiency", [n for n in EFFICIENT if n in sel],
                      f"{q_large} queries, {', '.join(EFFICIENT)}: daskllm's efficiency >= {TARGET_EFFICIENCY:g}",
                      TARGET_EFFICIENCY, ".2f", ""))
    out.append(_floor(small, "efficiency", [n for n in RAG if n in sel],
                      f"{q_small} queries, the RAG pipelines: daskllm's efficiency >= {TARGET_RAG_EFFICIENCY:g}",
                      TARGET_RAG_EFFICIENCY, ".2f", ""))
    if "shared" in args.chosen_calls:
        out.append(_floor(shared, "vs_-placement", [n for n in SHARED_TARGETS if n in sel],
                          f"two workers on one GPU, {', '.join(SHARED_TARGETS)}: daskllm >= {TARGET_PLACEMENT:g}x "
                          f"over -placement", TARGET_PLACEMENT))
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(report: dict) -> str:
    s = report["settings"]
    machines = list(dict.fromkeys(machine_line(r["machine"]) for r in report["calls"] if r.get("machine")))
    lines = ["# GPU sweep: the papers' pipelines, daskllm against op-wise and plain Dask at full width", ""]
    lines += [f"Machine: {m}" for m in machines] or ["Machine: -"]
    lines += ["", f"Model `{s['model']}` (second model `{s['model2']}`), {s['workers']} worker(s) x {s['threads']} "
              f"threads (the shared call: 2 workers on one GPU), {s['max_tokens']} tokens per call, {s['repeats']} "
              f"repetition(s) (median), index of {s['index_docs']} passages. vs X = X's wall time / daskllm's in the "
              "same repetition (above 1: daskllm faster); batch = the engines' mean batch; efficiency = daskllm's "
              "ideal time / its actual time.", "",
              "| call | queries | pipelines | status | wall s | device | harness command |",
              "|---|---|---|---|---|---|---|"]
    for r in report["calls"]:
        lines.append(f"| {r['name']} | {r['queries']} | {', '.join(r['pipelines'])} | {r['status']} | "
                     f"{r['seconds']:.0f} | {(r.get('machine') or {}).get('device', '-')} | `{r['command']}` |")
    rows = [r for r in report["rows"] if r["kind"] != "shared"]
    held = any("opwise-held_s" in r for r in rows)
    extra = list(HELD) if held else []
    lines += ["", "| pipeline | queries | daskllm s (batch) | op-wise s (batch) | Dask s (batch) | "
              + "".join(f"{h} s (batch) | " for h in extra)
              + "vs Dask | vs op-wise | " + "".join(f"vs {h} | " for h in extra) + "efficiency | exact |",
              "|---|---|---|---|---|" + "---|" * (2 * len(extra)) + "---|---|---|---|"]
    for r in rows:
        cells = [f"{_f(r.get(f'{x}_s'), '.2f')} ({_f(r.get(f'{x}_batch'), '.0f')})"
                 for x in ("daskllm", "opwise", "dask", *extra)]
        ratios = [_f(r.get(f"vs_{x}"), ".2f") for x in ("dask", "opwise", *extra)]
        lines.append(f"| {r['pipeline']} | {r['queries']} | " + " | ".join(cells + ratios)
                     + f" | {_f(r['efficiency'], '.2f')} | {'yes' if r['exact'] else 'NO'} |")
    shared = [r for r in report["rows"] if r["kind"] == "shared"]
    if shared:
        lines += ["", "Two workers on one GPU (each engine half the memory):", "",
                  "| pipeline | queries | daskllm s (batch) | -placement s (batch) | vs -placement | hit rate | exact |",
                  "|---|---|---|---|---|---|---|"]
        for r in shared:
            lines.append(f"| {r['pipeline']} | {r['queries']} | {_f(r.get('daskllm_s'), '.2f')} "
                         f"({_f(r.get('daskllm_batch'), '.0f')}) | {_f(r.get('-placement_s'), '.2f')} "
                         f"({_f(r.get('-placement_batch'), '.0f')}) | {_f(r.get('vs_-placement'), '.2f')} | "
                         f"{_f(r['daskllm_hit_rate'], '.2f')} | {'yes' if r['exact'] else 'NO'} |")
    lines += ["", "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {t['status']} |" for t in report["targets"]]
    return "\n".join(lines)


def build_report(args, folders: list[pathlib.Path]) -> dict:
    records = load(folders)
    latest = {}
    for r in sorted(records, key=lambda r: ("harness" in r, r.get("finished", 0))):
        latest[r["name"]] = r  # a call run again replaces its earlier record, unless only the earlier has numbers
    calls = [{k: v for k, v in r.items() if k != "harness"} for r in latest.values()]
    rows = rows_from(records)
    settings = {k: getattr(args, k) for k in ("model", "model2", "workers", "threads", "max_tokens", "repeats",
                                              "index_docs", "queries_small", "queries_large")}
    settings["pipelines"] = args.selected
    return {"settings": settings, "calls": calls, "rows": rows, "targets": targets(rows, calls, args),
            "exact": all(r["exact"] for r in rows),
            "complete": all(r["status"] in ("ok", "not exact") for r in calls)}


def write_report(args, out: pathlib.Path) -> dict:
    folders = [out, *(pathlib.Path(m) for m in args.merge)]
    report = build_report(args, folders)
    report["markdown"] = markdown(report)
    (out / "sweep.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "sweep.md").write_text(report["markdown"] + "\n")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    calls = plan(args)
    if args.dry_run:
        for c in calls:
            print(f"{c['name']}: {c['command']}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        start = time.perf_counter()
        machine = probe()
        log(f"machine: {machine_line(machine)}")
        log(f"running {len(calls)} harness call(s): {', '.join(c['name'] for c in calls)}")
        for call in calls:
            timeout = args.call_timeout
            if args.deadline is not None:
                left = args.deadline - (time.perf_counter() - start) - 5  # 5 s to write the report
                if left < args.min_call:
                    skipped(call, out, f"{left:.0f} s left of --deadline", machine)
                    continue
                timeout = min(timeout, left)
            run_call(call, out, timeout, machine)
            write_report(args, out)
    report = write_report(args, out)
    print(report["markdown"])
    log(f"wrote {out / 'sweep.json'} and {out / 'sweep.md'}")
    if not report["exact"]:
        log("some system's outputs differ from the first run's")
        return 1
    return 0 if report["complete"] else 2


if __name__ == "__main__":
    sys.exit(main())
