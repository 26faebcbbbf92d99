"""The documentation is right: every setting is in the reference, links resolve, and every
example runs.

Every ```python block of README.md and docs/*.md is compiled (fast) and run as a program of its
own (``sys.executable`` in a fresh subprocess, in an empty temporary directory, as a user would
run it: the default model ``smollm2``, ``DASK_DASKLLM__MODEL`` removed from the environment,
the session's model cache in ``DASKLLM_CACHE_DIR``, the repository root on ``PYTHONPATH`` for
``pipelines`` and ``bench``). A block passes when it exits 0 within ``BLOCK_TIMEOUT`` seconds.
Test ids are the file and the line of the opening fence: ``docs/guide.md:35``.

A block may be preceded, on the line right before its fence, by one marker:

``<!-- docs-test: skip: REASON -->``
    not run (still compiled): it needs what a test machine does not have, e.g. a GPU or a
    remote cluster. The reason is the skip's reason.
``<!-- docs-test: needs: MODULE, ... -->``
    run only where those modules import (e.g. a third-party tool the project does not
    depend on); skipped, naming the missing one, where they do not. ``needs: vllm`` also
    marks the test ``vllm``, so ``make test-vllm`` runs it in .venv-vllm.
``<!-- docs-test: continues -->``
    runs after the previous ```python block of the same file, as one program (that block's
    own program first, so chains work): for a block using names an earlier one defined.

A chain of blocks joined by ``continues`` runs once, as one program, with a line written after
each block: a block passes when its line is written (the chain's last block: and the program
exits 0), so each block keeps its own test without the chain's first blocks running once per
block that continues them.

An example that starts one ``LocalLLMCluster`` and uses it only through ``Client(cluster)``
(nothing in ``FRESH``) runs, as written, on a cluster this test process keeps for its session,
started with the same arguments (``tests/docs_site/docs_cluster.py``): a cluster start and the
models' loading are paid once per set of arguments, not once per example.

In ```bash / ```console blocks, every ``daskllm ...`` command is checked without running it:
``daskllm <the same arguments> --help`` must succeed (so the subcommands and options exist) and
print every option the command uses. It runs in this process, through click's test runner; one
test runs the installed ``daskllm`` program itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import yaml
from collections.abc import Iterator

from helpers import daskllm_command, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT = 240  # seconds per block; a cluster start with smollm2 takes 10-20 s here
MARKERS = {"skip", "continues", "needs"}

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
# Programs that start processes or run a model: the slow tier.
_SLOW = re.compile(r"LocalLLMCluster|LocalCluster|\.compute\(|daskllm\.compute\(|explain\(|EmbedEngine|"
                   r"Reranker|stdlib_docs|datasets\.load|usage\(")


@dataclasses.dataclass
class Block:
    doc: str  # path relative to the repository root
    line: int  # line of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None = None
    reason: str | None = None
    previous: Block | None = None  # the previous python block of the same file
    following: Block | None = None  # the python block that continues this one

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def program(self) -> str:
        """The code this block runs: with ``continues``, the previous block's program first;
        each block is followed by its done line (written straight to the output's file
        descriptor, whatever the block did with sys.stdout)."""
        chain = self.chain()
        parts = []
        for b in chain[:chain.index(self) + 1]:
            line = ("\n" + b.done_line + "\n").encode()
            parts.append(f"# --- {b.id} ---\n{b.code}\n__import__('os').write(1, {line!r})\n")
        return "\n\n".join(parts)

    @property
    def done_line(self) -> str:
        """What the program writes once this block has run."""
        return f"[docs-test] done {self.id}"

    def chain(self) -> list[Block]:
        """The blocks joined to this one by ``continues``, first to last."""
        head = self
        while head.marker == "continues" and head.previous is not None:
            head = head.previous
        blocks = [head]
        while blocks[-1].following is not None:
            blocks.append(blocks[-1].following)
        return blocks

    def skip_reason(self) -> str | None:
        if self.marker == "skip":
            return self.reason
        if self.marker == "needs":
            missing = [m for m in re.split(r"[,\s]+", self.reason or "") if m and importlib.util.find_spec(m) is None]
            return f"needs {', '.join(missing)}, not installed" if missing else None
        if self.marker == "continues" and self.previous is not None:
            reason = self.previous.skip_reason()
            return reason and f"continues {self.previous.id}, skipped: {reason}"
        return None


PROBLEMS: list[str] = []  # malformed markers and fences, reported by a test rather than at collection


def _parse(doc: pathlib.Path) -> list[Block]:
    name = doc.relative_to(ROOT).as_posix()
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    previous_python = None
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        marker = _MARKER.match(lines[i])
        if marker and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
            PROBLEMS.append(f"{name}:{i + 1}: a docs-test marker must be on the line right before a fence")
        if not fence:
            i += 1
            continue
        indent, start = fence["indent"], i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            PROBLEMS.append(f"{name}:{start + 1}: a code fence is never closed")
        i += 1
        block = Block(name, start + 1, fence["lang"].lower(), "\n".join(body) + "\n")
        before = _MARKER.match(lines[start - 1]) if start else None
        if before:
            block.marker, block.reason = before["kind"], before["reason"]
            if block.marker not in MARKERS:
                PROBLEMS.append(f"{block.id}: unknown docs-test marker {block.marker!r}; known: {sorted(MARKERS)}")
            elif block.marker == "skip" and not block.reason:
                PROBLEMS.append(f"{block.id}: a skip needs a reason: <!-- docs-test: skip: REASON -->")
            elif block.marker == "continues" and (block.lang != "python" or previous_python is None):
                PROBLEMS.append(f"{block.id}: 'continues' needs a python block after another python block")
        if block.lang == "python":
            block.previous = previous_python
            if block.marker == "continues" and previous_python is not None:
                previous_python.following = block
            previous_python = block
        blocks.append(block)
    return blocks


BLOCKS = [block for doc in DOCS for block in _parse(doc)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
_HEADS = {b.id: b.chain()[0].id for b in PYTHON}


def chain_head(block_id: str) -> str:
    """The first block of the chain ``block_id`` is in (conftest groups a chain's tests by it)."""
    return _HEADS.get(block_id, block_id)


def _param(block: Block):
    # A chain's blocks share one run (under pytest-xdist, conftest.xdist_unit keeps a chain's
    # blocks in one process).
    marks = [pytest.mark.slow] if any(_SLOW.search(b.code) for b in block.chain()) else []
    if any(b.marker == "needs" and "vllm" in re.split(r"[,\s]+", b.reason or "") for b in block.chain()):
        marks.append(pytest.mark.vllm)  # make test-vllm runs it, in .venv-vllm
    return pytest.param(block, id=block.id, marks=marks)


# ---------------------------------------------------------------------------------------------
# The reference and the links


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        out += _keys(value, name) if isinstance(value, dict) else [name]
    return out


def test_every_config_key_is_in_the_reference():
    defaults = yaml.safe_load((ROOT / "daskllm" / "daskllm.yaml").read_text())
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in _keys(defaults) if f"`{k}`" not in reference]
    assert not missing, f"undocumented settings: {missing}"
    assert len(_keys(defaults)) > 20


def _render(value) -> str:
    """A default as the reference writes it (YAML's spelling)."""
    if isinstance(value, list):
        return "[" + ", ".join(map(_render, value)) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def test_the_reference_gives_the_real_defaults():
    defaults = yaml.safe_load((ROOT / "daskllm" / "daskllm.yaml").read_text())
    flat = {}
    for key in _keys(defaults):
        node = defaults
        for part in key.split("."):
            node = node[part]
        flat[key] = node
    rows = re.findall(r"^\| `(daskllm\.[\w.-]+)` \| `([^`]*)` \|", (ROOT / "docs" / "configuration.md").read_text(),
                      re.MULTILINE)
    assert len(rows) >= len(flat) - 1
    wrong = {key: (shown, _render(flat[key])) for key, shown in rows if key in flat and shown != _render(flat[key])}
    assert not wrong, f"documented default != daskllm.yaml: {wrong}"


def test_docs_link_to_files_that_exist():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", doc.read_text()):
            assert (doc.parent / target).is_file(), f"{doc.name} links to missing {target}"


def _config_in_child(env_vars: dict, keys: list[str]) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DASKLLM__")}
    env.update(env_vars)
    code = ("import json, dask.config, daskllm\n"
            f"print(json.dumps([dask.config.get('daskllm.' + k) for k in {keys!r}]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_environment_variables_set_daskllm_config_as_documented():
    """configuration.md: ``DASK_DASKLLM__<KEY>__<KEY>`` (Dask's convention), read at import."""
    reference = (ROOT / "docs" / "configuration.md").read_text()
    assert "DASK_DASKLLM__MODEL=tiny" in reference
    assert "DASK_DASKLLM__ENGINE__KV_CACHE_TOKENS" in reference
    assert not re.search(r"(?<![A-Z_])DASKLLM__\w+=", reference), "DASKLLM__X=... does nothing: Dask reads DASK_*"
    got = _config_in_child({"DASK_DASKLLM__MODEL": "tiny", "DASK_DASKLLM__ENGINE__KV_CACHE_TOKENS": "8192",
                            "DASK_DASKLLM__REWRITE__GRANULARITY": "query"},
                           ["model", "engine.kv-cache-tokens", "rewrite.granularity", "rewrite.passes"])
    assert got == ["tiny", 8192, "query", ["cse", "cache", "prune", "parts", "prefix", "pipeline", "stage"]]
    # Without them: the defaults (the model users get is smollm2).
    assert _config_in_child({}, ["model", "engine.kv-cache-tokens"]) == ["smollm2", "auto"]


# ---------------------------------------------------------------------------------------------
# Python blocks


def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert len(PYTHON) > 20


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in PYTHON])
def test_python_block_parses(block: Block):
    compile(block.program(), block.id, "exec")


def _run(program: str, cwd: pathlib.Path, env: dict, timeout: float) -> tuple[int | None, str, str]:
    """Run ``program`` as a script; on timeout kill its whole process group (cluster workers too)."""
    script = cwd / "example.py"
    script.write_text(program)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


# What makes an example need a cluster of its own: the cluster object used for more than
# Client(cluster), other processes or signals, state a used cluster keeps (plugins, usage
# records, the result store), the dashboard.
FRESH = re.compile(r"(?<![\w.])cluster\.|subprocess|Popen|signal|os\.kill|register|usage\(|restart|retire|"
                   r"shutdown|result_store|cache_info|dashboard|__file__")
DOCS_SITE = ROOT / "tests" / "docs_site"


def shares_cluster(program: str) -> bool:
    return program.count("LocalLLMCluster(") == 1 and not FRESH.search(program)


@dataclasses.dataclass
class ClusterHost:
    """The process that keeps the shared clusters (docs_cluster.host), and where to reach it."""
    proc: subprocess.Popen
    address: str
    log: pathlib.Path

    def env(self) -> dict:
        return {"DASKLLM_DOCS_CLUSTER": self.address}

    def log_tail(self) -> str:
        return _tail(self.log.read_text(errors="replace"), 3000)


@pytest.fixture(scope="session")
def cluster_host(daskllm_cache) -> Iterator[ClusterHost]:
    # mkdtemp: only this user may reach the socket; short: a socket path has at most 107 bytes
    where = pathlib.Path(tempfile.mkdtemp(prefix="daskllm-docs-"))
    log = where / "host.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(DOCS_SITE / "docs_cluster.py"), str(where / "host.sock")],
                                cwd=where, env=_example_env(daskllm_cache),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    host = ClusterHost(proc, str(where / "host.sock"), log)
    try:
        wait_for(lambda: (where / "host.sock").exists(), 120, proc, what="the docs cluster host's socket")
        yield host
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        shutil.rmtree(where, ignore_errors=True)


def _example_env(daskllm_cache: str) -> dict:
    """An example's environment: the user's default model, the session's model cache, the
    repository root on PYTHONPATH (for ``pipelines`` and ``bench``)."""
    env = {k: v for k, v in os.environ.items() if k != "DASK_DASKLLM__MODEL"}
    env["DASKLLM_CACHE_DIR"] = daskllm_cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else f"[... {len(text) - n} characters ...]\n{text[-n:]}"


@dataclasses.dataclass
class ChainRun:
    code: int | None  # None: killed at the timeout
    out: str
    err: str


_CHAIN_RUNS: dict[str, ChainRun] = {}  # by the chain's first block


@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
@pytest.mark.parametrize("block", [_param(b) for b in PYTHON])
def test_python_block_runs(block: Block, daskllm_cache, smollm2_model_dir, tmp_path, request):
    reason = block.skip_reason()
    if reason:
        pytest.skip(reason)
    chain = block.chain()
    run = _CHAIN_RUNS.get(chain[0].id)
    program = chain[-1].program()
    host = request.getfixturevalue("cluster_host") if shares_cluster(program) else None
    if run is None:
        env = _example_env(daskllm_cache)
        if host is not None:
            env.update(host.env(), PYTHONPATH=os.pathsep.join([str(DOCS_SITE), env["PYTHONPATH"]]))
        run = _CHAIN_RUNS[chain[0].id] = ChainRun(*_run(program, tmp_path, env, BLOCK_TIMEOUT))
    written = set(run.out.splitlines())
    if block.done_line in written and (block is not chain[-1] or run.code == 0):
        return
    failed = next((b for b in chain if b.done_line not in written), chain[-1])
    status = f"did not finish in {BLOCK_TIMEOUT} s" if run.code is None else f"exited {run.code}"
    where = "" if failed is block else f", in {failed.id}, which this block continues"
    shared = f"\n--- the shared cluster's host ---\n{host.log_tail()}" if host is not None else ""
    pytest.fail(f"{block.id} {status}{where}\n--- stdout ---\n{_tail(run.out)}\n--- stderr ---\n{_tail(run.err)}"
                f"{shared}")


# ---------------------------------------------------------------------------------------------
# Shell blocks: the daskllm commands they show exist, with the options they use


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for block in BLOCKS:
        if block.lang not in ("bash", "console", "sh", "shell"):
            continue
        text = re.sub(r"\\\n\s*", " ", block.code)
        for offset, line in enumerate(text.splitlines()):
            line = re.sub(r"^\s*\$\s+", "", line).split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line)
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # VAR=value before the command
                words = words[1:]
            if words and pathlib.PurePath(words[0]).name == "daskllm":
                found.append((f"{block.id}+{offset + 1}", words[1:]))
    return found


COMMANDS = _commands()


def test_docs_show_daskllm_commands():
    assert len(COMMANDS) >= 4


def test_the_daskllm_command_is_installed(daskllm_cache):
    """The console script the docs' commands start with runs as a program (the commands
    themselves are checked in this process, below)."""
    daskllm = pathlib.Path(sys.executable).with_name("daskllm")
    done = subprocess.run([str(daskllm), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage: daskllm" in done.stdout


@pytest.mark.parametrize(("where", "args"), [pytest.param(w, a, id=f"{w} daskllm {' '.join(a)}") for w, a in COMMANDS])
def test_daskllm_command_exists(where, args, daskllm_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    done = daskllm_command(*args, "--help")
    assert done.exit_code == 0, f"{where}: daskllm {' '.join(args)} --help failed:\n{done.output}\n{done.exception!r}"
    options = [a.split("=")[0] for a in args if a.startswith("-")]
    missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", done.output)]
    assert not missing, f"{where}: options {missing} are not in `daskllm ... --help`:\n{done.output}"
