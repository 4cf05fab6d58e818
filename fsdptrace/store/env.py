"""Every environment variable fsdptrace reads or sets, by name, once.

The command line hands its settings to the training processes it starts through these
(``fsdptrace record`` sets them, ``attach()`` and the zero-code bootstrap read them), so writer
and readers must spell them alike. This module imports nothing: the bootstrap that every
recorded Python process runs at start-up, and the recorder's light modules, read it without
loading torch or pyarrow.
"""

from __future__ import annotations

# The run dir every process of a recorded job writes into; its presence switches zero-code
# recording on.
RUN_DIR_ENV = "FSDPTRACE_RUN_DIR"
# ``record --steps`` and ``record --raise``, as attach()'s defaults.
STEPS_ENV = "FSDPTRACE_STEPS"
RAISE_ENV = "FSDPTRACE_RAISE"
# The attach() arguments the command line settles: a script's own value for them is
# overridden (with one line saying so), so `record --raise` means what it says.
OVERRIDES_ENV = "FSDPTRACE_OVERRIDES"
# One id per `fsdptrace record` launch, written into the run dir's mark (``run_mark``).
LAUNCH_ENV = "FSDPTRACE_LAUNCH"
# Where the journal's hot segments live (``journal_hot``); ``off`` writes to the run dir.
HOT_DIR_ENV = "FSDPTRACE_HOT_DIR"
# Seconds ``analyze(scheduler=...)`` waits to reach a Dask scheduler (``distributed``).
CONNECT_TIMEOUT_ENV = "FSDPTRACE_DASK_CONNECT_TIMEOUT"

# The writer process does no numerical work: one thread for each library that would start a
# pool of its own while importing (numpy's OpenBLAS starts one spinning thread per core, which
# costs a writer more CPU than the rest of its start-up, on every rank of a big node).
SINGLE_THREADED_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                       "MKL_NUM_THREADS": "1"}

# Where a run dir goes when neither an argument nor RUN_DIR_ENV names one.
DEFAULT_RUNS_ROOT = "fsdptrace_runs"
