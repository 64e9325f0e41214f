# One command each: make test | make lab | make notebooks. Each creates .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# TORCH: what pip installs first when $(VENV) has no torch (a torch already there is kept). Which build
# torch==2.13.0 is depends on the index: PyPI's Linux x86-64 wheel is the CUDA one, an index that carries
# 2.13.0+cpu gives the CPU one. TORCH= skips the step; TORCH=torch takes the newest default build (README).
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

nbval: $(STAMP)
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then $(BIN)/python -m pytest -q --nbval notebooks/ -p no:cacheprovider; \
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
