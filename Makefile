# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_DIR ?= fsdptrace_runs/demo

# torch first, pinned: on a normal index `torch==2.13.0` is the multi-GB CUDA build. Where pip
# already finds a torch wheel without any index (its configured find-links, as on machines that
# ship the CPU wheel), that one is used; otherwise torch comes from TORCH_INDEX, PyTorch's CPU
# wheels by default, with PyPI for its dependencies. Set TORCH_INDEX to choose another build
# (e.g. https://download.pytorch.org/whl/cu126), or TORCH_INDEX= with LOCAL_TORCH=no for PyPI's.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYPI_INDEX ?= https://pypi.org/simple
LOCAL_TORCH ?= auto

.PHONY: setup demo test lint samples clean

$(BIN)/fsdptrace: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	if [ "$(LOCAL_TORCH)" = auto ] && $(BIN)/pip install --quiet --dry-run --no-index \
			--no-deps '$(TORCH_SPEC)' >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet '$(TORCH_SPEC)'; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
		$(BIN)/pip install --quiet --index-url $(TORCH_INDEX) --extra-index-url $(PYPI_INDEX) \
			'$(TORCH_SPEC)'; \
	else $(BIN)/pip install --quiet '$(TORCH_SPEC)'; fi
	$(BIN)/pip install --quiet -e '.[test,lint]'
	touch $@

# The real HSDP framework (hyper_parallel) for tests/test_hsdp.py, from shared/ beside the repo;
# its tests are skipped without it. --no-deps: the wheel asks for numpy<2, with which pyarrow
# fails to import; hyper_parallel runs on numpy 2 (its tests do). pyyaml is in the test extra.
HSDP_WHEEL ?= ../shared/wheels/hyper_parallel-0.1.0-py3-none-any.whl

$(VENV)/.hyper_parallel: $(BIN)/fsdptrace $(wildcard $(HSDP_WHEEL))
	if [ -f $(HSDP_WHEEL) ]; then \
		$(BIN)/pip install --quiet --no-deps --force-reinstall $(HSDP_WHEEL) && touch $@; \
	else echo "$(HSDP_WHEEL) is absent: the HSDP tests will be skipped"; fi

setup: $(BIN)/fsdptrace $(VENV)/.hyper_parallel

demo: setup
	rm -rf $(RUN_DIR)
	$(BIN)/fsdptrace record --run-dir $(RUN_DIR) --fail-on never -- \
		$(BIN)/torchrun --nproc-per-node 2 examples/train_tiny.py

test: setup
	$(BIN)/python -m pytest -q --durations=20

lint: setup
	$(BIN)/ruff check fsdptrace cli tests benchmarks examples
	$(BIN)/mypy

samples: setup
	$(BIN)/python examples/make_samples.py

clean:
	rm -rf $(VENV) fsdptrace_runs
