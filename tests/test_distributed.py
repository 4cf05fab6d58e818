"""``analyze`` on a Dask cluster gives exactly the local findings, and fails clearly without Dask.

The cluster is a LocalCluster on loopback started by the test (threads, no extra processes),
reached through its ``tcp://`` address as a remote scheduler would be. The run dir is a
generated one in the recorder's format, with dead ranks whose rows span Parquet parts and
journal segments, so the workers fold journal tails in as the local reader does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

import fsdptrace
from tests.synthetic import TINY, generate_run, where

distributed = pytest.importorskip(
    "distributed", reason="Dask distributed not installed: pip install 'fsdptrace[dask]'")


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                       protocol="tcp", host="127.0.0.1", dashboard_address=None)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dask") / "run"
    generate_run.generate(path, TINY, segment_bytes=(4096, 8192))
    return path


def test_every_path_finds_the_planted_findings(run_dir: Path, scheduler: str) -> None:
    """One process, two processes, a Dask cluster: the same table, every planted finding,
    the dead ranks' stalls (read from their journal tails) included."""
    assert list((run_dir / "journal").glob("rank=*/events-*.seg"))
    serial = fsdptrace.analyze(run_dir, jobs=1).findings
    pd.testing.assert_frame_equal(serial, fsdptrace.analyze(run_dir, jobs=2).findings)
    pd.testing.assert_frame_equal(serial,
                                  fsdptrace.analyze(run_dir, scheduler=scheduler).findings)
    assert where(serial) == generate_run.read_expected(run_dir)


def test_cluster_findings_equal_local(run_dir: Path, scheduler: str) -> None:
    done: list[tuple[int, int]] = []
    remote = fsdptrace.analyze(run_dir, scheduler=scheduler,
                               progress=lambda *args: done.append(args))
    local = fsdptrace.analyze(run_dir)
    assert len(local.findings) > 10
    pd.testing.assert_frame_equal(remote.findings, local.findings)
    pd.testing.assert_frame_equal(remote.endings, local.endings)
    assert (remote.ranks, remote.world_size) == (local.ranks, local.world_size)
    num_ranks = len(fsdptrace.load(run_dir).ranks)
    # Progress moves as pieces of ranks finish, up to every rank.
    assert [n for n, _ in done] == sorted({n for n, _ in done}) and done[-1][0] == num_ranks
    assert {total for _, total in done} == {num_ranks}


def test_cluster_selected_checks(run_dir: Path, scheduler: str) -> None:
    remote = fsdptrace.analyze(run_dir, ["rank-divergence"], scheduler=scheduler)
    assert set(remote.findings["check"]) == {"rank-divergence"}


def test_cli_scheduler_option(run_dir: Path, scheduler: str) -> None:
    from fsdptrace_cli.main import cli

    remote = CliRunner().invoke(cli, ["analyze", str(run_dir), "--scheduler", scheduler])
    local = CliRunner().invoke(cli, ["analyze", str(run_dir), "--jobs", "1"])
    assert remote.exit_code == local.exit_code == 1, remote.output
    assert remote.output == local.output


def test_unreachable_scheduler_is_one_line(run_dir: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from fsdptrace.analysis.distributed import CONNECT_TIMEOUT_ENV

    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "2")  # nobody listens on port 1: fail fast

    with pytest.raises(fsdptrace.FsdptraceError, match="cannot reach the Dask scheduler"):
        fsdptrace.analyze(run_dir, scheduler="tcp://127.0.0.1:1")


def test_without_dask_says_how_to_install(run_dir: Path) -> None:
    # A fresh interpreter where importing distributed fails, as where it is not installed.
    code = ("import sys; sys.modules['distributed'] = None\n"
            "from fsdptrace_cli.main import main\n"
            f"sys.argv = ['fsdptrace', 'analyze', {str(run_dir)!r}, '--scheduler', 'tcp://x:1']\n"
            "main()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "pip install 'fsdptrace[dask]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
