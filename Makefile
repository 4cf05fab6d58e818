# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= fsdptrace_runs/demo

.PHONY: setup demo test lint samples clean

$(BIN)/fsdptrace: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: its CPU build is on local disk; a newer one is a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,lint]'
	touch $@

setup: $(BIN)/fsdptrace

demo: setup
	rm -rf $(RUN_DIR)
	$(BIN)/fsdptrace record --run-dir $(RUN_DIR) --fail-on never -- \
		$(BIN)/torchrun --nproc-per-node 2 examples/train_tiny.py

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check fsdptrace cli tests benchmarks examples
	$(BIN)/mypy

samples: setup
	$(BIN)/python examples/make_samples.py

clean:
	rm -rf $(VENV) fsdptrace_runs
