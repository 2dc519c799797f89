# memtrain: `make run` for a first measured table, `make test` for the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXP    ?= quick
DIR    ?= runs
ARGS   ?=
QUICK_DIR := runs/quick/$(shell date +%Y-%m-%d_%H-%M-%S)

.DEFAULT_GOAL := help
.PHONY: help install run test test-fast lint sweep report bench-overhead bench-prune clean

help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install memtrain with its dev tools

run: $(STAMP) ## run the default study (every method, synthetic data, CPU, ~3 min) and print its table
	$(BIN)/memtrain experiment=quick hydra.sweep.dir=$(QUICK_DIR) $(ARGS)
	$(BIN)/memtrain-report $(QUICK_DIR)

test: $(STAMP) ## run the test suite (CPU; Triton kernels in interpreter mode)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(ARGS)

test-fast: $(STAMP) ## the tests without those marked slow
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP) ## ruff over the code and tests
	$(BIN)/ruff check memtrain kernels tests

sweep: $(STAMP) ## run an experiment preset as a multirun: make sweep EXP=pool_study ARGS=trainer=smoke
	$(BIN)/memtrain -m experiment=$(EXP) $(ARGS)

report: $(STAMP) ## table of every run below DIR (default runs/): make report DIR=runs/multirun
	$(BIN)/memtrain-report $(DIR) $(ARGS)

bench-overhead: $(STAMP) ## runner overhead: memtrain's step time against a plain PyTorch loop
	$(BIN)/python -m memtrain.bench.overhead $(ARGS)

bench-prune: $(STAMP) ## prune: grad_weight/compaction kernels vs dense and torch BSR, then resmlp24 end to end
	$(BIN)/python -m memtrain.kernels.bench prune $(ARGS)
	$(BIN)/python -m memtrain.bench.prune

clean: ## remove caches (keeps .venv and runs/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info
