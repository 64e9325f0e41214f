# One command each: make test | make lab | make notebooks. Each creates .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU machine gets the pinned CPU wheel; a GPU user sets TORCH= (keep theirs) or TORCH=torch (PyPI's CUDA build).
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
