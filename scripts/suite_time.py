"""Where the test suite's time goes: a pytest log with ``--durations=0``, grouped by cause.

    .venv/bin/python -m pytest -q -n 2 --durations=0 > suite.log; .venv/bin/python scripts/suite_time.py suite.log

Prints the test time of each cause (setup, call and teardown summed: with two test processes
the wall time is about half of it), then the slowest tests. A second log gives a "before"
column: ``scripts/suite_time.py after.log --before before.log``.
"""

from __future__ import annotations

import argparse
import collections
import re

# The causes, first match wins: (name, pattern of a test id).
CAUSES = [
    ("docs examples (a program each; their clusters)", r"^tests/test_docs\.py::test_python_block_runs"),
    ("Triton kernels under the interpreter", r"^tests/test_(triton_\w+|step_graphs|gpu_kernel_bits)\.py"),
    ("whole jobs and CLIs in subprocesses (demo, harness, pipelines, dask CLI, offline install)",
     r"^tests/test_(cli|bench|pipelines|dask_cli|placement|remote_engine|datasets|result_store|offline_install|models)"
     r"\.py"),
    ("servers (daskllm serve, its clients)", r"^tests/test_(serve|openai_api)\.py"),
    ("clusters and engines in the test process", r"^tests/test_(constrained|retrieval|exactness|estimate|faults|"
     r"streaming|dataframe\w*|elastic|cascade|slo|dashboard|engine_protocol|llamacpp|graph|kv_cache|worker|"
     r"prefill_fairness|batch_invariance|vllm\w*)\.py"),
    ("everything else", r""),
]
_LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+)")


def read(path: str) -> collections.Counter:
    """Seconds per test id."""
    times: collections.Counter = collections.Counter()
    with open(path) as log:
        for line in log:
            if m := _LINE.match(line):
                times[m[2]] += float(m[1])
    return times


def cause(test_id: str) -> str:
    return next(name for name, pattern in CAUSES if re.search(pattern, test_id))


def by_cause(times: collections.Counter) -> dict[str, float]:
    out = dict.fromkeys((name for name, _ in CAUSES), 0.0)
    for test_id, seconds in times.items():
        out[cause(test_id)] += seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--before", help="an earlier log, for a before column")
    parser.add_argument("--top", type=int, default=10, help="how many of the slowest tests to list")
    args = parser.parse_args()
    after = read(args.log)
    before = read(args.before) if args.before else None
    print("| cause | " + ("before (s) | after (s) |" if before else "test time (s) |"))
    print("|---|" + ("---:|" if before else "") + "---:|")
    rows = by_cause(after)
    old = by_cause(before) if before else {}
    for name, seconds in rows.items():
        print(f"| {name} | " + (f"{old[name]:.0f} | " if before else "") + f"{seconds:.0f} |")
    print("| all | " + (f"{sum(old.values()):.0f} | " if before else "") + f"{sum(rows.values()):.0f} |")
    for label, times in (("before", before), ("after" if before else "slowest", after)):
        if times:
            print(f"\n{label}: the {args.top} slowest tests")
            for test_id, seconds in times.most_common(args.top):
                print(f"  {seconds:6.1f} s  {test_id}")


if __name__ == "__main__":
    main()
