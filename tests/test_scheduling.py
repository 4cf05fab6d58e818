"""The suite's scheduler (``tests/scheduling.py``) driven as xdist drives it, with stand-in
workers that only record what they are sent: which files each worker gets first."""

from __future__ import annotations

from types import SimpleNamespace

from tests.scheduling import FilesThenCases

COLLECTION = [
    "tests/test_cli.py::test_a", "tests/test_cli.py::test_b", "tests/test_cli.py::test_c",
    "tests/test_watch_jobs.py::test_a", "tests/test_watch_jobs.py::test_b",
    "tests/test_watch_jobs.py::test_c",
    "tests/test_kill_loop.py::test_a", "tests/test_kill_loop.py::test_b",
    "tests/test_kill_loop.py::test_c",
    "tests/test_verdict_jobs.py::test_a", "tests/test_verdict_jobs.py::test_b",
    "tests/test_verdict_jobs.py::test_c",
    "tests/test_hostile_corpus.py::test_case[a]", "tests/test_hostile_corpus.py::test_case[b]",
    "tests/test_one.py::test_alone",
]


class Worker:
    def __init__(self, number: int) -> None:
        self.gateway = SimpleNamespace(id=f"gw{number}")
        self.shutting_down = False
        self.sent: list[str] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(COLLECTION[i] for i in indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduled(num_workers: int) -> tuple[FilesThenCases, list[Worker]]:
    """The scheduler after xdist's initial distribution (``-n N --dist loadfile``)."""
    config = SimpleNamespace(getvalue={"tx": [f"{num_workers}*popen"]}.__getitem__,
                             option=SimpleNamespace(loadscopereorder=True))
    scheduler = FilesThenCases(config)  # type: ignore[arg-type]
    workers = [Worker(n) for n in range(num_workers)]
    for worker in workers:
        scheduler.add_node(worker)  # type: ignore[arg-type]
        scheduler.add_node_collection(worker, COLLECTION)  # type: ignore[arg-type]
    scheduler.schedule()
    return scheduler, workers


def _files_per_worker(num_workers: int) -> dict[str, list[str]]:
    """Each worker's files in the order it got them, the workers finishing one test each in
    turn (a finished test is what makes xdist hand a worker more)."""
    scheduler, workers = _scheduled(num_workers)
    done = dict.fromkeys(map(id, workers), 0)
    while any(done[id(w)] < len(w.sent) for w in workers):
        for worker in workers:
            if done[id(worker)] < len(worker.sent):
                nodeid = worker.sent[done[id(worker)]]
                done[id(worker)] += 1
                scheduler.mark_test_complete(worker, COLLECTION.index(nodeid))  # type: ignore
    assert sorted(t for w in workers for t in w.sent) == sorted(COLLECTION)  # each test once
    return {w.gateway.id: list(dict.fromkeys(t.split("::")[0].split("/")[-1] for t in w.sent))
            for w in workers}


def test_the_last_of_three_workers_takes_the_waiting_files_first() -> None:
    """The other two take a long file of few tests first (``LONG``: kill_loop), then the other
    files; a file of one test goes out with the files, before any case (it used to tie with
    the cases and come out last)."""
    assert _files_per_worker(3) == {
        "gw0": ["test_kill_loop.py", "test_one.py", "test_hostile_corpus.py"],
        "gw1": ["test_cli.py", "test_hostile_corpus.py"],
        "gw2": ["test_watch_jobs.py", "test_verdict_jobs.py"]}


def test_two_workers_take_files_in_xdist_order_then_the_cases() -> None:
    assert _files_per_worker(2) == {
        "gw0": ["test_cli.py", "test_kill_loop.py", "test_one.py", "test_hostile_corpus.py"],
        "gw1": ["test_watch_jobs.py", "test_verdict_jobs.py", "test_hostile_corpus.py"]}


def test_of_four_workers_the_last_is_the_lane() -> None:
    files = _files_per_worker(4)
    assert files["gw3"][0] == "test_watch_jobs.py"
