"""The projections' product, batch-invariant: ``F.linear(x, weight, bias)`` whose every row has the
same bits whatever the row count.

A row's output element is a reduction over K. Its bits depend on the order of that reduction and
on the instruction accumulating it, never on how many rows share the launch: every config reduces
K in ``block_k`` steps, in order, into one float32 accumulator (no split-K). A tile's shape is
free to follow the row count as long as that reduction stays the same, so a :class:`Product`
holds a *plan*: an ordered list of ``(max_rows, config)``, a small-M config that spreads a decode
step's few rows over many thread blocks and a large-M one that runs a prefill at tensor-core
speed. One plan's configs share ``block_k`` and precision and, for 16-bit weights, keep the rules
under which Triton gives every one of them Hopper's wgmma (:func:`plan_problems`). On CUDA a
Product checks at construction that its configs give the reference config's bits
(:func:`verify`) and drops any that do not, so exactness never rests on the rules alone.

The plan comes from the weight's shape, dtype and device only (:func:`default_plan`, or a tuned
table from ``bench/gpu_matmul_tune.py --save``, read by :func:`load_plans`), which is what makes
a row's bits independent of its batch. This is the approach of the "batch-invariant ops" work
that vLLM adopted as ``VLLM_BATCH_INVARIANT``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from daskllm.engines.triton_kernels._launch import compiling_only, launch
from daskllm.engines.triton_kernels._interpret import WIDEN as _WIDEN

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One kernel configuration. ``block_k`` and ``precision`` shape the reduction; the rest is speed.

    ``tma``: load the tiles with Hopper's tensor memory accelerator (host-side descriptors; rows
    and columns past the tensor are zero-filled by the hardware). ``persistent``: launch one
    program per SM, each looping over output tiles. Both are off by default, tried by the tune
    script; neither changes a tile's arithmetic.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # tiles sharing a column block run together (L2 reuse); order does not change bits
    precision: str = "tf32"  # tl.dot's input_precision: "ieee" keeps float32 products float32
    tma: bool = False
    persistent: bool = False

    @property
    def label(self) -> str:
        flags = "".join(f" {name}" for name in ("tma", "persistent") if getattr(self, name))
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"g{self.group_m}{flags}")


# (max_rows, config), in increasing max_rows; the last entry's max_rows is None (any row count) and
# its config is the plan's reference.
Plan = tuple[tuple[int | None, MatmulConfig], ...]
PlanKey = tuple[int, int, torch.dtype]  # (N, K, dtype) of a weight [N, K]

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
VERIFY_ROWS = (1, 7, 64, 200)
# The default plans aim to fill this many SMs (H100 SXM and H200; a guess elsewhere: tune it).
_SMS = 132


def plan_key(weight: torch.Tensor) -> PlanKey:
    """What a plan is chosen by: the weight's (N, K) and dtype (the device is the table's)."""
    return (weight.shape[0], weight.shape[1], weight.dtype)


def plan_problems(plan: Plan, dtype: torch.dtype) -> list[str]:
    """Why ``plan`` could give a row different bits at different row counts (empty: it cannot, by construction).

    The configs must share the reference's ``block_k`` and precision. For 16-bit dtypes each
    must also meet Triton's conditions for Hopper's wgmma (numWarps % 4 == 0, the CTA's M % 64
    == 0, N % 8 == 0): a config that misses one gets mma.sync, which may round differently.
    float32 keeps precision "ieee" (exact float32 products, fused multiply-adds in K order).
    """
    if not plan:
        return ["the plan is empty"]
    problems = []
    limits = [limit for limit, _ in plan]
    if limits[-1] is not None or any(limit is None or limit < 1 for limit in limits[:-1]):
        problems.append("every max_rows but the last must be a positive int, the last None")
    elif limits[:-1] != sorted(set(limits[:-1])):
        problems.append("max_rows must increase")
    reference = plan[-1][1]
    for _, cfg in plan:
        blocks = (cfg.block_m, cfg.block_n, cfg.block_k)
        if any(b < 16 or b & (b - 1) for b in blocks) or cfg.num_warps & (cfg.num_warps - 1):
            problems.append(f"{cfg.label}: tile sides must be powers of 2 >= 16, num_warps a power of 2")
        if cfg.num_stages < 1 or cfg.group_m < 1:
            problems.append(f"{cfg.label}: num_stages and group_m must be positive")
        if (cfg.block_k, cfg.precision) != (reference.block_k, reference.precision):
            problems.append(f"{cfg.label}: block_k {cfg.block_k} and precision {cfg.precision!r} differ from "
                            f"the reference's ({reference.block_k}, {reference.precision!r})")
        if dtype in SIXTEEN_BIT and (cfg.block_m % 64 or cfg.num_warps % 4):
            problems.append(f"{cfg.label}: 16-bit configs need block_m % 64 == 0 and num_warps % 4 == 0 (wgmma)")
        if dtype == torch.float32 and cfg.precision != "ieee":
            problems.append(f"{cfg.label}: float32 configs need precision 'ieee'")
    return problems


def _decode_block_n(n: int) -> int:
    """The widest of 64, 32, 16 giving a one-tile-high launch 128+ blocks: split-K is ruled out, so a
    decode step's parallelism is the number of column blocks."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) >= 128), 16)


@functools.lru_cache(maxsize=None)
def default_plan(n: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> Plan:
    """The plan for a weight of N rows (output features) in ``dtype`` on a device of this CUDA capability.

    16-bit on Hopper (and None: the interpreter checks the plan Hopper runs), by row count M:

    * up to max(16, block_n) rows, 64 x block_n tiles (block_n 16..64: 128+ blocks, see
      :func:`_decode_block_n`), 4 warps, as many stages as two blocks per SM allow: a decode
      step streams the weight through many SMs; rows past M are masked, so they move no
      memory. Beyond, each column block re-reading x's rows would cost more than the weight.
    * then 64 x 64 tiles, while 128 x 128 ones would fill fewer than half the SMs;
    * then 128 x 128 (8 warps, 4 stages), until 128 x 256 tiles (8 warps, 3 stages, 144 KB of
      shared memory: what Triton's tutorials find best on Hopper) make two waves.

    Other GPUs: the same small tiles with 4 stages, then 128 x 128 with 3 (within 100 KB of
    shared memory). float32: fused multiply-adds in K order ("ieee"), 16 x 64 tiles up to 16
    rows, 64 x 64 beyond. The block counts aim at 132 SMs (H100 SXM, H200). Plans tuned on the
    machine (``bench/gpu_matmul_tune.py --save``) replace these.
    """
    if dtype == torch.float32:
        return ((16, MatmulConfig(16, 64, 32, 4, 4, precision="ieee")),
                (None, MatmulConfig(64, 64, 32, 4, 3, precision="ieee")))
    if dtype not in SIXTEEN_BIT:
        raise ValueError(f"no matmul plan for {dtype}")
    hopper = capability is None or capability[0] == 9
    block_n = _decode_block_n(n)
    small = MatmulConfig(64, 64, 64, 4, 6 if hopper else 4)
    decode = small if block_n == 64 else MatmulConfig(64, block_n, 64, 4, 8 if hopper else 4)
    small_rows = 128 * (_SMS // 2 // triton.cdiv(n, 128))
    if hopper:
        tiers = [(max(16, block_n), decode), (small_rows, small), (128 * triton.cdiv(2 * _SMS, triton.cdiv(n, 256)),
                 MatmulConfig(128, 128, 64, 8, 4)), (None, MatmulConfig(128, 256, 64, 8, 3))]
    else:
        tiers = [(max(16, block_n), decode), (small_rows, small), (None, MatmulConfig(128, 128, 64, 8, 3))]
    plan: list[tuple[int | None, MatmulConfig]] = []
    for limit, cfg in tiers:  # a tier whose rows an earlier one covers is left out; equal neighbours merge
        if plan and limit is not None and limit <= plan[-1][0]:
            continue
        if plan and plan[-1][1] == cfg:
            plan.pop()
        plan.append((limit, cfg))
    return tuple(plan)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    """A persistent launch's programs: one per SM; two under the interpreter, so each loops over tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _pick(plan: Plan, rows: int) -> MatmulConfig:
    return next(cfg for limit, cfg in plan if limit is None or rows <= limit)


@triton.jit
def _tile(a, b, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, tile,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
          WIDEN: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n)) % size_m
    pid_n = (tile % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            x = a.load([pid_m * BLOCK_M, k0])
            w = b.load([pid_n * BLOCK_N, k0]).T
        else:
            a_ptrs = a + rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
            b_ptrs = b + (k0 + offs_k)[:, None] * stride_bk + cols[None, :] * stride_bn
            if EVEN_K:
                x = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - k0
                x = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if WIDEN:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a, b, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                   PERSISTENT: tl.constexpr, WIDEN: tl.constexpr):
    # M is never specialized (not even M == 1): one compiled kernel per config for every row count.
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _tile(a, b, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  tile, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PRECISION, EVEN_K, TMA, WIDEN)
    else:
        _tile(a, b, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
              tl.program_id(0), HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PRECISION, EVEN_K, TMA, WIDEN)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can read t [rows, K] as it is: last dim contiguous, base and row stride 16-byte aligned."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def run_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: MatmulConfig) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] by one config (a Product picks it by M)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = (min(tiles, _programs(x.device)) if cfg.persistent else tiles,)
    a, b = x, weight
    if cfg.tma:
        if not _tma_ready(x):  # a copy has the same values, so the same bits
            x = x.clone(memory_format=torch.contiguous_format)
        a = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        b = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
    launch(_matmul_kernel, grid, a, b, out, bias if bias is not None else out, m, n, k,
                         x.stride(0), x.stride(1), weight.stride(1), weight.stride(0), out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         GROUP_M=cfg.group_m, PRECISION=cfg.precision, EVEN_K=k % cfg.block_k == 0, TMA=cfg.tma,
                         PERSISTENT=cfg.persistent, WIDEN=_WIDEN, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _random_rows(rows: int, weight: torch.Tensor, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    return torch.randn(rows, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)


def _differing(want: torch.Tensor, got: torch.Tensor) -> int:
    """Rows of ``got`` with any bit other than ``want``'s (-0.0 and 0.0 differ, as they would in a sum)."""
    return int((want.view(torch.uint8) != got.view(torch.uint8)).reshape(want.shape[0], -1).any(dim=1).sum())


def _compare(x: torch.Tensor, want: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             cfg: MatmulConfig, rows: Sequence[int]) -> list[tuple[int, int, int]]:
    top = x.shape[0]
    return [(r, _differing(want[:r], run_config(x[:r], weight, bias, cfg)),
             _differing(want[top - r:], run_config(x[top - r:], weight, bias, cfg))) for r in rows]


def bit_differences(weight: torch.Tensor, bias: torch.Tensor | None, cfg: MatmulConfig, reference: MatmulConfig,
                    rows: Sequence[int] = VERIFY_ROWS, seed: int = 0) -> list[tuple[int, int, int]]:
    """Per row count r: (r, rows differing taken first, taken last) of ``cfg`` against ``reference``'s
    result on max(rows) random rows: the first r rows and the last r, so a row sits elsewhere in its tile."""
    x = _random_rows(max(rows), weight, seed)
    return _compare(x, run_config(x, weight, bias, reference), weight, bias, cfg, rows)


def verify(product: Product, rows: Sequence[int] = VERIFY_ROWS, plan: Plan | None = None) -> Plan:
    """``plan`` (default: the product's) without the configs whose rows, on random x with the product's
    weight, differ in any bit from the reference config's, or that do not run here; each dropped
    with a warning. Its rows go to the next config, so the result is always a usable plan.

    The hardware, not only the code, decides a product's bits: checking them on the device is what
    makes a plan exact on any GPU.
    """
    plan = product.plan if plan is None else plan
    if len(plan) == 1:
        return plan
    weight, bias = product.weight, product.bias
    reference = plan[-1][1]
    x = _random_rows(max(rows), weight)
    want = run_config(x, weight, bias, reference)
    shape = f"{weight.shape[0]}x{weight.shape[1]} {DTYPE_NAMES.get(weight.dtype, weight.dtype)}"
    kept = []
    for limit, cfg in plan[:-1]:
        try:
            bad = [f"{r} rows ({first} first, {last} last differ)" for r, first, last in
                   _compare(x, want, weight, bias, cfg, rows) if first or last]
        except Exception as error:  # does not compile or run on this device (e.g. too much shared memory)
            bad = [f"does not run: {type(error).__name__}: {error}"]
        if bad:
            logger.warning("matmul %s: config %s (up to %s rows) dropped from the plan: its bits are not the "
                           "reference %s's: %s", shape, cfg.label, limit, reference.label, "; ".join(bad))
        else:
            kept.append((limit, cfg))
    return (*kept, plan[-1])


_VERIFIED: dict[tuple, Plan] = {}  # (N, K, dtype, device, plan) -> the verified plan: one check per shape


class Product:
    """``F.linear(x, weight, bias)`` for one projection, by the config its plan gives x's row count.

    ``plan``: default :func:`default_plan` for the weight's shape, dtype and device; or an
    explicit one (a tuned table, see :func:`load_plans`). It must obey :func:`plan_problems`
    (ValueError otherwise). On CUDA the plan is verified (:func:`verify`) once per (shape,
    dtype, device, plan), by :meth:`check` or else by the first launch outside
    ``compile_only`` (where :meth:`check` compiles every config the verification launches).
    """

    __slots__ = ("weight", "bias", "plan", "checked")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, plan: Plan | None = None):
        n, k = weight.shape
        if plan is None:
            plan = default_plan(n, weight.dtype, _capability(weight.device))
        plan = tuple((limit, cfg) for limit, cfg in plan)  # hashable, whatever sequences it came as
        problems = plan_problems(plan, weight.dtype)
        if problems:
            raise ValueError(f"matmul plan for {n}x{k} {weight.dtype}: " + "; ".join(problems))
        self.weight, self.bias, self.plan = weight, bias, plan
        self.checked = not weight.is_cuda  # the interpreter's bits are the code's: tests verify explicitly

    def check(self) -> Plan:
        """The plan, verified on this device (configs whose bits differ dropped)."""
        if compiling_only():
            verify(self)  # compiles what verifying launches; its verdicts are garbage here
            return self.plan
        key = (*self.weight.shape, self.weight.dtype, self.weight.device, self.plan)
        if key not in _VERIFIED:
            _VERIFIED[key] = verify(self)
        self.plan, self.checked = _VERIFIED[key], True
        return self.plan

    def config(self, rows: int) -> MatmulConfig:
        return _pick(self.plan, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checked and not compiling_only():
            self.check()
        return run_config(x, self.weight, self.bias, _pick(self.plan, x.shape[0]))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K], weight [N, K], every row batch-invariant: the
    default plan of the weight's shape (verified once per shape on CUDA, as any Product's)."""
    return Product(weight, bias)(x)


def load_plans(path: str | os.PathLike) -> dict[PlanKey, Plan]:
    """The plans ``bench/gpu_matmul_tune.py --save`` wrote, by :func:`plan_key`, for ``Product(w, b,
    plans.get(plan_key(w)))``: ``{"plans": [{"n", "k", "dtype": "bf16", "plan": [{"max_rows",
    "config": MatmulConfig's fields}, ...]}, ...]}``. They were tuned on the GPU the file names;
    a Product verifies them on its own."""
    names = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    data = json.loads(pathlib.Path(path).read_text())
    return {(p["n"], p["k"], names[p["dtype"]]): tuple((e["max_rows"], MatmulConfig(**e["config"])) for e in p["plan"])
            for p in data["plans"]}
