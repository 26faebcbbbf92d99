"""A table job run again, and a table job that loses a worker: what each computes and counts.

* ``rerun``: the job twice, each in a fresh process (a new cluster, the same result store): the
  second should compute no token at all (no generate call, no prefill).
* ``kill``: the job once under the progress bar on a fresh store, one worker SIGKILLed once a
  given fraction of its calls is stored: the bar's count must never move back and must end at
  every call, and ``daskllm.usage()`` must count every call as executed in this run.

The table: the questions of a JSON question set (a list of objects with a ``question`` field;
default: the first HotpotQA comparison questions of ../shared/data), with some repeated, so
there are fewer distinct calls than rows; the operator is ``map(choices=...)``.

    python bench/rerun.py rerun --model smollm2 --rows 300 --distinct 270
    python bench/rerun.py kill --model smollm2 --rows 300 --distinct 270 --kill-at 0.37
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

QUESTIONS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_comparison.json"
TEMPLATE = ("Instructions: decide whether the answer to the question below is yes, no, or that it cannot be "
            "told without more information. Question: {question}")
CHOICES = ["yes", "no", "unsure"]


def table(path: pathlib.Path, rows: int, distinct: int):
    import pandas as pd

    questions = [q["question"] for q in json.loads(path.read_text())][:distinct]
    if len(questions) < distinct:
        raise SystemExit(f"{path} has {len(questions)} questions, fewer than --distinct {distinct}")
    return pd.DataFrame({"id": range(rows), "question": [questions[i % distinct] for i in range(rows)]})


def job(args):
    import dask.dataframe as dd

    import daskllm.dataframe  # noqa: F401 - the ddf.llm accessor

    rows = table(pathlib.Path(args.questions), args.rows, args.distinct)
    return dd.from_pandas(rows, npartitions=args.partitions).llm.map(TEMPLATE, model=args.model, choices=CHOICES,
                                                                     out="label")


def counts(used) -> dict:
    return {"generate_executed": used.executed.get("generate", 0), "generate_from_store": used.from_cache.get("generate", 0),
            "prefill_tasks": used.executed.get("prefill", 0), "prefill_tokens_computed": used.prefill_tokens_computed,
            "decode_tokens": used.decode_tokens, "wall_seconds": round(used.wall_seconds, 2)}


def run_once(args) -> dict:
    """One run of the job in this process, on a cluster of its own: its usage counts."""
    from distributed import Client

    import daskllm

    with daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers) as cluster, Client(cluster):
        with daskllm.usage() as used:
            out = job(args).compute()
    return {**counts(used), "labels": out.sort_values("id")["label"].tolist()}


def rerun(args) -> dict:
    """The job twice, each in a new process, on one fresh result store."""
    env = {**os.environ, "DASK_DASKLLM__RESULT_STORE__ENABLED": "True",
           "DASK_DASKLLM__RESULT_STORE__PATH": tempfile.mkdtemp(prefix="daskllm-rerun-")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, __file__, "once", *sys.argv[2:]], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
        if done.returncode:
            raise SystemExit(f"a run failed:\n{done.stderr[-4000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    return {"first": {k: v for k, v in first.items() if k != "labels"},
            "second": {k: v for k, v in second.items() if k != "labels"},
            "same_labels": first["labels"] == second["labels"]}


def kill(args) -> dict:
    """The job under the progress bar, a worker SIGKILLed once ``--kill-at`` of its calls are stored."""
    import dask
    from distributed import Client

    import daskllm
    import daskllm.dataframe
    from daskllm.worker.store import ResultStore

    store_path = tempfile.mkdtemp(prefix="daskllm-kill-")
    settings = {"daskllm.result-store.enabled": True, "daskllm.result-store.path": store_path}
    os.environ.update({"DASK_DASKLLM__RESULT_STORE__ENABLED": "True", "DASK_DASKLLM__RESULT_STORE__PATH": store_path})
    killed: dict = {}
    with dask.config.set(settings), daskllm.LocalLLMCluster(models=[args.model], n_workers=args.workers) as cluster, \
            Client(cluster) as client:
        store = ResultStore(pathlib.Path(store_path), 10**9)
        threshold = int(args.kill_at * args.distinct)

        def kill_then():
            deadline = time.monotonic() + args.timeout
            while store.info()["entries"] < threshold:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)
            victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
            os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
            killed.update(at_entries=store.info()["entries"], at_seconds=round(time.monotonic() - started, 1))

        bar = io.StringIO()
        started = time.monotonic()
        threading.Thread(target=kill_then, daemon=True).start()
        with daskllm.usage() as used:
            daskllm.dataframe.progress(job(args), file=bar, interval=0.2).compute()
    frames = [tuple(map(int, m)) for m in re.findall(r"(\d+)/(\d+) \[", bar.getvalue())]
    shown = [n for n, _ in frames]
    return {"killed": killed, **counts(used), "bar_last": re.split(r"[\r\n]", bar.getvalue().strip())[-1],
            "bar_frames": len(frames), "bar_never_moved_back": shown == sorted(shown)
            and [t for _, t in frames] == sorted(t for _, t in frames), "bar_end": frames[-1] if frames else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["rerun", "kill", "once"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--distinct", type=int, default=270)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--kill-at", type=float, default=0.37, help="fraction of distinct calls stored before the kill")
    parser.add_argument("--questions", default=str(QUESTIONS))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    result = {"rerun": rerun, "kill": kill, "once": run_once}[args.mode](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
