# relayrl: two commands for a new user: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: the CPU wheel on this machine (an unpinned torch pulls CUDA).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/relayrl demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not ray and not multiproc and not multinode"

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/dock_flow.py
	$(BIN)/python benchmarks/grpo_vs_trl.py
	$(BIN)/python benchmarks/weight_relay.py
	$(BIN)/python benchmarks/data_parallel.py
	$(BIN)/python benchmarks/serve_load.py

clean:
	rm -rf $(VENV) runs .cache
