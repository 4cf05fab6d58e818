"""``analyze`` on a Dask distributed cluster: the same map per rank, the same reduce.

Runs of thousands of ranks outgrow one machine's cores; the map step is already one function
of (run dir, ranks), so a cluster only has to call it per piece of ranks. The run dir must be
readable at the same path on every worker (a shared filesystem). The workers return
``RankSummary`` objects of small DataFrames, which Dask moves between processes itself; the
client does the reduce and re-reads just the few orders it must spell out, as the local
analyzer does.

Dask is an optional extra: ``pip install 'fsdptrace[dask]'``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdptrace.analysis import map_step
from fsdptrace.errors import FsdptraceError
from fsdptrace.reading import chunk_gaps, reader
from fsdptrace.store.env import CONNECT_TIMEOUT_ENV

# How long to wait for a scheduler to answer: ``FSDPTRACE_DASK_CONNECT_TIMEOUT`` (seconds).
DEFAULT_CONNECT_TIMEOUT_S = 30.0

INSTALL_HINT = ("--scheduler needs Dask distributed, which is not installed: "
                "pip install 'fsdptrace[dask]'")


def _client(scheduler: Any) -> Any:
    """A client for ``scheduler`` (an address, or a ``distributed.Client`` to reuse)."""
    try:
        from distributed import Client
    except ImportError:
        raise FsdptraceError(INSTALL_HINT) from None
    if isinstance(scheduler, Client):
        return scheduler
    try:
        return Client(scheduler, timeout=f"{_connect_timeout_s()}s")
    except OSError as error:
        raise FsdptraceError(
            f"cannot reach the Dask scheduler at {scheduler} ({error}); is it running, and "
            "is the address tcp://HOST:PORT?") from None


def _connect_timeout_s() -> float:
    try:
        return max(0.1, float(os.environ.get(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_CONNECT_TIMEOUT_S


def map_distributed(run_dir: Path, ranks: list[int], names: list[str], scheduler: Any,
                    progress: Callable[[int, int], None] | None = None
                    ) -> list[map_step.RankSummary]:
    """The map step of ``fsdptrace.analyze(run_dir, scheduler=...)``, one task per rank.

    ``scheduler``: ``tcp://HOST:PORT`` of a running scheduler, or a ``distributed.Client``.
    The caller reduces the summaries exactly as it does those of local processes, so the
    findings are the same on every path.
    """
    path = Path(run_dir).resolve()  # workers resolve nothing: they get the absolute path
    client = _client(scheduler)
    own_client = client is not scheduler
    try:
        from distributed import as_completed

        pieces = map_step.rank_pieces(ranks, max(1, sum(client.nthreads().values())))
        highest = reader.highest_meta_rank(path)
        futures = [client.submit(map_step.map_ranks, path, piece, names, highest_rank=highest,
                                 pure=False) for piece in pieces]
        size = {future.key: len(piece) for future, piece in zip(futures, pieces, strict=True)}
        done = 0
        for future in as_completed(futures):
            future.result()  # raises the worker's error, naming the rank's file
            done += size[future.key]
            if progress:
                progress(done, len(ranks))
        summaries: list[map_step.RankSummary] = [s for future in futures
                                                 for s in future.result()]
        for summary in summaries:  # what the workers skipped is said here, once
            for chunk in summary.skipped:
                chunk_gaps.note(chunk)
    finally:
        if own_client:
            client.close()
    return summaries
