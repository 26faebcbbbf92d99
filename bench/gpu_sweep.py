"""The papers' pipelines on a GPU: daskllm against op-wise and plain Dask, as one command.

    python bench/gpu_sweep.py --out $OUT                    # everything (longer than one 10-minute command)
    python bench/gpu_sweep.py --parts 3 --part 1 --out $OUT --deadline 560   # a third of it
    python bench/gpu_sweep.py --only-64 --out $OUT          # the 17 pipelines at 64 queries only
    python bench/gpu_sweep.py --dry-run --parts 3           # the plan: every harness call, per part
    python bench/gpu_sweep.py --report-only --merge part1/ part2/ part3/ --out all/   # one report from parts
    python bench/gpu_sweep.py --quick --out /tmp/sweep      # on the CPU: tiny, 4 and 8 queries, 3 pipelines

What it runs: all 17 reference pipelines (docs/pipelines.md) at ``--queries-small`` (64)
queries, and w2, mapred, naive_rag and factool at ``--queries-large`` (256), each under the
systems ``opwise``, ``dask`` and ``daskllm``, model ``--model`` (llama-1b), one worker of
``--threads`` (16) Dask threads, by calling ``bench/harness.py`` once per group of pipelines
(a subprocess with its own cluster, killed with its workers after ``--call-timeout``
seconds), so each call stays short. ``--parts N --part K`` runs the K-th of N parts (groups
spread over parts by an estimated cost), ``--only-64`` / ``--only-256`` one query size.

What it writes in ``--out``: per call ``q<queries>-<group>.json`` (the harness's ``--json``),
``.md`` (its table), ``.log`` (its progress) and ``.call.json`` (the command, exit status,
wall time and the machine: device, torch/transformers/triton/dask versions); then, merged
over every call found in ``--out`` and the ``--merge`` folders (the latest per pipeline and
query size), ``sweep.json`` and ``sweep.md``: the calls with their exact commands, one row per
pipeline and query size (op-wise, Dask and daskllm wall seconds, the baselines' time over
daskllm's, daskllm's efficiency, exactness of every system) and the issue's targets, each
met, not met or incomplete (not every pipeline it needs measured yet):

- every output exact on every pipeline (every system returned the first run's tokens);
- at 64 queries over the 17 pipelines, daskllm >= 2x (geometric mean) over plain Dask and
  over op-wise, and no pipeline below 1.0x of either;
- at 256 queries, >= 2x over each baseline on w2, mapred, naive_rag and factool, and
  daskllm's efficiency >= 0.7 on w2 and mapred.

The report is rewritten after every call, so a command cut short still leaves one. Exit
status 1 if any output is not exact, 2 if a call failed, timed out or was skipped by
``--deadline`` (and every output found was exact), else 0: unmet speed targets are reported,
not failures.
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
SYSTEMS = ("opwise", "dask", "daskllm")
REFERENCE = ("naive_rag", "advanced_rag", "w1", "w2", "w3", "w4", "w5", "w6", "mapred", "debate", "reflect",
             "iterative", "parallel", "trading", "factool", "corrective_rag", "adaptive_rag")
LARGE = ("w2", "mapred", "naive_rag", "factool")  # the pipelines measured at the large query size
EFFICIENT = ("w2", "mapred")  # efficiency >= 0.7 at the large query size
# One harness call per group: a cluster, the index and the engines' calibration are paid once per call.
GROUPS_SMALL = {"rag": ("naive_rag", "advanced_rag", "corrective_rag", "adaptive_rag"),
                "halo": ("w1", "w2", "w3", "w4", "w5", "w6"),
                "helium1": ("mapred", "debate", "reflect", "iterative"),
                "helium2": ("parallel", "trading"),
                "alto": ("factool",)}
GROUPS_LARGE = {"w2-mapred": ("w2", "mapred"), "naive_rag": ("naive_rag",), "factool": ("factool",)}
# Relative cost per pipeline (op-wise + Dask + daskllm seconds in docs/benchmarks.md's CPU run at
# 12 queries), scaled by the query count: only to balance parts.
COST = {"naive_rag": 32, "advanced_rag": 44, "w1": 24, "w2": 17, "w3": 13, "w4": 23, "w5": 12, "w6": 17,
        "mapred": 38, "debate": 44, "reflect": 24, "iterative": 31, "parallel": 82, "trading": 110,
        "factool": 89, "corrective_rag": 23, "adaptive_rag": 18}
TARGET_SPEEDUP, TARGET_FLOOR, TARGET_EFFICIENCY = 2.0, 1.0, 0.7
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
    only = p.add_mutually_exclusive_group()
    only.add_argument("--only-small", "--only-64", dest="only", action="store_const", const="small",
                      help="only the calls at --queries-small")
    only.add_argument("--only-large", "--only-256", dest="only", action="store_const", const="large",
                      help="only the calls at --queries-large")
    p.add_argument("--one-call", action="store_true", help="one harness call per query size, not per group")
    p.add_argument("--parts", type=int, default=1, help="split the calls into this many parts ...")
    p.add_argument("--part", type=int, default=None, help="... and run this one (1-based; default: all)")
    p.add_argument("--call-timeout", type=float, default=540, help="seconds per harness call")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for this whole command: each call's timeout shrinks to fit, and calls "
                        "that would start with under --min-call seconds left are skipped")
    p.add_argument("--min-call", type=float, default=60)
    p.add_argument("--harness-args", default="", help="more harness options, one string (e.g. '--source stdlib')")
    p.add_argument("--merge", nargs="*", default=[], help="more folders of earlier calls to report on")
    p.add_argument("--report-only", action="store_true", help="run nothing: report on --out and --merge")
    p.add_argument("--dry-run", action="store_true", help="print the plan (calls, parts, commands) and stop")
    p.add_argument("--quick", action="store_true",
                   help=f"a CPU try: tiny, 4 and 8 queries, 4 tokens, an index of 200 passages, "
                        f"{', '.join(QUICK_PIPELINES)}, one call per query size, 4 threads")
    if p.parse_args(argv).quick:  # new defaults: options given explicitly still win
        p.set_defaults(model="tiny", queries_small=4, queries_large=8, max_tokens=4, index_docs=200, threads=4,
                       repeats=1, one_call=True, pipelines=",".join(QUICK_PIPELINES))
    args = p.parse_args(argv)
    selected = REFERENCE if not args.pipelines else tuple(args.pipelines.split(","))
    unknown = [n for n in selected if n not in REFERENCE]
    if unknown:
        p.error(f"unknown pipelines {unknown}: choose from {', '.join(REFERENCE)}")
    args.selected = [n for n in REFERENCE if n in selected]
    if args.parts < 1 or (args.part is not None and not 1 <= args.part <= args.parts):
        p.error("--part K needs 1 <= K <= --parts")
    return args


# --- the plan ------------------------------------------------------------------------------


def plan(args) -> list[dict]:
    """Every harness call this sweep makes (before --part selection), in order."""
    calls = []
    sizes = [("small", args.queries_small, GROUPS_SMALL, REFERENCE), ("large", args.queries_large, GROUPS_LARGE, LARGE)]
    for size, queries, groups, wanted in sizes:
        if args.only and args.only != size:
            continue
        if args.one_call:
            groups = {"all": tuple(n for n in REFERENCE if n in wanted)}
        for group, names in groups.items():
            names = [n for n in names if n in args.selected]
            if not names:
                continue
            name = f"q{queries}-{group}"
            cmd = [sys.executable, HARNESS, "--pipelines", ",".join(names), "--systems", ",".join(SYSTEMS),
                   "--queries", str(queries), "--model", args.model, "--model2", args.model2,
                   "--workers", str(args.workers), "--threads", str(args.threads),
                   "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
                   "--index-docs", str(args.index_docs), *shlex.split(args.harness_args),
                   "--json", str(pathlib.Path(args.out).resolve() / f"{name}.json")]
            calls.append({"name": name, "size": size, "queries": queries, "pipelines": names, "argv": cmd,
                          "command": shlex.join(cmd), "cost": sum(COST[n] for n in names) * queries / 64})
    return calls


def split(calls: list[dict], parts: int) -> list[list[dict]]:
    """Calls spread over parts, the costliest first onto the least loaded part; plan order kept within a part."""
    load, assigned = [0.0] * parts, [[] for _ in range(parts)]
    for i, call in sorted(enumerate(calls), key=lambda ic: (-ic[1]["cost"], ic[0])):
        k = min(range(parts), key=lambda j: (load[j], j))
        load[k] += call["cost"]
        assigned[k].append(i)
    return [[calls[i] for i in sorted(idx)] for idx in assigned]


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
    """One row per pipeline and query size, from the latest call that measured it."""
    found: dict[tuple[str, int], dict] = {}
    for record in records:  # oldest first: later calls replace earlier ones
        harness = record.get("harness")
        if not harness:
            continue
        queries = harness["args"]["queries"]
        for result in harness["results"]:
            s = result["systems"]
            found[(result["pipeline"], queries)] = {
                "pipeline": result["pipeline"], "queries": queries, "call": record["name"],
                "opwise_s": s["opwise"]["seconds"] if "opwise" in s else None,
                "dask_s": s["dask"]["seconds"] if "dask" in s else None,
                "daskllm_s": s["daskllm"]["seconds"],
                "vs_dask": s["dask"]["vs_daskllm"] if "dask" in s else None,
                "vs_opwise": s["opwise"]["vs_daskllm"] if "opwise" in s else None,
                "efficiency": s["daskllm"]["efficiency"],
                "exact": all(x["exact"] for x in s.values()),
                "daskllm_mean_batch": s["daskllm"]["mean_batch"], "daskllm_hit_rate": s["daskllm"]["hit_rate"],
                "daskllm_tasks": s["daskllm"]["tasks"], "dask_tasks": s["dask"]["tasks"] if "dask" in s else None,
            }
    order = {n: i for i, n in enumerate(REFERENCE)}
    return sorted(found.values(), key=lambda r: (r["queries"], order.get(r["pipeline"], 99)))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _verdict(measured: int, wanted: int, ok: bool, decided_early: bool = False) -> str:
    """met / not met / incomplete: a floor broken on a subset is already not met."""
    if decided_early:
        return "not met"
    if measured < wanted:
        return "incomplete"
    return "met" if ok else "not met"


def targets(rows: list[dict], records: list[dict], small: int, large: int, selected: list[str]) -> list[dict]:
    """The issue's targets on the pipelines measured so far (reference sets cut to ``selected``)."""
    want_small = [n for n in REFERENCE if n in selected]
    want_large = [n for n in LARGE if n in selected]
    want_eff = [n for n in EFFICIENT if n in selected]
    at = {(r["pipeline"], r["queries"]): r for r in rows}
    s_rows = [at[(n, small)] for n in want_small if (n, small) in at]
    l_rows = [at[(n, large)] for n in want_large if (n, large) in at]
    out = []

    inexact = [f"{r['pipeline']}@{r['queries']}" for r in rows if not r["exact"]]
    broken = [r["name"] for r in records if r["status"] not in ("ok", "not exact")
              and not any(row["call"] == r["name"] for row in rows)]
    out.append({"target": "every output exact on every pipeline (every system, every size)",
                "value": f"{sum(r['exact'] for r in rows)} of {len(rows)} exact"
                         + (f"; differ: {', '.join(inexact)}" if inexact else ""),
                "status": _verdict(len(s_rows) + len(l_rows), len(want_small) + len(want_large),
                                   not inexact and not broken, decided_early=bool(inexact))})
    for key, label in (("vs_dask", "plain Dask"), ("vs_opwise", "op-wise")):
        vals = [r[key] for r in s_rows if r[key]]
        g = geomean(vals) if vals else None
        out.append({"target": f"{small} queries, {len(want_small)} pipeline(s): daskllm >= {TARGET_SPEEDUP:g}x over "
                              f"{label} (geometric mean)",
                    "value": f"{g:.2f}x over {len(vals)}" if g else "-",
                    "status": _verdict(len(vals), len(want_small), bool(g) and g >= TARGET_SPEEDUP)})
    def lowest(rows: list[dict], key: str, wanted: list, text: str, bound: float) -> dict:
        """Target: every row's ``key`` at least ``bound`` (decided early by one below it)."""
        vals = [(r[key], r["pipeline"]) for r in rows if r[key]]
        low = min(vals) if vals else None
        return {"target": text, "value": f"min {low[0]:.2f}x ({low[1]})" if low else "-",
                "status": _verdict(len(vals), len(wanted), bool(low) and low[0] >= bound,
                                   decided_early=bool(low) and low[0] < bound)}

    for key, label in (("vs_dask", "plain Dask"), ("vs_opwise", "op-wise")):
        out.append(lowest(s_rows, key, want_small, f"{small} queries: no pipeline below {TARGET_FLOOR:g}x of {label}",
                          TARGET_FLOOR))
    for key, label in (("vs_dask", "plain Dask"), ("vs_opwise", "op-wise")):
        out.append(lowest(l_rows, key, want_large,
                          f"{large} queries, {', '.join(want_large)}: each >= {TARGET_SPEEDUP:g}x over {label}",
                          TARGET_SPEEDUP))
    if want_eff:
        vals = [(at[(n, large)]["efficiency"], n) for n in want_eff
                if (n, large) in at and at[(n, large)]["efficiency"] is not None]
        low = min(vals) if vals else None
        out.append({"target": f"{large} queries, {', '.join(want_eff)}: daskllm's efficiency >= {TARGET_EFFICIENCY:g}",
                    "value": ", ".join(f"{n} {v:.2f}" for v, n in vals) or "-",
                    "status": _verdict(len(vals), len(want_eff), bool(low) and low[0] >= TARGET_EFFICIENCY,
                                       decided_early=bool(low) and low[0] < TARGET_EFFICIENCY)})
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(report: dict) -> str:
    s = report["settings"]
    machines = list(dict.fromkeys(machine_line(r["machine"]) for r in report["calls"] if r.get("machine")))
    lines = ["# GPU sweep: the papers' pipelines, daskllm against op-wise and plain Dask", ""]
    lines += [f"Machine: {m}" for m in machines] or ["Machine: -"]
    lines += ["", f"Model `{s['model']}` (second model `{s['model2']}`), {s['workers']} worker(s) x {s['threads']} "
              f"threads, {s['max_tokens']} tokens per call, {s['repeats']} repetition(s) (median), index of "
              f"{s['index_docs']} passages. vs X = X's wall time / daskllm's in the same repetition (above 1: "
              "daskllm faster); efficiency = daskllm's ideal time / its actual time.", "",
              "| call | queries | pipelines | status | wall s | device | harness command |",
              "|---|---|---|---|---|---|---|"]
    for r in report["calls"]:
        lines.append(f"| {r['name']} | {r['queries']} | {', '.join(r['pipelines'])} | {r['status']} | "
                     f"{r['seconds']:.0f} | {(r.get('machine') or {}).get('device', '-')} | `{r['command']}` |")
    lines += ["", "| pipeline | queries | op-wise s | Dask s | daskllm s | vs Dask | vs op-wise | efficiency | exact |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['pipeline']} | {r['queries']} | {_f(r['opwise_s'], '.2f')} | {_f(r['dask_s'], '.2f')} | "
                     f"{r['daskllm_s']:.2f} | {_f(r['vs_dask'], '.2f')} | {_f(r['vs_opwise'], '.2f')} | "
                     f"{_f(r['efficiency'], '.2f')} | {'yes' if r['exact'] else 'NO'} |")
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
    return {"settings": settings, "calls": calls, "rows": rows,
            "targets": targets(rows, calls, args.queries_small, args.queries_large, args.selected),
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
    parts = split(calls, args.parts)
    chosen = calls if args.part is None else parts[args.part - 1]
    if args.dry_run:
        for k, part in enumerate(parts, 1):
            print(f"part {k} of {args.parts} (cost {sum(c['cost'] for c in part):.0f}):")
            for c in part:
                print(f"  {c['name']}: {c['command']}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        start = time.perf_counter()
        machine = probe()
        log(f"machine: {machine_line(machine)}")
        log(f"running {len(chosen)} harness call(s): {', '.join(c['name'] for c in chosen)}")
        for call in chosen:
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
