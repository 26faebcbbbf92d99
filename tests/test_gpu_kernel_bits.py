"""bench/gpu_kernel_bits.py, the GPU check of the Triton kernels' row bits, on CPU under Triton's
interpreter (its ``--device cpu``): it compares every kernel, dtype and row count, and fails
when a row's bits depend on the batch."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

# Before Triton is imported, as in tests/test_triton_kernels.py: @triton.jit reads it.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_kernel_bits  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="TRITON_INTERPRET is not 1")


def test_every_kernel_dtype_and_row_count_is_compared(tmp_path, capsys):
    out = tmp_path / "bits.json"
    assert gpu_kernel_bits.main(["--device", "cpu", "--rows", "1", "3", "17", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(x["kernel"], x["dtype"], x["rows"]) for x in results] == [
        (kernel, dtype, rows) for dtype in ("bf16", "fp32") for kernel in ("matmul", "rms_norm", "paged_attention")
        for rows in (1, 3, 17)]
    assert all(x["first_differing"] == x["last_differing"] == 0 for x in results)
    # The kernels compute what torch does (so equal bits are not, say, zeros everywhere).
    assert all(x["torch_abs_diff"] < (1e-5 if x["dtype"] == "fp32" else 0.1) for x in results)
    assert "| paged_attention | fp32 | 3 | same bits | same bits | 0 |" in capsys.readouterr().out


def test_a_row_whose_bits_depend_on_the_batch_fails_the_check(monkeypatch, capsys):
    from daskllm.engines import triton_kernels

    matmul = triton_kernels.matmul

    def batch_dependent(x, weight, bias=None):  # one ulp-sized step added below 17 rows
        out = matmul(x, weight, bias)
        return out + 1e-6 * out.abs() if x.shape[0] < 17 else out

    monkeypatch.setattr(triton_kernels, "matmul", batch_dependent)
    assert gpu_kernel_bits.main(["--device", "cpu", "--rows", "1", "17", "--dtypes", "fp32"]) == 1
    printed = capsys.readouterr().out
    assert "| matmul | fp32 | 1 | **1 of 1 differ** | **1 of 1 differ** |" in printed
    assert "| rms_norm | fp32 | 1 | same bits | same bits | 0 |" in printed
    assert "5 of 6 comparisons bit for bit equal" in printed
