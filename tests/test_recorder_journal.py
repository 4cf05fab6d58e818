"""The journal loses no row and reads back whole, whatever state a rank left it in.

Schema 1 dropped rows when its writer lagged and marked them (``dropped_rows``); schema 2 has
nothing to drop: a row is in a memory-mapped file once appended. So the ground truth is the
row's ``seq``: every seq appended is read back exactly once, through Parquet parts, journal
segments, or both, after an interrupted conversion, deletion or compaction, and with torn or
garbage bytes in the journal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fsdptrace.errors import SkippedChunkWarning, UnreadableChunkError
from fsdptrace.reading import chunk_gaps
from fsdptrace.reading.reader import part_files, read_rank
from fsdptrace.record.part_writer import PartWriter
from fsdptrace.record.writer import ChunkWriter
from fsdptrace.store import journal_hot, journal_read, schema
from fsdptrace.store.journal_format import HEADER, SEGMENT_NAME
from fsdptrace.store.journal_read import read_segment

UNITS = ["<root>", "layers.0", "layers.1"]
SMALL = (4096, 8192)  # segments of a few dozen rows: many conversions in a short test


def _writer(run_dir: Path) -> ChunkWriter:
    writer = ChunkWriter(run_dir, rank=0, version="test", writer_id="j1_000000001",
                         flush_interval_s=0.01, segment_bytes=SMALL)
    writer.buffer("meta").append((1, "host", 1, "fsdp2", "t", "test", 2, 0, 0, 1, "", False))
    return writer


def _append_events(writer: ChunkWriter, first: int, last: int) -> None:
    events = writer.buffer("events", {"phase": schema.PHASES, "unit": UNITS})
    markers = writer.buffer("markers")
    for seq in range(first, last + 1):
        events.append((seq, seq * 10, seq // 100, 0, seq % 2, seq % 3))
        if seq % 50 == 0:
            markers.append((seq, seq, seq // 100, 0, "micro_step_begin", 0, ""))


def _seqs(run_dir: Path, table: str = "events") -> list[int]:
    return sorted(read_rank(run_dir, table, 0).column("seq").to_pylist())


@pytest.fixture
def cold_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments mapped in the run dir itself: what a salvaged or hot-less journal looks like."""
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, "off")


@pytest.mark.parametrize("hot", [True, False], ids=["hot", "cold"])
def test_every_row_reads_back_once_running_and_closed(tmp_path: Path, hot: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if not hot:
        monkeypatch.setenv(journal_hot.HOT_DIR_ENV, "off")
    writer = _writer(tmp_path)
    assert (writer.segment_dir != writer.journal_dir) is hot
    writer.start()
    _append_events(writer, 1, 2000)
    writer.request_flush()
    assert _seqs(tmp_path) == list(range(1, 2001))  # parts and journal tail together
    assert writer.close(10.0)
    assert _seqs(tmp_path) == list(range(1, 2001))
    (part,) = part_files(tmp_path / "events" / "rank=0")  # compacted to one, the empty gone
    assert re.fullmatch(r"part-j1_000000001-000001-\d{6}\.parquet", part.name)
    assert not list((tmp_path / "journal" / "rank=0").iterdir())
    assert not writer.segment_dir.exists() or not hot  # the writer removed its hot folder
    for table in schema.TABLES:  # every table exists, empty or not
        assert len(list((tmp_path / table / "rank=0").glob("part-*.parquet"))) == 1


@pytest.mark.usefixtures("cold_journal")
def test_interrupted_deletion_and_compaction_count_once(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    writer.start()
    _append_events(writer, 1, 1500)
    writer.request_flush()
    writer.close(10.0)
    saved = tmp_path.parent / "saved"
    # Replay the states a kill leaves: segments still there after their part was renamed in,
    # and parts still there after the compacted part that covers them.
    second = ChunkWriter(tmp_path / "again", rank=0, version="test", writer_id="j1_000000001",
                         segment_bytes=SMALL)
    _append_events(second, 1, 1500)
    for table in second.tables.values():
        table.seal()
    shutil.copytree(tmp_path / "again" / "journal", saved)
    # The writer process's steps, run here one at a time.
    process = PartWriter(tmp_path / "again", rank=0, version="test", writer_id="j1_000000001")
    process.write_empty_tables()
    process.convert(final=False)  # the segments that filled, then the last: two parts
    process.convert(final=True)
    parts = sorted((tmp_path / "again" / "events" / "rank=0").glob("part-*"))
    assert [p.name.split("-")[2] for p in parts] == ["000000", "000001", parts[2].name.split(
        "-")[2]] and parts[2].name.split("-")[2] != "000001"  # the empty one, then two
    shutil.copytree(saved, tmp_path / "again" / "journal", dirs_exist_ok=True)
    assert _seqs(tmp_path / "again") == list(range(1, 1501))
    kept = tmp_path.parent / "kept"
    shutil.copytree(tmp_path / "again" / "events", kept)
    process.compact()  # the empty part deleted, the two merged
    assert len(list((tmp_path / "again" / "events" / "rank=0").glob("part-*"))) == 1
    shutil.copytree(kept, tmp_path / "again" / "events", dirs_exist_ok=True)
    assert len(list((tmp_path / "again" / "events" / "rank=0").glob("part-*"))) == 4
    assert _seqs(tmp_path / "again") == list(range(1, 1501))


@pytest.mark.usefixtures("cold_journal")
def test_torn_slots_are_skipped_and_garbage_is_named(tmp_path: Path) -> None:
    writer = _writer(tmp_path)  # never started: everything stays in the journal
    _append_events(writer, 1, 30)
    (segment,) = (tmp_path / "journal" / "rank=0").glob("events-*.seg")
    data = bytearray(segment.read_bytes())
    _, _, slot, first, _ = HEADER.unpack_from(data)
    offset = first + 29 * slot  # the last slot's seq
    data[offset] = 99  # as if the process died between the seq and the trailer
    segment.write_bytes(bytes(data))
    assert _seqs(tmp_path) == list(range(1, 30))
    (framed,) = (tmp_path / "journal" / "rank=0").glob("meta-*.seg")
    first = HEADER.unpack_from(framed.read_bytes())[3]
    framed.write_bytes(framed.read_bytes()[:first + 20])  # cut inside the record: no row
    assert read_rank(tmp_path, "meta", 0).num_rows == 0
    # Garbage is named and skipped, as an unreadable Parquet part is (issue 30): the rest of
    # the rank stays readable.
    chunk_gaps.reset()
    segment.write_bytes(b"FSDPJNL2" + b"\xff" * 40)
    with pytest.warns(SkippedChunkWarning, match=segment.name):
        assert read_rank(tmp_path, "events", 0).num_rows == 0
    chunk_gaps.reset()
    segment.write_bytes(b"junk")
    with pytest.warns(SkippedChunkWarning, match=segment.name):
        assert read_rank(tmp_path, "events", 0).num_rows == 0
    with pytest.raises(UnreadableChunkError, match=segment.name):
        read_segment(segment, "events")


@pytest.mark.usefixtures("cold_journal")
def test_abandon_writes_and_deletes_nothing(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    _append_events(writer, 1, 10)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    writer.abandon()
    _append_events(writer, 11, 500)
    assert writer.sync(1.0)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert _seqs(tmp_path) == list(range(1, 11))
    for path in tmp_path.rglob("*.parquet"):
        pq.read_table(path)


def test_close_returns_in_time_when_the_filesystem_blocks(tmp_path: Path) -> None:
    """A writer process stuck in a filesystem call (here: opening a FIFO nobody reads) holds
    nothing the caller waits on: ``close`` returns at its timeout and the rows stay readable."""
    partition = tmp_path / "meta" / "rank=0"
    partition.mkdir(parents=True)
    stuck = partition / ".part-j1_000000001-000000-000000.parquet.tmp"
    os.mkfifo(stuck)
    writer = _writer(tmp_path)
    writer.start()
    _append_events(writer, 1, 500)
    started = time.monotonic()
    assert writer.close(0.5) is False
    assert time.monotonic() - started < 2.0
    assert _seqs(tmp_path) == list(range(1, 501))
    assert writer._process is not None
    writer._process.kill()  # it would wait for a FIFO reader forever


def test_the_writer_mirrors_the_hot_tail_into_the_run_dir(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader on another host sees only the run dir: a rank that is still writing (hung)
    has its open segments copied there within a flush interval, pass after pass. (Each pass
    used to start where the last one's copy ended, a page of zeros past the rows: the rows
    written into that page were never copied, and the run dir alone held 40 of 120 rows.)"""
    writer = _writer(tmp_path)
    assert writer.segment_dir != writer.journal_dir
    writer.start()
    with monkeypatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")  # the reader cannot see the hot folder
        for last in (40, 80, 120):  # fewer than a segment: nothing converted yet
            _append_events(writer, last - 39, last)
            deadline = time.monotonic() + 10
            while _seqs(tmp_path) != list(range(1, last + 1)) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _seqs(tmp_path) == list(range(1, last + 1))
    assert writer.close(10.0)
    assert _seqs(tmp_path) == list(range(1, 121))


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from fsdptrace.store import schema
from fsdptrace.record.part_writer import PartWriter
from fsdptrace.record.writer import ChunkWriter
writer = ChunkWriter(Path(sys.argv[1]), rank=0, version="test", writer_id="j1_000000002",
                     flush_interval_s=3600, segment_bytes=(4096, 8192))
writer.start()
events = writer.buffer("events", {"phase": schema.PHASES, "unit": ["<root>"]})
for seq in range(1, 301):
    events.append((seq, seq, 0, 0, 0, 0))
print(writer.segment_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_writer_process_writes_a_killed_process_tail_as_parquet(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """SIGKILL: no thread of the process runs again; its writer process, told by the process's
    end, turns the hot segments into Parquet that plain readers see."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    hot = Path(done.stdout.strip())
    assert journal_hot.wait_salvaged(tmp_path / "journal" / "rank=0", 10.0)
    assert not hot.exists()
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, "off")  # read the run dir only
    assert _seqs(tmp_path) == list(range(1, 301))
    assert not list((tmp_path / "journal" / "rank=0").iterdir())  # all in Parquet
    plain = pq.read_table(tmp_path / "events" / "rank=0")
    assert sorted(plain.column("seq").to_pylist()) == list(range(1, 301))


_DEAD_RECORDING = """
import os, signal, sys
from pathlib import Path
from fsdptrace.store import schema
from fsdptrace.record.writer import ChunkWriter
writer = ChunkWriter(Path(sys.argv[1]), rank=0, version="test", writer_id="j1_000000003",
                     segment_bytes=(4096, 8192))
writer.buffer("meta").append((1, "host", os.getpid(), "fsdp2", "t", "test", 2, 0, 0, 1, "",
                              False))
events = writer.buffer("events", {"phase": schema.PHASES, "unit": ["<root>"]})
for seq in range(1, 301):
    events.append((seq, seq, 0, 0, 0, 0))
print(writer.segment_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no writer process was started: nothing converts
"""


@pytest.fixture
def hot_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hot root of this test's own: a sweep must not settle other jobs' folders."""
    (tmp_path / "hot").mkdir()
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, str(tmp_path / "hot"))
    return tmp_path / "hot"


def _dead_recording(run_dir: Path) -> Path:
    """The hot folder a process left when it was SIGKILLed together with its writer."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEAD_RECORDING, str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    folder = Path(done.stdout.strip())
    assert len(journal_hot.segment_files(folder)) >= 2
    return folder


@pytest.mark.usefixtures("hot_root")
def test_a_sweep_converts_a_dead_recordings_folder_into_its_run_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdptrace.record.hot_sweep import sweep

    run_dir = tmp_path / "run"
    folder = _dead_recording(run_dir)
    assert _seqs(run_dir) == list(range(1, 301))  # on this host, through the hot folder
    assert sweep() == [folder]
    assert not folder.exists()
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, "off")  # the run dir alone
    assert _seqs(run_dir) == list(range(1, 301))
    assert not list((run_dir / "journal" / "rank=0").iterdir())  # all in Parquet


@pytest.mark.usefixtures("hot_root")
def test_a_new_recording_never_reads_an_old_ones_segments(tmp_path: Path) -> None:
    """Killed with its writer, a recording's segments stayed in the hot folder; ``rm -rf``
    and a new recording into the same path: a new launch, a new folder, only its own rows
    (no "recorded by several processes"). A sweep then drops the old folder unread."""
    from fsdptrace.record.hot_sweep import sweep

    run_dir = tmp_path / "run"
    old = _dead_recording(run_dir)
    shutil.rmtree(run_dir)
    writer = _writer(run_dir)
    assert writer.segment_dir != old
    _append_events(writer, 1, 10)
    assert _seqs(run_dir) == list(range(1, 11))
    assert read_rank(run_dir, "meta", 0).num_rows == 1
    assert sweep() == [old]  # this one is alive: its lock is held
    assert writer.segment_dir.exists() and not old.exists()
    assert _seqs(run_dir) == list(range(1, 11))


@pytest.mark.usefixtures("hot_root")
def test_segments_say_which_recording_they_belong_to(tmp_path: Path) -> None:
    import json

    from fsdptrace.record.journal import RECORDING_KEY
    from fsdptrace.store.run_mark import read_launch

    writer = _writer(tmp_path)
    _append_events(writer, 1, 10)
    for segment in journal_hot.segment_files(writer.segment_dir):
        data = segment.read_bytes()
        vocab_len = HEADER.unpack_from(data)[4]
        vocab = json.loads(data[HEADER.size:HEADER.size + vocab_len])
        launch, writer_id, pid, start_ns = vocab[RECORDING_KEY]
        assert (launch, writer_id, pid) == (read_launch(tmp_path), "j1_000000001",
                                            str(os.getpid()))
        assert int(start_ns) > 0


@pytest.mark.parametrize("restarts", [1, 0], ids=["restarted", "none-can-start"])
def test_a_dead_writer_is_noticed_and_nothing_stays_in_the_hot_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restarts: int) -> None:
    """The writer process SIGKILLed (the OOM killer's pick): the next flush request notices
    (a notice the recorder turns into a ``writer_lost`` marker) and starts a new one, which
    converts what the dead one left; when none may start, ``close`` moves the segments into
    the run dir's journal itself. Either way the run dir alone holds every row."""
    import signal

    notices: list[tuple[str, str]] = []
    writer = ChunkWriter(tmp_path, rank=0, version="test", writer_id="j1_000000001",
                         flush_interval_s=0.05, segment_bytes=SMALL, max_restarts=restarts,
                         on_notice=lambda kind, detail: notices.append((kind, detail)))
    writer.start()
    _append_events(writer, 1, 500)
    assert writer._process is not None
    dead = writer._process.pid
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not writer._status.exited and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match=f"writer process {dead} was killed by SIGKILL"):
        writer.request_flush()
    _append_events(writer, 501, 1000)
    assert writer.close(30.0) is bool(restarts)
    [(kind, detail)] = notices
    assert kind == schema.MARKER_WRITER_LOST
    if restarts:
        assert detail == f"writer process {dead} was killed by SIGKILL; restarted as " \
                         f"{writer._process.pid}"
    else:
        assert detail == (f"writer process {dead} was killed by SIGKILL; not restarted "
                          "(restarted 0 times already)")
    assert not writer.segment_dir.exists()
    monkeypatch.setenv(journal_hot.HOT_DIR_ENV, "off")  # the run dir alone
    assert _seqs(tmp_path) == list(range(1, 1001))


def _loss_marks(run_dir: Path, writer_id: str) -> list[dict[str, object]]:
    """The details of the markers saying where the run dir's copy of ``writer_id`` ends."""
    from fsdptrace.store.journal_format import LOSS_WRITER, SEGMENT_FILE
    path = (run_dir / "journal" / "rank=0" /
            SEGMENT_FILE.format(table="markers", writer=LOSS_WRITER.format(writer=writer_id),
                                index=1))
    if not path.exists():
        return []
    return [json.loads(d) for d in read_segment(path, "markers").column("detail").to_pylist()]


def test_a_pass_cut_short_after_a_quiet_one_leaves_its_tail_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that finds every row copied removes the mark (a hung rank's stopped pass must
    read whole elsewhere). The next pass with rows to copy says where that whole copy ended
    before it copies any: killed mid-pass, its writer leaves tables copied moments apart, and
    without that mark the run dir alone read as a rank that ran units without their rows
    (CI: ``test_a_job_killed_mid_training_with_its_writers_reads_incomplete_not_wrong``)."""
    run_dir, writer_id = tmp_path / "run", "j1_000000003"
    recorder = ChunkWriter(run_dir, rank=0, version="test", writer_id=writer_id,
                           segment_bytes=(1 << 16, 1 << 16))
    assert recorder.segment_dir != recorder.journal_dir
    _append_events(recorder, 1, 40)
    process = PartWriter(run_dir, rank=0, version="test", writer_id=writer_id,
                         segment_dir=recorder.segment_dir)
    process.write_empty_tables()

    def killed() -> bool:
        raise SystemExit("the writer is killed mid-pass")

    with monkeypatch.context() as cut:  # killed in its first pass: every row may be missing
        cut.setattr(process, "mirror", killed)
        with pytest.raises(SystemExit):
            process.flush()
    assert {(m["first_step"], m["first_micro_step"]) for m in _loss_marks(run_dir, writer_id)
            } == {(0, 0)}
    process.flush()  # copies all 40 rows: nothing is said missing
    assert _loss_marks(run_dir, writer_id) == []
    process.flush()  # a hung rank: nothing new, nothing said
    assert _loss_marks(run_dir, writer_id) == []
    _append_events(recorder, 41, 250)  # the rank goes on into step 2
    monkeypatch.setattr(process, "mirror", killed)
    with pytest.raises(SystemExit):
        process.flush()
    marks = _loss_marks(run_dir, writer_id)
    assert {(m["first_step"], m["first_micro_step"]) for m in marks} == {(0, 0)}
    assert {m["table"] for m in marks} == set(schema.TABLES)
    monkeypatch.undo()
    process.flush()  # the next pass copies everything, finds nothing more, forgets the mark
    assert _loss_marks(run_dir, writer_id) == []
    # An optimizer boundary converts filled segments between passes: rows land then too, so
    # it says first where the whole copy ended (CI: a boundary's part put a table 5 steps
    # ahead of the others, with no mark).
    _append_events(recorder, 251, 300)
    process.convert_filled()
    assert {(m["first_step"], m["first_micro_step"]) for m in _loss_marks(run_dir, writer_id)
            } == {(2, 0)}
    with monkeypatch.context() as remote:
        remote.setenv(journal_hot.HOT_DIR_ENV, "off")
        assert _seqs(run_dir)[:250] == list(range(1, 251))
    for table in recorder.tables.values():
        table.seal()
    shutil.rmtree(recorder.segment_dir, ignore_errors=True)


def test_a_record_copied_while_it_was_written_is_copied_again_whole(tmp_path: Path) -> None:
    """A framed record is written leading frame last and may span pages (the gradients of a
    whole backward). A pass that copied it mid-write copied a zero frame; the next pass must
    copy again from that record's start, not from a page below the end, or the run dir
    alone never reads it nor any later row of the segment."""
    run_dir, writer_id = tmp_path / "run", "j1_000000004"
    recorder = ChunkWriter(run_dir, rank=0, version="test", writer_id=writer_id,
                           segment_bytes=(1 << 16, 1 << 16))
    markers = recorder.buffer("markers")
    markers.append((1, 1, 0, 0, "micro_step_begin", 0, ""))
    process = PartWriter(run_dir, rank=0, version="test", writer_id=writer_id,
                         segment_dir=recorder.segment_dir)
    process.mirror()
    [hot] = [p for p in recorder.segment_dir.iterdir() if p.name.startswith("markers-")]
    start = markers._pos
    markers.append((2, 2, 0, 0, "micro_step_begin", 0, "x" * 12000))  # three pages
    with open(hot, "rb") as segment:
        frame = os.pread(segment.fileno(), 4, start)
    fd = os.open(hot, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\0" * 4, start)  # as the recorder's write looks mid-way
        process.mirror()
        os.pwrite(fd, frame, start)  # the record completes
    finally:
        os.close(fd)
    assert process._anything_to_copy()
    process.mirror()
    cold = process._cold_segment("markers", int(SEGMENT_NAME.match(hot.name)["index"]))
    assert read_segment(cold, "markers").column("seq").to_pylist() == [1, 2]
    for table in recorder.tables.values():
        table.seal()
    shutil.rmtree(recorder.segment_dir, ignore_errors=True)


def test_the_writer_process_converts_without_pandas_or_pyarrow_compute(tmp_path: Path) -> None:
    """The writer process is one per rank: pandas, which pyarrow would import for it, costs each
    about 0.15 CPU-s and 40 MB it never uses, and ``pyarrow.compute`` (a cast, ``read_table``)
    40 ms of its start-up. Its mapped files say whether either was loaded."""
    writer = _writer(tmp_path)
    writer.start()
    _append_events(writer, 1, 500)
    writer.request_flush()
    events = tmp_path / "events" / "rank=0"
    deadline = time.monotonic() + 30
    while not (events.is_dir() and any(pq.read_metadata(p).num_rows for p in part_files(events))):
        assert time.monotonic() < deadline, "the writer wrote no part of events"
        time.sleep(0.05)
    process = writer._process
    assert process is not None and process.poll() is None
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    assert "pyarrow" in maps  # it converted
    assert "/pandas/" not in maps
    assert "pyarrow/_compute." not in maps and "pyarrow/_dataset." not in maps
    assert writer.close(10.0)
    assert _seqs(tmp_path) == list(range(1, 501))


def test_a_hot_folder_removed_while_listed_holds_no_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer removes its hot folder once every segment is in a part; a reader that found the
    folder a moment before must list nothing there, not fail (a CI run's analysis of a hang
    just after SIGTERM raised FileNotFoundError from here)."""
    folder = tmp_path / "hot"
    folder.mkdir()
    real_iterdir = Path.iterdir

    def removed_meanwhile(path: Path):  # the folder existed when looked at, not when listed
        if path == folder:
            shutil.rmtree(folder)
        return real_iterdir(path)

    monkeypatch.setattr(Path, "iterdir", removed_meanwhile)
    assert journal_read.segments(folder, "events") == []
