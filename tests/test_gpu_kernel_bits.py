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

pytestmark = [pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="TRITON_INTERPRET is not 1"),
              pytest.mark.bits]


ATTENTION = ("paged_attention", "paged_attention/split", "paged_attention/decode", "paged_attention/decode+split")


def test_every_kernel_dtype_and_row_count_is_compared(tmp_path, capsys):
    """22 rows: two prefill tiles of the group of 6's 21 positions; 100 cached positions before
    them, in chunks of 64 keys: two chunks. One KV head, to keep the interpreter's programs few."""
    out = tmp_path / "bits.json"
    argv = ["--device", "cpu", "--rows", "1", "3", "22", "--heads", "6", "--kv-heads", "1", "--json", str(out)]
    assert gpu_kernel_bits.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(x["kernel"], x["dtype"], x["rows"]) for x in results] == [
        (kernel, dtype, rows) for dtype in ("bf16", "fp32") for kernel in ("matmul", "rms_norm", *ATTENTION)
        for rows in (1, 3, 22)]
    assert all(x["first_differing"] == x["last_differing"] == 0 and x["counted"] for x in results)
    # The kernels compute what torch does (so equal bits are not, say, zeros everywhere).
    assert all(x["torch_abs_diff"] < (1e-5 if x["dtype"] == "fp32" else 0.1) for x in results)
    printed = capsys.readouterr().out
    assert "| paged_attention | fp32 | 3 | same bits | same bits | 0 |" in printed
    assert "| paged_attention/decode+split | bf16 | 22 | same bits | same bits | 0 |" in printed


def test_a_row_whose_bits_depend_on_the_batch_fails_the_check(monkeypatch, capsys):
    from daskllm.engines import triton_kernels

    matmul = triton_kernels.matmul

    def batch_dependent(x, weight, bias=None):  # one ulp-sized step added below 17 rows
        out = matmul(x, weight, bias)
        return out + 1e-6 * out.abs() if x.shape[0] < 17 else out

    monkeypatch.setattr(triton_kernels, "matmul", batch_dependent)
    argv = ["--device", "cpu", "--rows", "1", "17", "--dtypes", "fp32", "--kernels", "matmul", "rms_norm"]
    assert gpu_kernel_bits.main(argv) == 1
    printed = capsys.readouterr().out
    assert "| matmul | fp32 | 1 | **1 of 1 differ** | **1 of 1 differ** |" in printed
    assert "| rms_norm | fp32 | 1 | same bits | same bits | 0 |" in printed
    assert "3 of 4 comparisons bit for bit equal" in printed


def test_a_fast_path_self_check_turned_off_fails_nothing(monkeypatch):
    """Where a GPU's self_check finds decode tiles differ, the engine does not use them: their
    rows differing are shown but fail nothing (here made to differ, self_check's answer given)."""
    from daskllm.engines import triton_kernels
    from tests.triton_interpreter import kernel_check_interpreter

    cases = gpu_kernel_bits.attention_cases

    def decode_differs(*args):
        found = cases(*args)
        run, reference, baseline = found["paged_attention/decode"]
        found["paged_attention/decode"] = (lambda lo, hi: run(lo, hi) * 1.001, reference, baseline)
        return found

    monkeypatch.setattr(gpu_kernel_bits, "attention_cases", decode_differs)
    args = gpu_kernel_bits.parse_args(["--device", "cpu", "--rows", "1", "2", "--dtypes", "fp32", "--heads", "6",
                                       "--kv-heads", "1", "--kernels", "paged_attention/decode"])
    with kernel_check_interpreter():
        turned_off = gpu_kernel_bits.check(triton_kernels, args, {"fp32": {"decode_tile": False}})
        trusted = gpu_kernel_bits.check(triton_kernels, args, {"fp32": {"decode_tile": True}})
    assert "| paged_attention/decode (unused: self_check found it differ) | fp32 | 1 | **1 of 1 differ** |" in \
        gpu_kernel_bits.tables(turned_off, 2)
    assert gpu_kernel_bits.summary(turned_off) == (
        "0 of 2 comparisons bit for bit equal; the 2 others on paths self_check turned off", False)
    assert gpu_kernel_bits.summary(trusted) == ("0 of 2 comparisons bit for bit equal", True)
