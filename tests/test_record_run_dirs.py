"""``fsdptrace record``'s run dir is settled before the job starts: a new one per launch, and a
taken one refused, replaced (``--force``) or added to (``--append``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from fsdptrace_cli.main import cli

from fsdptrace.store import run_dirs, schema
from fsdptrace.store.fatal_signals import DUMPS_DIR
from fsdptrace.store.journal_format import JOURNAL_DIR
from fsdptrace.store.run_mark import read_launch, write_mark

# The job writes where it was told to record, so a test sees what the job was given.
SAY_RUN_DIR = ("import os, pathlib; d = pathlib.Path(os.environ['FSDPTRACE_RUN_DIR']); "
               "(d.parent / 'job-saw.txt').write_text(str(d) + ' ' + str(sorted(os.listdir(d))))")


def record(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["record", *map(str, args), "--", sys.executable, "-c",
                                    SAY_RUN_DIR], catch_exceptions=False)


def old_recording(run_dir: Path) -> None:
    (run_dir / "meta" / "rank=0").mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine\n")


def test_recording_entries_are_the_tables_and_the_journal() -> None:
    assert set(run_dirs.RECORDING_ENTRIES) == {*schema.TABLES, JOURNAL_DIR, DUMPS_DIR}


def test_a_taken_run_dir_is_refused_before_the_job_starts(tmp_path: Path) -> None:
    old_recording(tmp_path / "a")
    result = record("--run-dir", tmp_path / "a")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"fsdptrace: error: {tmp_path / 'a'} already holds a recording: give a new "
        "--run-dir, or --force to replace it, or --append to record this launch beside it"]
    assert not (tmp_path / "job-saw.txt").exists()


def test_force_removes_the_old_recording_first(tmp_path: Path) -> None:
    old_recording(tmp_path / "a")
    (tmp_path / "a" / "launch-001").mkdir()
    result = record("--run-dir", tmp_path / "a", "--force")
    assert "nothing was recorded" in result.stderr
    assert (tmp_path / "job-saw.txt").read_text() == f"{tmp_path / 'a'} ['notes.txt']"


def test_append_records_each_launch_apart(tmp_path: Path) -> None:
    old_recording(tmp_path / "a")
    for index in (1, 2):
        (tmp_path / "a" / f"launch-{index:03d}" / "meta").mkdir(parents=True)
        record("--run-dir", tmp_path / "a", "--append")
    saw = (tmp_path / "a" / "job-saw.txt").read_text()
    assert saw == f"{tmp_path / 'a' / 'launch-003'} []"
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["job-saw.txt", "launch-001", "launch-002", "meta", "notes.txt"]


def test_append_into_nothing_starts_at_launch_one(tmp_path: Path) -> None:
    record("--run-dir", tmp_path / "a", "--append")
    assert (tmp_path / "a" / "job-saw.txt").read_text() == f"{tmp_path / 'a' / 'launch-001'} []"


@pytest.mark.parametrize("flags", [("--force", "--append"), ("--force",), ("--append",)])
def test_force_and_append_need_a_run_dir_of_their_own(tmp_path: Path, flags) -> None:
    extra = ("--run-dir", str(tmp_path / "a")) if len(flags) == 2 else ()
    result = record(*extra, *flags)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "job-saw.txt").exists()


def test_default_run_dirs_are_new_each_launch(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = {run_dirs.prepare_run_dir(None) for _ in range(20)}
    assert len(made) == 20
    assert all(p.parent == Path(run_dirs.DEFAULT_RUNS_ROOT) and p.is_dir() for p in made)


def test_nothing_recorded_leaves_no_empty_run_dir(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["record", "--", sys.executable, "-c", "pass"])
    assert result.exit_code == 0 and "nothing was recorded" in result.stderr
    assert list((tmp_path / run_dirs.DEFAULT_RUNS_ROOT).iterdir()) == []


def test_analyze_names_the_launches_of_an_appended_run_dir(tmp_path: Path) -> None:
    for index in (1, 2):
        (tmp_path / "a" / f"launch-{index:03d}" / "meta").mkdir(parents=True)
    result = CliRunner().invoke(cli, ["analyze", str(tmp_path / "a")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"fsdptrace: error: {tmp_path / 'a'} holds 2 launches recorded with --append "
        f"(launch-001, launch-002): analyze one of them, e.g. {tmp_path / 'a' / 'launch-002'}")


def test_a_run_dir_that_existed_is_kept_when_nothing_was_recorded(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    result = CliRunner().invoke(cli, ["record", "--run-dir", str(tmp_path / "mine"), "--",
                                      sys.executable, "-c", "pass"])
    assert result.exit_code == 0 and "nothing was recorded" in result.stderr
    assert (tmp_path / "mine").is_dir()


def _project(path: Path) -> dict[Path, str]:
    """A project folder whose names collide with a recording's (not a recording at all)."""
    files = {path / "settings" / "prod.yaml": "lr: 3e-4\n", path / "events" / "2024.ics": "X\n",
             path / "meta": "notes\n", path / "train.py": "print()\n"}
    for file, text in files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    return files


def _refused(result: Result, tmp_path: Path) -> str:
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert not (tmp_path / "job-saw.txt").exists()
    return line


@pytest.mark.parametrize("flags", [(), ("--force",)])
def test_a_project_folder_is_refused_and_keeps_every_file(tmp_path: Path, flags) -> None:
    """Names alone made a project folder "hold a recording", and --force deleted its
    settings/prod.yaml, events/2024.ics and meta. Now what the recorder did not write is
    refused, before anything is removed."""
    files = _project(tmp_path / "p")
    line = _refused(record("--run-dir", tmp_path / "p", *flags), tmp_path)
    assert line == (f"fsdptrace: error: {tmp_path / 'p'} holds meta and 2 more, which "
                    "fsdptrace did not write: give a --run-dir of its own (nothing was removed)")
    assert {f: f.read_text() for f in files} == files


# --append touches only launch folders: a symlinked top-level journal is no concern of it.
@pytest.mark.parametrize(("entry", "flags"), [("journal", ("--force",)),
                                              ("launch-002", ("--force",)),
                                              ("launch-002", ("--append",))])
def test_a_symlinked_entry_is_refused_and_not_followed(tmp_path: Path, entry: str,
                                                       flags) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "rank=0").mkdir(parents=True)
    (elsewhere / "rank=0" / "events-j1_000000001-000001.seg").write_bytes(b"keep")
    old_recording(tmp_path / "a")
    (tmp_path / "a" / entry).symlink_to(elsewhere)
    line = _refused(record("--run-dir", tmp_path / "a", *flags), tmp_path)
    assert line == (f"fsdptrace: error: {tmp_path / 'a'} holds {entry} (a symlink), which "
                    "fsdptrace did not write: give a --run-dir of its own (nothing was removed)")
    assert (elsewhere / "rank=0" / "events-j1_000000001-000001.seg").read_bytes() == b"keep"
    assert (tmp_path / "a" / "meta" / "rank=0").is_dir()


def test_a_dangling_symlink_run_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "gone")
    line = _refused(record("--run-dir", tmp_path / "a", "--force"), tmp_path)
    assert line == (f"fsdptrace: error: {tmp_path / 'a'} is a symlink to {tmp_path / 'gone'}, "
                    "which does not exist: create that directory or give another --run-dir")


def test_a_user_file_inside_a_table_is_refused(tmp_path: Path) -> None:
    old_recording(tmp_path / "a")
    (tmp_path / "a" / "meta" / "rank=0" / "mine.txt").write_text("mine\n")
    line = _refused(record("--run-dir", tmp_path / "a", "--force"), tmp_path)
    assert "holds meta/rank=0/mine.txt, which fsdptrace did not write" in line
    assert (tmp_path / "a" / "meta" / "rank=0" / "mine.txt").exists()


def test_force_removes_an_unmarked_old_recording_by_its_shape(tmp_path: Path) -> None:
    """A recording from before the mark is recognized by its shape (rank partitions of part
    files, journal segments) and replaced; files beside it stay."""
    run_dir = tmp_path / "a"
    for path in (run_dir / "meta" / "rank=0" / "part-w1-000001.parquet",
                 run_dir / "events" / "rank=1" / ".part-j1_000000001-000001-000002.parquet.tmp",
                 run_dir / "journal" / "rank=0" / "events-j1_000000001-000003.seg"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    (run_dir / "notes.txt").write_text("mine\n")
    assert not run_dirs.foreign_entries(run_dir)
    record("--run-dir", run_dir, "--force")
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_force_removes_a_marked_recording_and_its_mark(tmp_path: Path) -> None:
    run_dir = tmp_path / "a"
    old_recording(run_dir)
    write_mark(run_dir, "20260101000000-abc", replace=False)
    assert read_launch(run_dir) == "20260101000000-abc"
    record("--run-dir", run_dir, "--force")
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
