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
.PHONY: help install run test test-fast test-compat check-studies coverage lint sweep report clean docs

help: ## show this help
	@if [ -t 1 ]; then c='\033[36m'; r='\033[0m'; else c=''; r=''; fi; \
	awk -v c="$$c" -v r="$$r" 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %s%-16s%s %s\n", c, $$1, r, $$2}' $(MAKEFILE_LIST)

# pip prints each package as it goes (a first install downloads torch: minutes), so a first
# `make run` or `make test` shows where it is
$(STAMP): pyproject.toml
	@echo "make: installing memtrain with its dev and docs tools into $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev,docs]'
	touch $(STAMP)
	@echo "make: installed"

install: $(STAMP) ## create .venv and install memtrain with its dev and docs tools

run: $(STAMP) ## the smoke study: every method 40 steps on synthetic data (CPU), and its table
	@echo "make run: the smoke study (experiment=quick): each job says 'memtrain: job i/n' as it" \
	  "starts and logs its steps; then the table"
	$(BIN)/memtrain experiment=quick hydra.sweep.dir=$(QUICK_DIR) \
	  +hydra.callbacks.report.enabled=false $(ARGS)
	$(BIN)/memtrain-report $(QUICK_DIR)
	@echo "make run: a smoke study (40 steps of synthetic data per method: every method runs and" \
	  "saves memory; accuracies after 40 steps are no measure of a method's cost). The multi-seed" \
	  "study on real data is README's first figure (make headline)."

# The site (mkdocs.yml: nav, theme); --strict with anchor validation: a broken link or anchor
# fails, as tests/test_docs_site.py holds in make test
docs: $(STAMP) ## the documentation site from docs/ (mkdocs-material, --strict) -> site/
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict $(ARGS)

JOBS ?= $(shell nproc 2>/dev/null || echo 2)

# One worker per core, one thread per worker (more oversubscribes the cores: small convolutions
# get many times slower); worksteal hands a finished worker the other's queued tests, so one
# slow file at the end does not leave a core idle. docs/testing.md: the budget and its parts.
PYTEST = OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(1)/python -m pytest -q -n $(JOBS) --dist worksteal

# the suite's budget on the 2-core machine (docs/testing.md): make test says where it stands
TEST_BUDGET_S ?= 600
# Tests that mostly wait on a clock outside the worker (the throwaway SLURM cluster's scheduler
# and time limits count in tens of seconds): a pytest session of their own, started beside the
# main one, so that their waiting leaves no core idle; their output follows the main session's.
# Both sessions share the folder of the `ranks` lock (MEMTRAIN_TEST_LOCKS, tests/conftest.py),
# so the `ranks` one among them still has the machine to itself, on the same throwaway
# cluster. Given ARGS, make test runs one session of what ARGS selects. The side session
# collects only the files that hold them (the whole suite's collection costs it seconds of a
# core the main session needs; tests/test_tools.py holds every such mark to these files).
BESIDE := slurm
BESIDE_FILES := tests/test_slurm.py
test: $(STAMP) ## run the test suite (CPU, one worker per core; Triton kernels in interpreter mode); prints the 10 slowest tests and its time against the budget
	@t0=$$(date +%s); side=$$(mktemp -d); export MEMTRAIN_TEST_LOCKS=$$side; \
	  if [ -z "$(strip $(ARGS))" ]; then \
	    { $(call PYTEST,$(BIN)) -n 0 -p no:cacheprovider -m "$(BESIDE)" $(BESIDE_FILES) \
	      > $$side/out 2>&1; \
	      echo $$? > $$side/rc; } & \
	    $(call PYTEST,$(BIN)) --durations=10 -m "not ($(BESIDE))"; rc=$$?; \
	    wait; echo "make test: the tests beside ($(BESIDE)):"; cat $$side/out; \
	    srv=$$(cat $$side/rc); [ $$srv = 5 ] && srv=0; [ $$rc = 0 ] && rc=$$srv; \
	  else $(call PYTEST,$(BIN)) --durations=10 $(ARGS); rc=$$?; fi; \
	  rm -rf $$side; t=$$(( $$(date +%s) - t0 )); \
	  echo "make test: $$t s of a $(TEST_BUDGET_S) s budget ($$(nproc) cores)$$( [ $$t -gt $(TEST_BUDGET_S) ] && echo ': OVER BUDGET')"; \
	  exit $$rc

# The oldest torch the project supports (what GPU boxes have: torch 2.11, torchvision 0.26, Triton
# 3.6), in a second virtual environment; pyproject's torch range names exactly these two ends.
# It holds those three (and the setuptools torch 2.11 asks for) and memtrain alone; the rest
# (Hydra, pandas, pytest, the CUDA libraries torch loads, ...) it reads from .venv, whose
# site-packages a .pth file adds after its own: one copy of the dependencies (the CUDA libraries
# alone are some GB), and the two environments differ only in what test-compat is about.
COMPAT       ?= .venv-compat
COMPAT_TORCH ?= torch==2.11.0 torchvision==0.26.0 triton==3.6.0 'setuptools>=77,<82'
SITE         := -c 'import sysconfig; print(sysconfig.get_path("purelib"))'
# torch and torchvision first (most of the install: unpacking their wheels), a target of its
# own so that .ci/run can make it beside .venv's install, one pip per core
$(COMPAT)/.torch:
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --no-deps $(COMPAT_TORCH)
	touch $@
$(COMPAT)/.installed: pyproject.toml $(COMPAT)/.torch $(STAMP)
	echo "import site; site.addsitedir('$$($(BIN)/python $(SITE))')" \
	  > "$$($(COMPAT)/bin/python $(SITE))/zz-memtrain-shared.pth"
	$(COMPAT)/bin/python -m pip install -q --no-deps -e .
	$(COMPAT)/bin/python -c 'import torch, torchvision, triton, hydra, memtrain; \
	  print("make: .venv-compat has torch", torch.__version__, "torchvision", \
	        torchvision.__version__, "triton", triton.__version__)'
	touch $@

# The tests of what depends on the torch/Triton version (marked compat: the kernels, selective
# checkpointing, compile, quantize, saved-tensor hooks and the memory tracker), on the oldest
# torch; the rest (Hydra, the launchers, reports, sweeps) is the same code in both environments.
test-compat: $(COMPAT)/.installed ## the compat-marked tests on torch 2.11 + torchvision 0.26 + Triton 3.6 (.venv-compat)
	$(call PYTEST,$(COMPAT)/bin) -m "compat and not breadth and not any_torch" --durations=10 $(ARGS)

test-fast: $(STAMP) ## the inner loop (~2 min): the tests not marked slow
	$(call PYTEST,$(BIN)) -m "not slow" $(ARGS)

# The multi-seed accuracy studies (marked study; their single-seed guards run in make test too),
# and the claims on the deeper twins (marked deep: tests/conftest.py TWINS): every study run kept
# under runs/studies/<study>/, then one report per study, committed under
# docs/results/studies/<study>/ (mean and std over the seeds).
STUDIES_DIR ?= runs/studies
check-studies: $(STAMP) ## the multi-seed accuracy studies (~15 min) -> docs/results/studies/
	rm -rf $(STUDIES_DIR)
	$(call PYTEST,$(BIN)) --studies --studies-dir $(CURDIR)/$(STUDIES_DIR) -m "study or guard or deep" \
	  $(ARGS); rc=$$?; \
	for d in $(STUDIES_DIR)/*/; do n=$$(basename $$d); \
	  $(BIN)/memtrain-report $$d --out docs/results/studies/$$n --no-figures >/dev/null || exit 1; \
	  rm -f docs/results/studies/$$n/summary.parquet docs/results/studies/$$n/report.html; \
	  sed -i 's#$(CURDIR)/##g' docs/results/studies/$$n/*; done; \
	$(BIN)/python -m tools.docs || exit 1; \
	echo "check-studies: reports in docs/results/studies/ (pytest exit $$rc)"; exit $$rc

# Line coverage over the whole suite (pyproject's [tool.coverage]: subprocesses and xdist
# workers measured too, Triton kernels through the interpreter): the product (memtrain/ and
# kernels/), then the tools beside it (benchmarks/ and tools/) on their own
coverage: $(STAMP) ## make test under coverage.py; prints the coverage of memtrain/ + kernels/, then of benchmarks/ + tools/
	rm -f .coverage .coverage.*
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/coverage run -m pytest -q -n $(JOBS) --dist worksteal $(ARGS)
	$(BIN)/coverage combine -q
	$(BIN)/coverage report --skip-covered --include='memtrain/*,kernels/*' | tail -n 3
	$(BIN)/coverage report --skip-covered --include='benchmarks/*,tools/*' | tail -n 3

lint: $(STAMP) ## ruff over the code, the tools beside it and the tests
	$(BIN)/ruff check memtrain kernels benchmarks tools tests

sweep: $(STAMP) ## run an experiment preset as a multirun: make sweep EXP=pool_study ARGS=trainer=smoke
	$(BIN)/memtrain -m experiment=$(EXP) $(ARGS)

report: $(STAMP) ## report.md, summary.csv/.parquet and figures of every run below DIR: make report DIR=runs/multirun
	$(BIN)/memtrain-report $(DIR) $(ARGS)

# README's first figure: every CPU-capable method at its defaults against none on Fashion-MNIST,
# mlp6 (2 epochs) and resnet18 (16 px, 240 steps), seeds 0-2, two jobs at a time with one torch
# thread each (conf/experiment/headline.yaml says why these sizes); the rows are committed as
# docs/results/rows/headline_fmnist_cpu/, the figure drawn from them by the report.
HEADLINE_DIR := runs/headline/$(shell date +%Y-%m-%d_%H-%M-%S)
.PHONY: headline
headline: $(STAMP) ## README's first figure: every CPU method at its defaults, Fashion-MNIST, mlp6 + resnet18, 3 seeds (36 runs)
	MEMTRAIN_PARALLEL_JOBS=2 $(BIN)/memtrain -m experiment=headline hydra/launcher=parallel \
	  trainer.device=cpu trainer.threads=1 hydra.sweep.dir=$(HEADLINE_DIR) $(ARGS)
	$(BIN)/python -m tools.docs --capture $(HEADLINE_DIR) headline_fmnist_cpu
	$(BIN)/python -m tools.doc_figures

.PHONY: bench-overhead
bench-overhead: $(STAMP) ## runner overhead: memtrain's step time against a plain PyTorch loop
	$(BIN)/python -m benchmarks.overhead $(ARGS)

.PHONY: bench-baseline
bench-baseline: $(STAMP) ## GPU: resnet50 at 224 px, batch 64, none: peak and breakdown
	$(BIN)/memtrain model=resnet50 dataset.image_size=224 trainer.batch_size=64 \
	  trainer.max_steps=30 hydra.run.dir=runs/bench/baseline_resnet50_224_b64 $(ARGS)
	$(BIN)/memtrain-report runs/bench/baseline_resnet50_224_b64

.PHONY: bench-checkpoint bench-checkpoint-table
bench-checkpoint: $(STAMP) ## GPU: the checkpoint frontier per model (op, block, sqrt, uniform, selective, compile at budgets 0.25-0.8) -> report's budget figure
	$(BIN)/memtrain -m experiment=checkpoint_study hydra.sweep.dir=runs/bench/checkpoint_study $(ARGS)
	$(BIN)/memtrain-report runs/bench/checkpoint_study

bench-checkpoint-table: $(STAMP) ## checkpointing vs none in one process (table); ARGS=--frontier: the planner's op vs block frontier alone
	$(BIN)/python -m benchmarks.checkpoint $(ARGS)

.PHONY: bench-native
bench-native: $(STAMP) ## the budget planner at native checkpointing's activation peak against it (convnext_atto, a ViT, a 2-layer llama; CPU, 1 thread, a few minutes) -> docs/results/rows/native_cpu.csv; then make results-docs
	$(BIN)/python -m benchmarks.native --csv docs/results/rows/native_cpu.csv $(ARGS)

.PHONY: model-coverage
model-coverage: $(STAMP) ## every method on ~60 architectures by name (timm, torchvision, transformers), 2 steps each on the CPU (45-90 min; ARGS=--only a,b) -> runs/coverage/
	$(BIN)/python -m benchmarks.coverage --csv runs/coverage/rows.csv --out runs/coverage/table.md $(ARGS)

.PHONY: transformer-study-cpu
transformer-study-cpu: $(STAMP) ## experiment=transformer_study at gpt_nano scale on the CPU (sequence lengths 128-1024) -> docs/results/rows/transformer_study_cpu/, docs/figures/sequence.png
	$(BIN)/memtrain -m experiment=transformer_study model=gpt_nano model.context=1024 \
	  dataset.seq_len=128,256,512,1024 trainer.batch_size=2 trainer.max_steps=3 \
	  trainer.warmup_steps=1 trainer.device=cpu hydra.sweep.dir=runs/transformer_study_cpu $(ARGS)
	$(BIN)/python -m tools.docs --capture runs/transformer_study_cpu transformer_study_cpu
	$(BIN)/python -m tools.doc_figures

.PHONY: bench-transformer
bench-transformer: $(STAMP) ## the decoder layer against Korthikanti's formula, and gpt2_small's op vs block checkpoint plans (CPU profile) -> docs/results/rows/transformer_*_cpu*.csv; then make results-docs
	$(BIN)/python -m benchmarks.transformer
	$(BIN)/python -m benchmarks.checkpoint --frontier --model gpt2_small --size 1024 --batch 1 \
	  --profile-batch 1 --device cpu --threads 1 --costs time,flops,roofline \
	  --budgets 0.25,0.3,0.35,0.4,0.5 --csv docs/results/rows/transformer_checkpoint_cpu.csv
	$(BIN)/python -m tools.docs

.PHONY: bench-timeline
bench-timeline: $(STAMP) ## trainer.memory_timeline's cost: the accounting step and the run with and without it (CPU) -> docs/results/rows/timeline_cost_cpu.csv
	$(BIN)/python -m benchmarks.timeline --csv docs/results/rows/timeline_cost_cpu.csv $(ARGS)

.PHONY: bench-pool
bench-pool: $(STAMP) ## method=pool vs none: GPU peak/throughput (resnet50 224 px), CPU saved bytes/step time
	$(BIN)/python -m benchmarks.pool $(ARGS)

.PHONY: bench-synthetic
bench-synthetic: $(STAMP) ## method synthetic: per-partition peak, time to target, accuracy vs none (mlp6, resnet18; K=2,3,4)
	$(BIN)/python -m benchmarks.synthetic $(ARGS)

.PHONY: bench-prune
bench-prune: $(STAMP) ## prune: grad_weight/compaction kernels vs dense and torch BSR, then resmlp24 end to end
	$(BIN)/python -m benchmarks.kernels prune $(ARGS)
	$(BIN)/python -m benchmarks.prune

clean: ## remove caches and the built site (keeps .venv and runs/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info .coverage .coverage.* site

# The whole study (tools/study/): every part a row of its own, raw results in
# runs/results/<name>/, tables and figures in docs/results/<name>/ (<name> = <date>_<gpu>),
# then `make results-docs` (not after ARGS=--dry-run, which writes nothing, nor with DOCS=0:
# the results kept apart from the committed docs).
# Without .venv (an offline GPU box): `make gpu-env results PY=python3` (docs/results/study.md).
DEVICE   ?= cuda
PARTS    ?=
DEADLINE ?=
ARCHIVE  ?=
RESULTS_NAME ?=
DOCS     ?= 1
PY       ?=
RESULTS_PY   := $(if $(PY),$(PY),$(BIN)/python)
RESULTS_ARGS := --device $(DEVICE) $(if $(PARTS),--parts $(PARTS)) \
  $(if $(RESULTS_NAME),--name $(RESULTS_NAME)) $(if $(DEADLINE),--deadline-s $(DEADLINE)) \
  $(if $(ARCHIVE),--archive $(ARCHIVE)) $(ARGS)

.PHONY: results results-docs results-figures gpu-env
results-docs: $(if $(PY),,$(STAMP)) ## every generated block of README.md and docs/ again from the committed CSVs, and the architecture page's module map from the code (ARGS=--check: compare only)
	$(RESULTS_PY) -m tools.docs $(ARGS)
	$(RESULTS_PY) -m tools.architecture $(ARGS)

results-figures: $(if $(PY),,$(STAMP)) ## README's pictures of the report's figures (docs/figures/*.png) again from committed rows
	$(RESULTS_PY) -m tools.doc_figures

# The step-anatomy pictures from a real sweep (trainer.memory_timeline=true): the issue's
# command at batch 64, so activations show beside parameters and optimizer state; the rows and
# each run's step files are committed (docs/results/rows/timeline_resnet18_cpu/), then every
# picture of docs/figures/ is drawn again from committed rows
TIMELINE_DIR ?= runs/timeline_docs
.PHONY: timeline-figures
timeline-figures: $(STAMP) ## a real resnet18 sweep with trainer.memory_timeline (CPU, 5-10 min) -> docs/figures/{timeline,layers,anatomy}.png
	rm -rf $(TIMELINE_DIR)
	$(BIN)/memtrain -m method=none,checkpoint,quantize,pool model=resnet18 trainer=smoke \
	  trainer.batch_size=64 trainer.device=cpu trainer.memory_timeline=true \
	  hydra.sweep.dir=$(TIMELINE_DIR) +hydra.callbacks.report.enabled=false $(ARGS)
	$(BIN)/python -m tools.doc_figures --capture-timeline $(TIMELINE_DIR) timeline_resnet18_cpu

results: $(if $(PY),,$(STAMP)) ## the study, priority parts first -> docs/results/<date>_<gpu>/; DEVICE=cpu: tiny, on the CPU
	$(if $(wildcard .whl/site),PYTHONPATH=$(CURDIR)/.whl/site$${PYTHONPATH:+:$$PYTHONPATH}) \
	  $(RESULTS_PY) -m tools.study $(RESULTS_ARGS)
	$(if $(or $(findstring --dry-run,$(ARGS)),$(filter 0,$(DOCS))),,$(MAKE) --no-print-directory results-docs ARGS=)

# memtrain itself editable: its package-dir mapping (memtrain.kernels) needs the install, and
# --no-build-isolation uses the box's setuptools and wheel instead of fetching them
GPU_PY = $(if $(PY),$(PY),python3)
gpu-env: ## offline box with torch but no Hydra: Hydra's wheels from .whl/ into .whl/site, memtrain from here (PY=python3)
	$(GPU_PY) -m pip install -q --no-index --no-deps --upgrade --target .whl/site .whl/*.whl
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	PYTHONPATH=$(CURDIR)/.whl/site $(GPU_PY) -c "import hydra, memtrain.kernels, torch, triton; \
	  print('gpu-env: torch', torch.__version__, 'triton', triton.__version__, 'hydra', hydra.__version__)"

# The GPU call rehearsed as the box runs it: a throwaway Python 3.12 environment with torch 2.11
# and the box's packages only (no Hydra from the registry: Hydra comes from the wheels in .whl/,
# as on the box), then scripts/gpu-results.sh itself at the smoke size on the CPU, within the
# call's deadline; what it writes goes to a scratch folder, never to docs/results/. The
# environment is built once (rm -rf .venv-rehearsal builds it again).
REHEARSAL     ?= .venv-rehearsal
REHEARSAL_PY  ?= python3.12
REHEARSAL_PKGS ?= torch==2.11.0 timm scipy pandas matplotlib pyarrow pytest setuptools
REHEARSAL_OUT ?= runs/rehearsal
.PHONY: gpu-rehearsal
$(REHEARSAL)/.installed:
	rm -rf $(REHEARSAL)
	$(REHEARSAL_PY) -m venv $(REHEARSAL)
	$(REHEARSAL)/bin/python -m pip install -q $(REHEARSAL_PKGS)
	touch $@

gpu-rehearsal: $(REHEARSAL)/.installed ## the one GPU call (scripts/gpu-results.sh) at smoke size on the CPU, Python 3.12 + torch 2.11 + .whl/ only
	@ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu-rehearsal: no wheels in .whl/ (docs/results/study.md)" >&2; exit 2; }
	rm -rf $(REHEARSAL_OUT) .whl/site
	mkdir -p $(REHEARSAL_OUT)
	PY=$(abspath $(REHEARSAL))/bin/python OUT=$(abspath $(REHEARSAL_OUT))/out OMP_NUM_THREADS=1 \
	  bash scripts/gpu-results.sh rehearsal -- --device cpu --profile smoke \
	  --parts tests,table,monet,papers --runs $(REHEARSAL_OUT)/runs \
	  --out $(REHEARSAL_OUT)/view --committed $(REHEARSAL_OUT)/committed $(ARGS)
	@echo "gpu-rehearsal: rows archived:" \
	  $$(tar tzf $(REHEARSAL_OUT)/out/study.tar.gz | grep -c summary.json)
