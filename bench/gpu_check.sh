#!/usr/bin/env bash
# The torch engine's GPU checks in one command, for a GPU machine with no package index
# (docs/benchmarks.md, "Torch engine on a GPU"). Prepare here, from the project's root:
#
#   echo /.gpu/ >> .git/info/exclude
#   ../shared/gpu/make_wheelhouse.sh && cp -r ../shared/gpu/minilm .gpu/
#
# (with no argument: it writes .gpu/whl; given a folder, that script also hands the folder to
# pip as a requirement and fails). Or this project's own scripts/wheelhouse.py, as
# docs/offline.md shows for that machine (every dependency, not a fixed list).
#
# then, there, with .gpu sent along:   OUT=<results dir> bash bench/gpu_check.sh [gpu_engine.py options]
#
# 1. bench/gpu_kernel_bits.py: the Triton kernels (matmul across its decode and prefill
#    configurations, RMSNorm, paged attention in its decode, split and prefill layouts) in bf16 and
#    fp32 at 1..512 rows, and exit status 1 if any row's bits differ from the largest batch's;
# 2. bench/gpu_matmul_tune.py: candidate tile configurations of every llama-1b projection timed
#    against cuBLAS and the memory bound, each one's bits against its plan's reference;
# 3. bench/gpu_engine.py (on the plans step 2 saved, unless TUNED=0): start-up on empty and warm
#    caches, then exact mode (batch-invariant kernels, CUDA graphs), --no-batch-invariant (cuBLAS
#    products: what exactness costs) and transformers side by side in one run: every target, and
#    exit status 1 if any greedy output of exact mode changes with the batch or a cached prefix.
# Each step writes its JSON and log under $OUT as it goes, so a run cut short keeps what it measured.
# The options given to this script go to gpu_engine.py.
# Tried on CPU with:  PYTHON=.venv/bin/python OUT=/tmp/out bash bench/gpu_check.sh --quick
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".gpu/whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/.gpu/minilm:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DASKLLM_CACHE_DIR=${DASKLLM_CACHE_DIR:-/tmp/daskllm-cache} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import torch, transformers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "none"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, triton {tv}, {gpu}")
EOF
status=0
timeout "${KERNEL_LIMIT_S:-100}" "$PY" bench/gpu_kernel_bits.py --json "$OUT/kernel_bits.json" \
  2>&1 | tee "$OUT/kernel_bits.log" || status=1
timeout "${TUNE_LIMIT_S:-110}" "$PY" bench/gpu_matmul_tune.py --json "$OUT/matmul_tune.json" \
  --save "$OUT/matmul_plans.json" 2>&1 | tee "$OUT/matmul_tune.log" || true  # timings: nothing to fail
# The engine runs on the plans just tuned where the tuning wrote any (as a user would point
# daskllm.engine.matmul-plans at them); TUNED=0 keeps the built-in plans.
if [[ "${TUNED:-1}" == 1 && -s "$OUT/matmul_plans.json" ]]; then
  export DASK_DASKLLM__ENGINE__MATMUL_PLANS="$OUT/matmul_plans.json"
fi
timeout "${ENGINE_LIMIT_S:-330}" "$PY" bench/gpu_engine.py --repeats 1 --json "$OUT/gpu_engine.json" "$@" \
  2>&1 | tee "$OUT/gpu_engine.log" || status=1
exit $status
