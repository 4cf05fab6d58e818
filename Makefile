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

# pip compiles every file it installs, one after another: 15,000 files, two thirds of a fresh
# set-up's 73 s. Installed without, they are compiled on every core at the end, but for trees
# nothing here imports (packages' own test suites, transformers' model zoo but its auto
# classes); a module of those imported after all is compiled then, as in any environment.
PIP := $(BIN)/pip install --quiet --no-compile
COMPILE_SKIP := /tests/|/transformers/models/(?!auto/|__init__)|/site-packages/(setuptools|debugpy)/
# As pip does, a file that does not compile on this Python is left (torch ships one for 3.12).
COMPILE_PACKAGES := $(BIN)/python -m compileall -q -j 0 -x '$(COMPILE_SKIP)' \
	$(VENV)/lib/python*/site-packages > /dev/null || true

.PHONY: setup demo test quick lint samples clean

$(BIN)/fsdptrace: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	if [ "$(LOCAL_TORCH)" = auto ] && $(BIN)/pip install --quiet --dry-run --no-index \
			--no-deps '$(TORCH_SPEC)' >/dev/null 2>&1; then \
		$(PIP) '$(TORCH_SPEC)'; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
		$(PIP) --index-url $(TORCH_INDEX) --extra-index-url $(PYPI_INDEX) '$(TORCH_SPEC)'; \
	else $(PIP) '$(TORCH_SPEC)'; fi
	$(PIP) -e '.[test,lint,trainers]'
	$(COMPILE_PACKAGES)
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

# The demo's first screen says what it shows: a FAIL that is the planted bug being found.
# `make demo DEMO_ARGS=--fixed` records the same job wired right: OK, no findings. record exits
# with the job's own status, so the demo's findings do not fail make.
DEMO_ARGS ?=

demo: setup
ifeq ($(DEMO_ARGS),)
	@echo "fsdptrace demo: examples/train_tiny.py trains 4 FSDP2 blocks on 2 CPU ranks with ONE"
	@echo "  PLANTED prefetch bug, line 45: layers[2].set_modules_to_forward_prefetch([layers[1]])"
	@echo "  prefetches a block that already ran. Expect FAIL, on units 3 -> 2 (layers[i] is unit"
	@echo "  i+1 of the nn.Sequential): that is fsdptrace finding the bug, not a broken set-up."
	@echo "  The same job wired right, clean (OK: no findings): make demo DEMO_ARGS=--fixed"
else
	@echo "fsdptrace demo: examples/train_tiny.py $(DEMO_ARGS) (no planted bug): expect OK"
endif
	@echo
	@rm -rf $(RUN_DIR)
	$(BIN)/fsdptrace record --run-dir $(RUN_DIR) -- \
		$(BIN)/torchrun --nproc-per-node 2 examples/train_tiny.py $(DEMO_ARGS)

# The whole suite (CI). Three workers on 2 cores: two take the CPU-bound files, and the third
# is a lane for the files that mostly wait on a job (watched hangs, sleeping ranks, a full
# disk), then the hostile corpus's cases (tests/scheduling.py). --dist loadfile keeps a file's
# tests on one worker, so a module's recordings are made once; the session's are shared between
# workers through tests/recordings.py (a file lock). TEST_WORKERS=0 runs it in one process.
# Measured one after another on 2 cores: two workers 595 s (CPUs 13 % idle), three with the
# lane 544 s (4 % idle); three without it were 568 s, and the timing tests flaked more.
TEST_WORKERS ?= 3
TEST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# With bytecode caches: a run starts about 1,000 Python processes (ranks, writer processes,
# command lines), and pytest rewrites every test module's asserts. Where the environment sets
# PYTHONDONTWRITEBYTECODE (this sandbox does, as many CI images do), each process compiled
# what it imported of fsdptrace and the tests again, and each collection rewrote the tests
# (collecting the suite: 8.4 CPU-s, 5.9 from the caches). compileall writes them up front.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
COMPILE := $(BIN)/python -m compileall -q fsdptrace cli tests examples benchmarks > /dev/null

test: setup
	$(COMPILE)
	$(PYTEST) -q --durations=20 $(TEST_ARGS)

# The developer loop: every test but those that start their own multi-process jobs (the
# `slow` marker, set by tests/conftest.py); the session's scenario recordings are one launch.
quick: setup
	$(COMPILE)
	$(PYTEST) -q -m "not slow" $(TEST_ARGS)

lint: setup
	$(BIN)/ruff check fsdptrace cli tests benchmarks examples
	$(BIN)/mypy

samples: setup
	$(BIN)/python examples/make_samples.py

clean:
	rm -rf $(VENV) fsdptrace_runs
