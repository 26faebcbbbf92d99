"""The ``bits`` marker cannot be forgotten: a guard over the tests' source.

``bits`` (pyproject.toml) marks the tests that compare bits depending on the CPU's kernels:
batch invariance, exactness, the Triton kernels, calibrations' numerics. ``make
test-baseline-cpu`` runs them again on torch's and numpy's baseline x86-64 kernels
(docs/testing.md, "The CPUs the suite is checked on"), so a test of bits left unmarked would
be checked on one kind of CPU kernels only.

The rule, read from each tests/test_*.py with ``ast``: a test function that makes an exact
comparison of tensors or arrays (:data:`EXACT_CALLS`; ``assert_close`` and ``assert_allclose``
with zero tolerances; ``.tobytes()`` inside a comparison), in its own body or in a function of
its module or of tests/helpers.py that it calls (at any depth), carries the marker: a decorator
of its own (a parametrize's ``pytest.param(..., marks=pytest.mark.bits)`` counts), a module-level
name holding one, or its module's ``pytestmark``. A comparison whose result no floating-point
kernel decides (integer ids from index logic, say) says so on its line: ``# not-bits: <why>``.
Token lists compared with ``==`` are beyond what a syntax check can tell from other lists: the
exactness tests comparing tokens carry the marker by hand.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import textwrap

TESTS = pathlib.Path(__file__).resolve().parent
# Exact comparisons, by the called name's last part (torch.equal, Tensor.equal, np.array_equal, ...).
EXACT_CALLS = {"equal", "array_equal", "assert_array_equal", "assert_equal"}
CLOSE_CALLS = {"assert_close", "assert_allclose"}  # exact only with zero tolerances
OPT_OUT = re.compile(r"#\s*not-bits:\s*\S")
HELPER_MODULES = {"tests.helpers", "helpers"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _zero(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _exact(call: ast.Call) -> str | None:
    """The name of the exact comparison ``call`` makes, or None."""
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    if last in EXACT_CALLS:
        return name
    if last in CLOSE_CALLS:
        tol = {kw.arg: kw.value for kw in call.keywords}
        numpy = name.split(".")[0] in ("np", "numpy")  # numpy's atol defaults to 0, torch's does not
        if _zero(tol.get("rtol")) and (_zero(tol.get("atol")) or (numpy and "atol" not in tol)):
            return f"{name}(atol=0, rtol=0)"
    return None


def _comparisons(func: ast.AST, lines: list[str]) -> list[tuple[str, int]]:
    """(name, line) of each exact comparison in ``func``'s body, less those opted out on their lines."""
    found = []
    for node in ast.walk(func):
        what = None
        if isinstance(node, ast.Call):
            what = _exact(node)
        elif isinstance(node, ast.Compare):
            if any(isinstance(n, ast.Call) and _dotted(n.func).endswith(".tobytes") for n in ast.walk(node)):
                what = ".tobytes() compared"
        if what and not any(OPT_OUT.search(line) for line in lines[node.lineno - 1:node.end_lineno]):
            found.append((what, node.lineno))
    return found


@functools.lru_cache(maxsize=4)
def _parse(source: str) -> ast.Module:  # tests/helpers.py, once for every module
    return ast.parse(source)


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _holds_bits_mark(node: ast.AST, aliases: set[str]) -> bool:
    """Whether an expression holds ``pytest.mark.bits`` (``mark.bits``), or names a module-level one."""
    return any((isinstance(n, ast.Attribute) and n.attr == "bits" and _dotted(n).endswith("mark.bits"))
               or (isinstance(n, ast.Name) and n.id in aliases) for n in ast.walk(node))


def unmarked_bit_tests(path: str, source: str, helpers_source: str = "", helpers_path: str = "tests/helpers.py",
                       ) -> list[str]:
    """``path:test (line): why`` for each test function of ``source`` that compares bits unmarked."""
    tree, lines = ast.parse(source), source.splitlines()
    helpers_tree = _parse(helpers_source)
    helpers_lines = helpers_source.splitlines()
    local, helpers = _functions(tree), _functions(helpers_tree)
    imported = {alias.asname or alias.name: alias.name for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module in HELPER_MODULES for alias in n.names}

    aliases: set[str] = set()  # module-level names holding the mark (a parametrize with its marks, say)
    module_marked = False
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if _holds_bits_mark(stmt.value, aliases):
                aliases.update(names)
                module_marked |= "pytestmark" in names

    memo: dict[tuple[str, str], list[str]] = {}

    def evidence(where: str, name: str, stack: tuple = ()) -> list[str]:
        """The comparisons function ``name`` of ``where`` ("module" or "helpers") makes, itself or by its callees."""
        key = (where, name)
        if key in memo or key in stack:
            return memo.get(key, [])
        func, src, file = ((local[name], lines, path) if where == "module"
                           else (helpers[name], helpers_lines, helpers_path))
        found = [f"{what} at {file}:{line}" for what, line in _comparisons(func, src)]
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = node.func.id
                if where == "module" and callee in local:
                    found += evidence("module", callee, (*stack, key))
                elif where == "module" and imported.get(callee) in helpers:
                    found += evidence("helpers", imported[callee], (*stack, key))
                elif where == "helpers" and callee in helpers:
                    found += evidence("helpers", callee, (*stack, key))
        memo[key] = found
        return found

    problems = []
    for name, func in local.items():
        if not name.startswith("test_") or module_marked:
            continue
        if any(_holds_bits_mark(d, aliases) for d in func.decorator_list):
            continue
        found = evidence("module", name)
        if found:
            problems.append(f"{path}:{name} (line {func.lineno}): {found[0]}")
    return problems


def test_every_test_comparing_bits_carries_the_bits_marker():
    helpers = (TESTS / "helpers.py").read_text()
    problems = []
    for file in sorted(TESTS.glob("test_*.py")):
        problems += unmarked_bit_tests(f"tests/{file.name}", file.read_text(), helpers)
    assert not problems, ("tests that compare bits without the bits marker (add @pytest.mark.bits, or "
                          "'# not-bits: <why>' on a comparison no floating-point kernel decides):\n"
                          + "\n".join(problems))


def _check(source: str, helpers: str = "") -> list[str]:
    return unmarked_bit_tests("t.py", textwrap.dedent(source), textwrap.dedent(helpers))


def test_the_rule_finds_exact_comparisons_direct_or_through_helpers():
    assert _check("""
        import numpy as np, torch
        def test_a(): assert torch.equal(x, y)
        def test_b(): assert x.equal(y)
        def test_c(): np.testing.assert_array_equal(x, y)
        def test_d(): torch.testing.assert_close(x, y, atol=0, rtol=0)
        def test_e(): np.testing.assert_allclose(x, y, rtol=0)
        def test_f(): assert x.tobytes() == y.tobytes()
        def _same(a, b): return np.array_equal(a, b)
        def _twice(a, b): return _same(a, b) and _same(b, a)
        def test_g(): assert _twice(x, y)
        from tests.helpers import check
        def test_h(): check(model)
    """, helpers="""
        def check(model): _inner(model)
        def _inner(model): assert torch.equal(model(1), model(2))
    """) == ["t.py:test_a (line 3): torch.equal at t.py:3", "t.py:test_b (line 4): x.equal at t.py:4",
             "t.py:test_c (line 5): np.testing.assert_array_equal at t.py:5",
             "t.py:test_d (line 6): torch.testing.assert_close(atol=0, rtol=0) at t.py:6",
             "t.py:test_e (line 7): np.testing.assert_allclose(atol=0, rtol=0) at t.py:7",
             "t.py:test_f (line 8): .tobytes() compared at t.py:8", "t.py:test_g (line 11): np.array_equal at t.py:9",
             "t.py:test_h (line 13): torch.equal at tests/helpers.py:3"]


def test_the_rule_takes_each_way_of_marking_and_the_opt_out():
    assert _check("""
        import pytest, torch
        CASES = pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.bits)])
        @pytest.mark.bits
        def test_a(): assert torch.equal(x, y)
        @pytest.mark.parametrize("n", [pytest.param(1, marks=[pytest.mark.slow, pytest.mark.bits])])
        def test_b(n): assert torch.equal(x, y)
        @CASES
        def test_c(n): assert torch.equal(x, y)
        def test_d(): assert torch.equal(ids, other)  # not-bits: integer ids from index logic
        def test_e(): torch.testing.assert_close(x, y)
        def test_f(): np.testing.assert_allclose(x, y, atol=0)
        def test_g(): assert len(x.tobytes()) == 4
        def helper_not_a_test(): assert torch.equal(x, y)
        def test_h(): assert torch.equal(a, b)  # not-bits:
    """) == ["t.py:test_g (line 13): .tobytes() compared at t.py:13", "t.py:test_h (line 15): torch.equal at t.py:15"]
    assert _check("""
        import pytest, torch
        pytestmark = [pytest.mark.skipif(False, reason="x"), pytest.mark.bits]
        def test_a(): assert torch.equal(x, y)
    """) == []
