"""Nothing a test run starts outlives it, however the run ends.

``conftest.py`` tags each run: ``DASKLLM_TEST_RUN=<pid>:<start time>:<checkout>`` of the pytest
process that began it, in the environment that every process the tests start inherits (xdist
workers, clusters, servers, docs examples in sessions of their own, their workers, forkservers
and engine cores). That pytest starts this module as a reaper in a session of its own, so a
signal to pytest's process group does not reach it: once that pytest has ended (exited, or been
killed), the reaper SIGKILLs every process that carries the tag, then exits.

``leftovers`` finds the tagged processes of earlier runs of the same checkout whose pytest is
gone (their reaper was killed too): conftest ends them when a run starts.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import psutil

TAG = "DASKLLM_TEST_RUN"
SETTLE = 2.0  # seconds with no tagged process left before the reaper is done
DEADLINE = 25.0  # seconds the reaper keeps killing (a killed pytest leaves nothing within 30 s)


def tag_of(process: psutil.Process) -> str:
    """The run tag a process was started with ("" for none, or one we may not read: a process
    in the middle of exec shows an empty environment for a moment, so callers scan again)."""
    try:
        return process.environ().get(TAG, "")
    except (psutil.Error, OSError):
        return ""


def this_run(checkout: str) -> str:
    """A tag for the run of ``checkout``'s tests that the calling process begins."""
    me = psutil.Process()
    return f"{me.pid}:{me.create_time()}:{checkout}"


def alive(tag: str) -> bool:
    """Whether the pytest that began the run ``tag`` is still running."""
    pid, started, _ = tag.split(":", 2)
    try:
        return psutil.Process(int(pid)).create_time() == float(started)
    except (psutil.Error, ValueError):
        return False


def tagged(match) -> list[psutil.Process]:
    """The processes (other than this one) whose run tag satisfies ``match(tag)``."""
    return [p for p in psutil.process_iter() if p.pid != os.getpid() and (t := tag_of(p)) and match(t)]


def kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def end_run(tag: str, deadline: float = DEADLINE) -> None:
    """SIGKILL the run's processes until none is left for ``SETTLE`` seconds (a nanny may
    restart a worker while its siblings die) or ``deadline`` passes."""
    stop, quiet_since = time.monotonic() + deadline, None
    while time.monotonic() < stop:
        found = tagged(lambda t: t == tag)
        if found:
            kill(found)
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= SETTLE:
            return
        time.sleep(0.2)


def leftovers(checkout: str) -> list[psutil.Process]:
    """Processes of earlier runs of ``checkout`` whose pytest is gone."""
    return tagged(lambda t: t.split(":", 2)[-1] == checkout and not alive(t))


def start(tag: str) -> subprocess.Popen:
    """Start the reaper of the run ``tag`` (begun by this process)."""
    env = {k: v for k, v in os.environ.items() if k != TAG}
    return subprocess.Popen([sys.executable, __file__, tag], env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(tag: str) -> None:
    pid = int(tag.split(":", 1)[0])
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        pass
    else:
        if alive(tag):  # the pid is still that pytest's, not a reused one
            select.select([fd], [], [])  # readable once it has exited
    end_run(tag)


if __name__ == "__main__":
    main(sys.argv[1])
