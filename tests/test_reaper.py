"""tests/reaper.py: what a test run starts ends with the run, even when the run is killed."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

import reaper
from helpers import wait_for

HERE = pathlib.Path(__file__).resolve().parent

# A stand-in for a pytest run: it tags itself, starts its reaper, then a child in a session of
# its own (as tests/test_docs.py starts examples) that starts a grandchild; it prints their pids.
RUN = textwrap.dedent("""
    import os, subprocess, sys
    sys.path.insert(0, {here!r})
    import reaper
    os.environ[reaper.TAG] = tag = reaper.this_run({checkout!r})
    reaper.start(tag)
    hold = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", hold], start_new_session=True, stdout=subprocess.PIPE, text=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    child.wait()
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["killed", "exits"])
def test_a_run_s_processes_end_with_it(tmp_path, how):
    """SIGKILLed or not, once the run's process is gone, its reaper ends its children, in
    sessions of their own included, and their children, within 30 s."""
    run = subprocess.Popen([sys.executable, "-c", RUN.format(here=str(HERE), checkout=str(tmp_path))],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child, grandchild = map(int, run.stdout.readline().split())
        assert not _gone(child) and not _gone(grandchild)
        # a process that has just exec'd shows an empty environment for a moment
        tag = wait_for(lambda: reaper.tag_of(psutil.Process(grandchild)), 10, what="the grandchild's environment")
        assert tag.endswith(f":{tmp_path}")
        if how == "killed":
            run.kill()
        else:
            os.kill(child, signal.SIGTERM)  # the run ends on its own; the grandchild is left over
            run.wait(30)
        wait_for(lambda: _gone(child) and _gone(grandchild), 30, what="the run's processes ended")
    finally:
        run.kill()
        run.wait(30)


@pytest.mark.timeout(60)
def test_leftovers_are_the_processes_of_a_checkout_s_dead_runs(tmp_path):
    """A process tagged by a run that is gone is a leftover of its checkout, and of no other;
    one tagged by a live run is not."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30)
    dead_tag = f"{dead.stdout.strip()}:0.0:{tmp_path}"
    live_tag = reaper.this_run(str(tmp_path))  # this process's: it is running
    hold = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs = [subprocess.Popen(hold, env={**os.environ, reaper.TAG: tag}) for tag in (dead_tag, live_tag)]
    try:
        found = wait_for(lambda: reaper.leftovers(str(tmp_path)), 10, what="the leftover")
        assert [p.pid for p in found] == [procs[0].pid]
        assert not reaper.leftovers(str(tmp_path / "other"))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
