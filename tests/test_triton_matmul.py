"""The matmul's plans under Triton's interpreter (``TRITON_INTERPRET=1``): every config of a plan gives
a row the same bits, :func:`verify` drops one that does not, and the default plans obey the rules
that make that hold on Hopper's tensor cores.

``tl.dot`` is a sum over K in index order there (tests/triton_interpreter.py), so configs that
share ``block_k`` agree by construction and one with another ``block_k`` differs: what these
tests check is the kernel's logic (tiles, masks, TMA and persistent variants, the choice of a
config by the row count). Whether a GPU's tensor cores agree is what ``verify`` checks on it, and
``bench/gpu_matmul_tune.py`` reports.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

# Before Triton is imported: it reads the switch once (as in tests/test_triton_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mm():
    """daskllm.engines.triton_kernels.matmul (the module: the package's ``matmul`` is the function),
    under the interpreter as tests/triton_interpreter.py patches it."""
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1")
    from tests.triton_interpreter import kernel_check_interpreter

    with kernel_check_interpreter():
        yield importlib.import_module("daskllm.engines.triton_kernels.matmul")


def small_plan(mm, dtype: torch.dtype):
    """Small tiles, so the interpreter is quick: three configs of one block_k, TMA and persistent among them."""
    C = mm.MatmulConfig
    if dtype == torch.float32:
        return ((8, C(16, 16, 32, 4, 2, precision="ieee")), (40, C(32, 32, 32, 4, 2, precision="ieee", tma=True)),
                (None, C(64, 32, 32, 4, 3, precision="ieee", persistent=True)))
    return ((8, C(64, 16, 32, 4, 2)), (40, C(64, 32, 32, 4, 2, tma=True)),
            (None, C(128, 16, 32, 8, 3, persistent=True)))


def operands(dtype: torch.dtype, n: int, k: int, rows: int = 140, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    return x, w, torch.randn(n, generator=gen).to(dtype)


# fp32: K not a multiple of block_k (the masked K tail); bf16: a multiple (the unmasked loads).
CASES = pytest.mark.parametrize("dtype,n,k", [(torch.float32, 40, 80), (torch.bfloat16, 48, 64)],
                                ids=["fp32-k80", "bf16-k64"])


@pytest.mark.bits
@CASES
def test_every_config_of_a_plan_gives_a_row_the_same_bits_at_every_row_count(mm, dtype, n, k):
    x, w, b = operands(dtype, n, k)
    plan = small_plan(mm, dtype)
    full = [mm.run_config(x, w, b, cfg) for _, cfg in plan]
    assert all(torch.equal(full[0], other) for other in full[1:])
    product = mm.Product(w, b, plan)
    assert [product.config(r) for r in (1, 8, 9, 40, 41)] == [plan[0][1]] * 2 + [plan[1][1]] * 2 + [plan[2][1]]
    for rows in (1, 5, 8, 9, 33, 40, 41, 140):  # each config, each side of its limits, first and last rows
        assert torch.equal(product(x[:rows]), full[0][:rows]), rows
        assert torch.equal(product(x[-rows:]), full[0][-rows:]), -rows
    assert product(x[:0]).shape == (0, n)


def test_float32_products_match_torch(mm):
    x, w, b = operands(torch.float32, 40, 80, rows=50)
    product = mm.Product(w, b, small_plan(mm, torch.float32))
    torch.testing.assert_close(product(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mm.matmul(x[:3], w), F.linear(x[:3], w), atol=1e-5, rtol=1e-5)  # the default plan


@pytest.mark.bits
def test_verify_drops_a_config_that_reduces_otherwise_and_keeps_the_others(mm, caplog):
    C = mm.MatmulConfig
    x, w, b = operands(torch.float32, 40, 80)
    plan = small_plan(mm, torch.float32)
    product = mm.Product(w, b, plan)
    assert mm.verify(product, rows=(1, 7, 20)) == plan
    other_k = C(16, 32, 16, 4, 2, precision="ieee")  # K summed in steps of 16: other roundings
    bad = ((4, other_k), *plan)
    assert any("block_k 16" in p for p in mm.plan_problems(bad, torch.float32))
    with pytest.raises(ValueError, match="block_k 16"):
        mm.Product(w, b, bad)
    with caplog.at_level(logging.WARNING, logger=mm.__name__):
        assert mm.verify(product, rows=(1, 7, 20), plan=bad) == plan
    [record] = [r for r in caplog.records if r.name == mm.__name__]
    assert "40x80 fp32" in record.message and other_k.label in record.message and "dropped" in record.message


@pytest.mark.parametrize("capability", [None, (9, 0), (8, 0), (10, 0)], ids=["interpreter", "hopper", "ampere",
                                                                             "blackwell"])
def test_default_plans_for_llama_1b_obey_the_rules(mm, capability):
    """Pure logic, no kernel: same block_k and precision, wgmma's conditions for 16-bit, shared memory."""
    from daskllm import models

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_matmul_tune

    hopper = capability in (None, (9, 0))
    for name, n, k in gpu_matmul_tune.model_shapes(models.RECIPES["llama-1b"]):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            plan = mm.default_plan(n, dtype, capability)
            assert mm.plan_problems(plan, dtype) == [], (name, dtype)
            for _, cfg in plan:
                shared = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
                assert shared <= (200 if hopper else 100) * 1024, (name, cfg.label)
            if dtype != torch.float32:
                decode = plan[0][1]
                assert -(-n // decode.block_n) >= 128, (name, decode.label)  # one decoded row: 128+ blocks
                assert plan[-1][1] == (mm.MatmulConfig(128, 256, 64, 8, 3) if hopper
                                       else mm.MatmulConfig(128, 128, 64, 8, 3))


@pytest.mark.bits
def test_the_tune_script_writes_its_numbers_and_plans_product_reads(mm, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_matmul_tune

    out, saved = tmp_path / "tune.json", tmp_path / "plans.json"
    assert gpu_matmul_tune.main(["--device", "cpu", "--shapes", "48x64", "--rows", "1", "8", "--check-rows", "1", "7",
                                 "--json", str(out), "--save", str(saved)]) == 0
    [shape] = json.loads(out.read_text())["shapes"]
    assert (shape["n"], shape["k"], shape["rows"]) == (48, 64, [1, 8])
    candidates = [c for family in shape["families"] for c in family["candidates"]]
    assert len(candidates) >= 3 and all(c["same_bits"] and set(c["ms"]) == {"1", "8"} for c in candidates)
    plans = mm.load_plans(saved)
    [(key, plan)] = plans.items()
    assert key == (48, 64, torch.bfloat16) and mm.plan_problems(plan, torch.bfloat16) == []
    x, w, _ = operands(torch.bfloat16, 48, 64, rows=9)
    assert torch.equal(mm.Product(w, None, plan)(x), mm.matmul(x, w))
    assert "| 128x256x64 w8 s3 g8 | anchor |" in capsys.readouterr().out


def test_the_backend_takes_tuned_plans_from_the_config_and_refuses_unsafe_ones(mm, tmp_path, caplog):
    """daskllm.engine.matmul-plans: a tuned plan serves its weight shape; one whose configs would
    reduce otherwise (another block_k) is refused, with a warning, for the built-in plan."""
    import dataclasses

    import dask

    from daskllm.engines.backends import Heads, TritonBackend

    C = mm.MatmulConfig

    def entries(*plan):
        return [{"max_rows": limit, "config": dataclasses.asdict(cfg)} for limit, cfg in plan]

    good = ((8, C(64, 16, 32, 4, 2)), (None, C(128, 32, 32, 8, 3)))
    bad = ((8, C(64, 16, 64, 4, 2)), (None, C(128, 32, 32, 8, 3)))
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"plans": [{"n": 48, "k": 64, "dtype": "bf16", "plan": entries(*good)},
                                          {"n": 40, "k": 64, "dtype": "bf16", "plan": entries(*bad)}]}))
    with dask.config.set({"daskllm.engine.matmul-plans": str(path)}):
        backend = TritonBackend(Heads(4, 2, 16))
    assert backend.linear(torch.zeros(48, 64, dtype=torch.bfloat16)).plan == good
    with caplog.at_level(logging.WARNING, logger="daskllm.engines.backends"):
        refused = backend.linear(torch.zeros(40, 64, dtype=torch.bfloat16))
    assert refused.plan == mm.default_plan(40, torch.bfloat16, None)
    assert "matmul-plans" in caplog.text and "block_k" in caplog.text
