"""The cost preview of table jobs (``ddf.llm.estimate()``, ``daskllm.explain(ddf)``), checked
against what the run then really does, on a multi-process cluster with the tiny model."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading

import dask
import dask.dataframe as dd
import distributed
import pandas as pd
import pyarrow as pa
import pytest

import daskllm
from daskllm.dataframe import TableEstimate

# The result store on (the session switches it off elsewhere), emptied before each test: the
# preview reports its hits.
from test_result_store import client, empty_store, store_path  # noqa: F401 - fixtures

QUESTIONS = ["How do I read JSON?", "How do I parse CSV?", "How do I sort a list?", "How do I open a file?"]
TEMPLATE = "Answer in one line. Q: {q}\nA:"


def table(questions: list[str], npartitions: int) -> dd.DataFrame:
    df = pd.DataFrame({"q": pd.Series(questions, dtype=pd.ArrowDtype(pa.string())), "n": range(len(questions))})
    return dd.from_pandas(df, npartitions=npartitions)


@pytest.mark.parametrize("operator", ["map", "filter"])
def test_the_exact_estimate_matches_the_run(client, operator):
    job = table(QUESTIONS * 4, 3)
    job = job.llm.map(TEMPLATE, max_tokens=6, out="a") if operator == "map" else job.llm.filter("Files? {q}")
    preview = job.llm.estimate()
    (op,) = preview.operators
    assert (op.operator, op.method, op.rows, op.distinct, op.cache_hits, op.calls) == (operator, "exact", 16, 4, 0, 4)
    with daskllm.usage() as u:
        job.compute()
    assert u.operators[operator]["rows"] == op.rows and u.operators[operator]["distinct"] == op.distinct
    assert u.prefill_tokens == op.prompt_tokens  # tokenized as the engine sees them
    assert 0 < u.decode_tokens <= op.output_tokens == 4 * (6 if operator == "map" else 1)


def test_a_second_preview_counts_the_stored_results_as_hits(client):
    job = table(QUESTIONS * 2, 2).llm.map(TEMPLATE, max_tokens=4)
    assert job.llm.estimate().operators[0].cache_hits == 0
    job.compute()
    (op,) = job.llm.estimate().operators
    assert (op.distinct, op.cache_hits, op.calls, op.prompt_tokens, op.output_tokens) == (4, 4, 0, 0, 0)
    with daskllm.usage() as u:
        job.compute()
    assert u.executed.get("generate", 0) == op.calls


def test_a_sampled_estimate_is_close_to_the_exact_one(client):
    # 40 partitions of 25 rows; 200 distinct questions, each 5 times, in a shuffled order.
    questions = [f"What is {i} times {i % 7}?" for i in range(200)] * 5
    random.Random(0).shuffle(questions)
    job = table(questions, 40).llm.map(TEMPLATE, max_tokens=4)
    exact = job.llm.estimate(exact=True).operators[0]
    sampled = job.llm.estimate(exact=False, sample_partitions=8).operators[0]
    assert exact.distinct == 200 and sampled.method == "sampled 8 of 40 partitions" and sampled.rows == 1000
    # Tolerance: a sample of a fifth of the table puts the distinct count and tokens within 35%.
    assert abs(sampled.distinct - exact.distinct) <= 0.35 * exact.distinct
    assert abs(sampled.prompt_tokens - exact.prompt_tokens) <= 0.35 * exact.prompt_tokens


def test_the_distinct_count_from_a_sample_is_exact_at_the_extremes():
    from daskllm.dataframe.estimate import distinct_count

    assert distinct_count(pd.Series([f"p{i}" for i in range(50)]), 1000) == 1000  # all distinct
    assert distinct_count(pd.Series(["same"] * 50), 1000) == 1


def test_a_chained_operator_is_bounded_by_the_rows_before_it(client):
    job = table(QUESTIONS * 4, 3).llm.map(TEMPLATE, max_tokens=4, out="a").llm.filter("Useful? {a}")
    first, second = job.llm.estimate().operators
    assert (first.operator, first.method, first.distinct) == ("map", "exact", 4)
    assert second.operator == "filter" and second.method.startswith("upper bound")
    assert second.rows == second.distinct == 16 and second.prompt_tokens is None
    with daskllm.usage() as u:
        job.compute()
    assert u.operators["filter"]["distinct"] <= second.distinct


def test_an_operator_reading_only_input_columns_after_a_map_is_exact(client):
    # The filter reads q, not the map's answers: its prompts are rendered from q, and the map never runs.
    job = table(QUESTIONS * 4, 3).llm.map(TEMPLATE, max_tokens=4, out="a").llm.filter("Files? {q}")
    first, second = job.llm.estimate().operators
    assert (second.operator, second.method, second.rows, second.distinct, second.calls) == ("filter", "exact", 16, 4, 4)
    with daskllm.usage() as u:
        job.compute()
    assert u.operators["filter"]["distinct"] == second.distinct
    assert u.prefill_tokens == first.prompt_tokens + second.prompt_tokens
    again = job.llm.estimate().operators[1]  # a cached rerun: the filter's hits are shown
    assert (again.method, again.cache_hits, again.calls) == ("exact", 4, 0)
    # After a filter the rows themselves depend on the model: still a bound.
    after_filter = table(QUESTIONS, 2).llm.filter("Sorting? {q}").llm.filter("Short? {q}").llm.estimate().operators
    assert after_filter[1].method.startswith("upper bound")


def test_a_column_that_is_never_read_is_not_counted(client):
    job = table(QUESTIONS, 2).llm.map(TEMPLATE, max_tokens=4, out="a")
    assert job.llm.estimate().operators and not job[["n"]].llm.estimate().operators


def test_explain_on_a_dataframe_prints_the_preview(client, capsys):
    from daskllm.worker.calibrations import forget_all

    forget_all()  # nothing remembered from an earlier cluster of the session: no time to show
    job = table(QUESTIONS, 2).llm.map(TEMPLATE, max_tokens=4, out="a")
    preview = daskllm.explain(job)
    assert isinstance(preview, TableEstimate)
    printed = capsys.readouterr().out
    assert "operator" in printed and "map" in printed and "exact" in printed
    assert "no measured per-token cost for 'tiny'" in printed and preview.seconds is None
    assert preview.to_dict()["operators"][0]["distinct"] == 4
    assert "<table>" in preview._repr_html_() and "<td>map</td>" in preview._repr_html_()
    assert isinstance(daskllm.explain(job["a"]), TableEstimate)  # a series too


def test_after_calibration_the_preview_has_a_time(client):
    costs = daskllm.dataframe.calibrate()
    assert costs["tiny"]["prefill_s_per_token"] > 0 and costs["tiny"]["engines"] == 2
    assert costs["tiny"]["operator_overhead_s"] >= 0 and costs["tiny"]["call_overhead_s"] >= 0
    assert "remembered" not in costs["tiny"]  # this cluster's own measurement
    preview = table(QUESTIONS, 2).llm.map(TEMPLATE, max_tokens=4).llm.estimate()
    assert preview.seconds is not None and preview.seconds > 0 and "estimated time:" in str(preview)
    assert "remembered calibration" not in str(preview)


@pytest.mark.timeout(240)
def test_a_new_cluster_previews_with_the_calibration_an_earlier_one_remembered(llm_cluster, tmp_path, monkeypatch):
    """calibrate() on one cluster; a new one (new worker processes, same machine, model and
    numerics) previews a time at once, and says where it comes from, until it is forgotten."""
    monkeypatch.setenv("DASK_DASKLLM__CALIBRATIONS__PATH", str(tmp_path))  # the workers' and the CLI's
    job = table(QUESTIONS, 2).llm.map(TEMPLATE, max_tokens=4, out="a")
    with dask.config.set({"daskllm.calibrations.path": str(tmp_path)}):
        with llm_cluster(n_workers=1, threads_per_worker=2):
            assert job.llm.estimate().seconds is None
            measured = daskllm.dataframe.calibrate()["tiny"]
        (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("tiny-*.json")]
        assert record["numerics"].startswith("TorchEngine:torch.float32:cpu")

        with llm_cluster(n_workers=1, threads_per_worker=2):
            out = io.StringIO()
            preview = daskllm.explain(job, file=out)
            assert preview.seconds is not None and preview.seconds > 0
            cost = preview.costs["tiny"]
            assert cost["prefill_s_per_token"] == measured["prefill_s_per_token"]
            assert cost["remembered"] == {k: record[k] for k in ("measured_at", "machine", "numerics")}
            assert "from a remembered calibration, measured" in out.getvalue()
            assert record["numerics"] in out.getvalue() and record["machine"] in out.getvalue()

            cleared = subprocess.run([sys.executable, "-m", "daskllm.cli", "cache", "clear", "--calibrations"],
                                     capture_output=True, text=True, check=True, timeout=120).stdout
            assert "1 calibrations forgotten" in cleared
            forgotten = job.llm.estimate()
            assert forgotten.seconds is None and "no measured per-token cost for 'tiny'" in str(forgotten)


def test_a_calibration_is_remembered_only_for_the_same_model_files_numerics_and_machine(tmp_path):
    from daskllm.worker.calibrations import Identity, forget_all, recall, remember

    cpu = Identity("digest-of-the-model-files", "TorchEngine:torch.float32:cpu", "AMD EPYC, 2 cores, 1 torch thread")
    remember("tiny", cpu, {"prefill_s_per_token": 1e-4, "decode_s_per_token": 1e-3}, tmp_path)
    assert recall("tiny", cpu, tmp_path)["prefill_s_per_token"] == 1e-4
    for other in (dataclasses.replace(cpu, model_digest="digest-of-changed-files"),
                  dataclasses.replace(cpu, numerics="TorchEngine:torch.bfloat16:cpu"),
                  dataclasses.replace(cpu, machine="AMD EPYC, 2 cores, 2 torch threads")):
        assert recall("tiny", other, tmp_path) is None
    remember("tiny", cpu, {"prefill_s_per_token": 2e-4, "decode_s_per_token": 1e-3}, tmp_path)  # calibrated again
    assert recall("tiny", cpu, tmp_path)["prefill_s_per_token"] == 2e-4
    assert forget_all(tmp_path) == 1 and recall("tiny", cpu, tmp_path) is None


def test_an_operators_time_is_its_engine_work_plus_a_fixed_and_a_per_call_overhead():
    from daskllm.dataframe.estimate import OperatorEstimate, engine_seconds

    cost = {"prefill_s_per_token": 0.001, "decode_s_per_token": 0.01, "engines": 2,
            "operator_overhead_s": 0.5, "call_overhead_s": 0.002}
    preview = OperatorEstimate("map", "tiny", "exact", rows=120, distinct=100, cache_hits=0, prompt_tokens=1000,
                               output_tokens=400, seconds=None, computed_tokens=800)
    assert preview.calls == 100
    assert engine_seconds(preview, cost) == pytest.approx(0.5 + 100 * 0.002 + (800 * 0.001 + 400 * 0.01) / 2)
    nothing = OperatorEstimate("map", "tiny", "exact", 120, 100, 100, 0, 0, None)
    assert engine_seconds(nothing, cost) == 0.0  # every input remembered: nothing to call


# --- progress ------------------------------------------------------------------------------------


def test_the_progress_bar_counts_calls_to_the_previews_total_and_rows(client):
    out = io.StringIO()
    job = table(QUESTIONS * 4, 3).llm.map(TEMPLATE, max_tokens=4, out="a")
    done = daskllm.dataframe.progress(job, file=out, interval=0.1)
    assert len(done.compute()) == 16
    final = re.split(r"[\r\n]", out.getvalue().strip())[-1]  # the bar as it was left
    assert "4/4" in final and "100%" in final  # calls: the 4 distinct prompts the preview expects
    assert "rows=16" in final and "calls=4" in final


def test_a_chained_jobs_bar_ends_at_its_real_count_not_the_previews_bound(client):
    out = io.StringIO()
    job = table(QUESTIONS * 4, 3).llm.map(TEMPLATE, max_tokens=4, out="a").llm.filter("Is {a} short?")
    daskllm.dataframe.progress(job, file=out, interval=0.1)
    final = re.split(r"[\r\n]", out.getvalue().strip())[-1]
    calls = int(re.search(r"calls=(\d+)", final).group(1))
    assert calls > 4 and f"{calls}/{calls}" in final and "100%" in final  # the filter's calls, not rows


def test_the_progress_bar_closes_and_raises_when_the_job_fails(client):
    out = io.StringIO()
    job = table(["word " * 5000, *QUESTIONS], 2).llm.map(TEMPLATE, max_tokens=4, out="a")  # row 0 is too long
    with pytest.raises(daskllm.dataframe.RowError, match="row 0"):
        daskllm.dataframe.progress(job, file=out, interval=0.1)
    assert "100%" not in out.getvalue()


def test_the_progress_bar_survives_a_worker_killed_under_it(client):
    """SIGKILL a worker while the bar runs: the bar keeps counting (from the scheduler's view of
    the engines, never asking the dead worker) and the job's output is whole."""
    bar_through(client, signal.SIGKILL, [f"Killed bar question {i}: what is {i} plus {i}?" for i in range(24)])
    client.wait_for_workers(2, timeout=120)


def test_the_progress_bar_goes_on_past_a_worker_that_stops_answering(llm_cluster, tiny_model_dir):
    """A worker frozen mid-job (SIGSTOP: its process alive, its connections open, answering
    nothing) until the scheduler gives up on it (worker-ttl, here 3 s: its nanny restarts it):
    the bar, which never asks a worker, keeps going and the job ends whole. A bar that asked
    every worker each tick would wait on the frozen one."""
    with dask.config.set({"distributed.scheduler.worker-ttl": "3s"}), llm_cluster(n_workers=2) as client:
        bar_through(client, signal.SIGSTOP, [f"Frozen bar question {i}: what is {i} times {i}?" for i in range(16)])


def bar_through(client, sig: int, questions: list[str]) -> None:
    """Run a map job under the bar, send ``sig`` to a worker while it runs (the job ends only
    after that), and check the bar reached 100% and the output is whole."""
    gate = distributed.Event(f"progress-gate-{sig}", client=client)
    mapped = table(questions, 4).llm.map(TEMPLATE, max_tokens=8, out="a")
    job = mapped.map_partitions(wait_for, gate.name, meta=mapped._meta)
    hit = {}

    def signal_then_open():
        victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
        hit["pid"] = client.run(os.getpid, workers=[victim])[victim]
        os.kill(hit["pid"], sig)
        gate.set()  # the job can end only after the signal: the bar was running through it

    sender = threading.Thread(target=signal_then_open, daemon=True)
    out = io.StringIO()
    try:
        sender.start()
        done = daskllm.dataframe.progress(job, file=out, interval=0.1)
    finally:
        gate.set()
        sender.join(120)
        if sig == signal.SIGSTOP and "pid" in hit:
            with contextlib.suppress(ProcessLookupError):  # its nanny may have replaced it already
                os.kill(hit["pid"], signal.SIGKILL)
    assert "pid" in hit
    result = done.compute()
    assert len(result) == len(questions) and result["a"].notna().all()
    assert "100%" in re.split(r"[\r\n]", out.getvalue().strip())[-1]


def wait_for(part: pd.DataFrame, gate: str) -> pd.DataFrame:
    assert distributed.Event(gate).wait(timeout=120), "the test never opened the gate"
    return part


def test_the_bars_tally_keeps_a_lost_workers_counts_and_counts_a_new_one_from_zero():
    from daskllm.dataframe.progress import Poll, Tally

    tally = Tally({"a": {"requests_finished": 10, "decode_tokens": 5}})
    tally.update({"a": {"requests_finished": 14, "decode_tokens": 9}, "b": {"requests_finished": 3}})
    tally.update(None)  # a question that failed or has not come back
    tally.update({"b": {"requests_finished": 5}})  # a is gone: its 4 calls were still done
    assert tally.done() == {"calls": 9, "tokens": 4}
    blocked = threading.Event()
    poll = Poll(lambda: blocked.wait(120))  # a scheduler that does not answer
    assert poll.latest() is None and poll.latest() is None  # never waits for it
    blocked.set()
    failing = Poll(lambda: 1 / 0)
    assert failing.wait(10) is None  # an error is no answer, never raised


def test_the_bars_rate_is_measured_from_the_first_calls_that_finished():
    from daskllm.dataframe.progress import Bar, MeasuredRate

    rate = MeasuredRate()
    rate.update(0, 10.0)  # start-up: nothing finished yet, nothing measured
    rate.update(32, 20.0)  # a first batch: one point, no rate yet
    assert rate.per_second() is None
    rate.update(32, 25.0)
    rate.update(96, 36.0)  # 64 calls in 16 s since the first ones
    assert rate.per_second() == 4.0
    out = io.StringIO()
    with Bar(total=200, unit="call", file=out, mininterval=0) as bar:
        bar.update(96)
        bar.measured = rate
        bar.refresh()
        assert bar.format_dict["rate"] == 4.0
    assert "4.00call/s" in out.getvalue() and "00:26" in out.getvalue()  # 104 calls left at 4 a second


# --- explain on graphs ---------------------------------------------------------------------------

SYSTEM = "You are a careful assistant for Python programmers. Answer with short, correct code. "


@pytest.mark.parametrize("shape", ["shared", "partial"])
def test_explains_prefix_cache_tokens_are_what_the_run_reads_from_the_cache(client, shape):
    questions = [f"How do I do thing {i} in Python?" for i in range(6)] + ["How do I do thing 0 in Python?"]
    if shape == "shared":  # one system prompt, then each question: one shared prefill
        node = daskllm.generate(daskllm.prompt(SYSTEM + "Q: {q}\nA:", q=questions), max_tokens=4)
    else:  # each prompt waits for an upstream answer: what it knows is prefilled early
        draft = daskllm.generate(daskllm.prompt("Q: {q}", q=questions[:3]), max_tokens=4)
        node = daskllm.generate(daskllm.prompt(SYSTEM + "Improve: {a}\nB:", a=draft), max_tokens=4)
    with dask.config.set({"daskllm.rewrite.parts-calls-per-worker": 0}):  # staged tasks: the prefix pass's prefills
        report = daskllm.explain(node, file=io.StringIO())["prefix"]
        assert report[shape] == 1 and report["prefill_tokens_cached"] > 0
        with daskllm.usage() as u:
            daskllm.compute(node, result_cache=False)
    assert u.prefill_tokens_cached == report["prefill_tokens_cached"]
