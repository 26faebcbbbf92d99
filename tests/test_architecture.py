"""The layers of daskllm, as a specification (docs/design.md): what may import what.

    api -> runtime -> plan -> ops -> worker -> engines
                               \\-> streaming (shared by all)

Read from the source (``ast``), imports inside functions included: an import inside a
function hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "daskllm"


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in ROOT.rglob("*.py")}


MODULES = _modules()


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported daskllm module, line, inside a function?) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem for a in node.names]
        else:
            continue
        for name in names:
            # Importing a.b.c runs a/__init__ and a/b/__init__ first (the importing module's own
            # packages are already running).
            parts = name.split(".")
            for depth in range(2, len(parts) + 1):
                target = ".".join(parts[:depth])
                own_package = depth < len(parts) and _under(module, target)
                if target in MODULES and target != module and not own_package:
                    out.append((target, node.lineno, id(node) not in top))
    return out


GRAPH = nx.DiGraph()
for _module in MODULES:
    GRAPH.add_node(_module)
    GRAPH.add_edges_from((_module, target) for target, _, _ in _imports(_module))


def test_no_import_cycle_inside_daskllm():
    circles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def _reaches(source_prefix: str, target_prefix: str) -> list[tuple[str, str]]:
    """Direct imports from modules under ``source_prefix`` into modules under ``target_prefix``."""
    return [(a, b) for a, b in GRAPH.edges if _under(a, source_prefix) and _under(b, target_prefix)]



@pytest.mark.parametrize("lower, upper", [
    ("daskllm.plan", "daskllm.runtime"), ("daskllm.plan", "daskllm.api"), ("daskllm.plan", "daskllm.dataframe"),
    ("daskllm.ops", "daskllm.runtime"), ("daskllm.ops", "daskllm.api"), ("daskllm.ops", "daskllm.plan.lower"),
    ("daskllm.ops", "daskllm.plan.passes"), ("daskllm.ops", "daskllm.plan.planner"),
    ("daskllm.worker", "daskllm.plan"), ("daskllm.worker", "daskllm.ops"), ("daskllm.worker", "daskllm.runtime"),
    ("daskllm.worker", "daskllm.api"), ("daskllm.streaming", "daskllm.worker"), ("daskllm.streaming", "daskllm.plan"),
    ("daskllm.engines", "daskllm.worker"), ("daskllm.engines", "daskllm.plan"), ("daskllm.engines", "daskllm.placement"),
    ("daskllm.engines", "daskllm.dashboard"), ("daskllm.placement", "daskllm.engines"),
    ("daskllm.placement", "daskllm.dashboard"), ("daskllm.placement", "daskllm.worker"),
    ("daskllm.placement", "daskllm.plan"), ("daskllm.dashboard", "daskllm.placement"),
    ("daskllm.dashboard", "daskllm.engines"), ("daskllm.runtime", "daskllm.api"),
    ("daskllm.runtime", "daskllm.dataframe"),
    # serving is the top layer: only the CLI imports it
    *((layer, "daskllm.serve") for layer in ("daskllm.api", "daskllm.runtime", "daskllm.plan", "daskllm.ops",
                                               "daskllm.worker", "daskllm.engines", "daskllm.dataframe")),
])
def test_layers(lower, upper):
    assert not _reaches(lower, upper), f"{lower} must not import {upper}"


# Imports inside functions: only optional or heavy dependencies loaded on first use (torch,
# vllm, bokeh), each where a module would otherwise pull them into every process.
DEFERRED = {
    ("daskllm.engines", "daskllm.engines.torch_engine"),  # torch: loaded where an LLM engine is built
    ("daskllm.engines", "daskllm.engines.vllm"),  # vllm: CUDA workers only
    ("daskllm.engines", "daskllm.engines.remote"),  # openai client: only where a remote engine is built
    ("daskllm.engines", "daskllm.engines.llamacpp"),  # llama-cpp-python: only where a llama.cpp engine is built
    ("daskllm.engines", "daskllm.engines.embedder"),  # torch
    ("daskllm.engines", "daskllm.engines.reranker"),  # torch
    ("daskllm.engines.reranker", "daskllm.engines.vllm"),
    ("daskllm.engines.embedder", "daskllm.engines.vllm"),
    ("daskllm.engines.backends", "daskllm.engines.triton_kernels"),  # triton: only where the GPU backend is built
    ("daskllm.dashboard", "daskllm.dashboard.page"),  # bokeh: only where the scheduler has a dashboard
    ("daskllm.corpus", "daskllm.models"),  # the corpus build runs corpus.py alone, importing only the stdlib
}


def test_imports_inside_functions_are_only_deferred_heavy_modules():
    late = {(m, target, line) for m in MODULES for target, line, inside in _imports(m) if inside}
    unexpected = sorted((f"{MODULES[m].relative_to(ROOT.parent)}:{line}", t) for m, t, line in late
                        if (m, t) not in DEFERRED)
    assert not unexpected, f"function-level imports of daskllm modules: {unexpected}"


def test_placement_reads_annotations_not_key_names():
    """Placement knows tasks by their typed annotation, never by how their keys are spelled."""
    source = (ROOT / "placement.py").read_text()
    for spelled in ('"prefill-', '"decode-', '"embed-', '"search-', '"rerank-', "startswith("):
        assert spelled not in source, f"placement.py recognizes tasks by key: {spelled}"
