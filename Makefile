# One command each: make test | make lab | make notebooks. Each creates .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# TORCH: what pip installs first when $(VENV) has no torch (a torch already there is kept). Which build
# torch==2.13.0 is depends on the index: PyPI's Linux x86-64 wheel is the CUDA one, an index that carries
# 2.13.0+cpu gives the CPU one. TORCH= skips the step; TORCH=torch takes the newest default build (docs/install.md).
TORCH ?= torch==2.13.0
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: test lint unit compile-check nbval lab notebooks clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if [ -n "$(TORCH)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH)"; $(BIN)/python -m pip install -q "$(TORCH)"; fi
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: lint unit compile-check nbval

lint: $(STAMP)
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests

compile-check: $(STAMP)
	@if $(BIN)/python -c "import attnlab.backends.cuda" 2>/dev/null; then $(BIN)/python -m attnlab compile-check --strict; \
	else echo "compile-check: attnlab.backends.cuda not present yet"; fi

# nbval runs twice: on this CPU's own vector code, then with torch (ATen, MKL, oneDNN), NumPy and OpenBLAS
# held to baseline x86-64 code on one thread, so that an output which depends on the CPU fails on every
# machine, not only on the user's. The sanitizer masks the measured errors printed with a leading "~".
NBVAL := -m pytest -q --nbval notebooks/ -p no:cacheprovider --nbval-sanitize-with notebooks/nbval_sanitize.cfg
NPY_DISPATCH := X86_V3 X86_V4 AVX512_ICL AVX512_SPR SSSE3 SSE41 POPCNT SSE42 AVX F16C FMA3 AVX2 AVX512F AVX512CD \
	AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL
BASELINE_CPU := ATEN_CPU_CAPABILITY=default NPY_DISABLE_CPU_FEATURES="$(NPY_DISPATCH)" OPENBLAS_CORETYPE=Prescott \
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 OMP_NUM_THREADS=1

nbval: $(STAMP)
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
		echo "nbval on this CPU's own vector code" && $(BIN)/python $(NBVAL) && \
		echo "nbval again with baseline x86-64 code on one thread" && env $(BASELINE_CPU) $(BIN)/python $(NBVAL); \
	else echo "nbval: no notebooks yet"; fi

lab: $(STAMP)
	mkdir -p notebooks
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
		$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb" || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# The recipe of `test` (its prerequisites are listed above), run after they all pass: the GPU tests are not
# part of `make test`, so on a machine with a GPU say how to run them.
test:
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		echo "A GPU is present; make test ran the CPU tests only. The GPU tests: $(BIN)/python -m pytest -m gpu"; \
		$(BIN)/python -c "import cupy" 2>/dev/null || \
			echo "(the CUDA kernels' tests need CuPy: make test EXTRAS=dev,cuda12 or EXTRAS=dev,cuda13)"; fi
