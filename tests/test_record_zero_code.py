"""Zero-code recording (``fsdptrace record -- COMMAND``): real FSDP2 jobs that never call
``attach``, scripts that do, the bootstrap ``sitecustomize`` and the launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn as nn

from fsdptrace.record.launch import BOOTSTRAP_DIR, record_env, run_recorded
from fsdptrace.store.env import DEFAULT_RUNS_ROOT
from tests.jobs import REPO, kill_all

SCRIPTS = REPO / "tests" / "jobs_scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"
NUM_STEPS, NUM_MICRO_STEPS = 3, 2
LAYERS = ["layers.0", "layers.1", "layers.2"]
PART_FILE = re.compile(r"part-(?P<writer>[^-]+)-\d{6}-\d{6}\.parquet$")


# --------------------------------------------------------------------- reading a run dir
def read_writers(run_dir: Path, table: str, rank: int) -> dict[str, pa.Table]:
    """One table per recorder (writer id) that wrote ``TABLE/rank=N``."""
    files: dict[str, list[Path]] = {}
    for path in sorted((run_dir / table / f"rank={rank}").glob("part-*.parquet")):
        files.setdefault(PART_FILE.search(path.name)["writer"], []).append(path)
    tables = {w: pa.concat_tables([pq.read_table(p) for p in ps]) for w, ps in files.items()}
    return {w: t.sort_by("seq") if "seq" in t.column_names else t for w, t in tables.items()}


def read_one_writer(run_dir: Path, table: str, rank: int) -> pa.Table:
    writers = read_writers(run_dir, table, rank)
    assert len(writers) == 1, f"{table}/rank={rank} written by {sorted(writers)}"
    return next(iter(writers.values()))


def event_rows(events: pa.Table) -> list[tuple]:
    cols = [events.column(c).to_pylist() for c in ("step", "micro_step", "phase", "unit")]
    return list(zip(*cols, strict=True))


def expected_events(steps: range) -> list[tuple]:
    rows = []
    for step in steps:
        for micro in range(NUM_MICRO_STEPS):
            rows += [(step, micro, "forward", u) for u in ["<root>", *LAYERS]]
            rows += [(step, micro, "backward", u) for u in ["<root>", *LAYERS[::-1]]]
    return rows


def marker_kinds(markers: pa.Table, kind: str) -> list[tuple[int, int]]:
    rows = zip(
        markers.column("step").to_pylist(),
        markers.column("micro_step").to_pylist(),
        markers.column("kind").to_pylist(),
        strict=True,
    )
    return [(step, micro) for step, micro, k in rows if k == kind]


def assert_complete_recording(run_dir: Path, rank: int, world_size: int) -> None:
    meta = read_one_writer(run_dir, "meta", rank)
    assert meta.column("world_size").to_pylist() == [world_size]
    units = read_one_writer(run_dir, "units", rank)
    assert units.column("unit").to_pylist() == ["<root>", *LAYERS]
    assert event_rows(read_one_writer(run_dir, "events", rank)) == expected_events(range(NUM_STEPS))
    markers = read_one_writer(run_dir, "markers", rank)
    assert marker_kinds(markers, "optimizer_step") == [(s, 1) for s in range(NUM_STEPS)]
    assert marker_kinds(markers, "micro_step_begin") == [
        (s, m) for s in range(NUM_STEPS) for m in range(NUM_MICRO_STEPS)
    ]
    assert markers.column("kind").to_pylist()[-1] == "close"


# --------------------------------------------------------------------- the jobs
def _job_env(run_dir: Path) -> dict[str, str]:
    """A recorded single process, or torchrun: no rank variables inherited from a launcher."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in launcher}
    return record_env(run_dir, base_env={**base, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every job of this module, started at once (they are small and mostly wait)."""
    out = tmp_path_factory.mktemp("zero_code")
    jobs: dict[str, list[str]] = {
        "torchrun": [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "plain_train.py"),
        ],
        "single": [sys.executable, str(SCRIPTS / "plain_train.py")],
        "no-optimizer": [sys.executable, str(SCRIPTS / "attach_train.py"), "--no-optimizer"],
        "late": [sys.executable, str(SCRIPTS / "attach_train.py"), "--late"],
        "bad-steps": [sys.executable, str(SCRIPTS / "plain_train.py")],
    }
    envs = {name: _job_env(out / name) for name in jobs}
    envs["bad-steps"]["FSDPTRACE_STEPS"] = "bogus"  # record_env refuses it; a user may not
    procs = {
        name: subprocess.Popen(
            cmd,
            env=envs[name],
            cwd=out,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, cmd in jobs.items()
    }
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name], _ = proc.communicate(timeout=90)
    finally:
        kill_all(list(procs.values()))
    bad = [
        f"[{name} exited {p.returncode}]\n{outputs[name]}"
        for name, p in procs.items()
        if p.returncode != 0
    ]
    assert not bad, "\n".join(bad)
    (out / "bad-steps.log").write_text(outputs["bad-steps"])
    return out


@pytest.mark.slow
def test_torchrun_records_every_rank_of_a_plain_script(runs: Path) -> None:
    for rank in range(2):
        assert_complete_recording(runs / "torchrun", rank, world_size=2)
    # torchrun's agent process records nothing (it would have written a second rank=0 meta).
    assert sorted(p.name for p in (runs / "torchrun" / "meta").iterdir()) == ["rank=0", "rank=1"]


@pytest.mark.slow
def test_plain_python_single_process(runs: Path) -> None:
    assert_complete_recording(runs / "single", 0, world_size=1)


@pytest.mark.slow
def test_a_failing_auto_attach_warns_once_and_training_goes_on(runs: Path) -> None:
    log = (runs / "bad-steps.log").read_text()
    assert log.count("fsdptrace: zero-code recording disabled") == 1, log
    assert "bad steps spec 'bogus'" in log and "rank 0: loss" in log
    assert not (runs / "bad-steps").exists()


@pytest.mark.slow
def test_explicit_attach_uses_the_run_dir_once_and_gets_boundaries(runs: Path) -> None:
    # attach(model) without run_dir or optimizer: it writes into $FSDPTRACE_RUN_DIR, no
    # automatic recorder writes beside it, and the global optimizer hook closes each step once.
    assert_complete_recording(runs / "no-optimizer", 0, world_size=1)


@pytest.mark.slow
def test_late_explicit_attach_replaces_the_automatic_recorder(runs: Path) -> None:
    markers = read_writers(runs / "late", "markers", 0)
    events = read_writers(runs / "late", "events", 0)
    assert len(markers) == 2
    first, second = sorted(markers, key=lambda w: markers[w].column("t_ns")[0].as_py())
    # The automatic recorder saw the first step, then was closed by the explicit attach;
    # the explicit one (optimizer=) counts its own steps from 0, each closed once: by its own
    # optimizer hook, not also by the global one.
    assert marker_kinds(markers[first], "optimizer_step") == [(0, 1)]
    assert markers[first].column("kind").to_pylist()[-1] == "close"
    assert marker_kinds(markers[second], "optimizer_step") == [(0, 1), (1, 1)]
    assert event_rows(events[first]) == expected_events(range(1))
    assert event_rows(events[second]) == expected_events(range(NUM_STEPS - 1))


# --------------------------------------------------------------------- in-process behaviour
def test_hooks_registered_by_a_global_pre_hook_miss_that_call() -> None:
    """auto.py records the triggering root forward itself because of this torch behaviour."""
    calls: list[str] = []
    model = nn.Linear(2, 2)

    def global_pre_hook(module: nn.Module, args: object) -> None:
        if not calls:
            calls.append("global")
            module.register_forward_pre_hook(lambda m, a: calls.append("pre"), prepend=True)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(global_pre_hook)
    try:
        model(torch.zeros(2))
        assert calls == ["global"]
        model(torch.zeros(2))
        assert calls == ["global", "pre"]
    finally:
        handle.remove()


# --------------------------------------------------------------------- bootstrap
def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_bootstrap_is_inert_without_a_run_dir(tmp_path: Path) -> None:
    env = record_env(tmp_path)
    del env["FSDPTRACE_RUN_DIR"]
    code = "import sys; print(sorted(m for m in ('torch', 'fsdptrace') if m in sys.modules))"
    assert _python(code, env) == "[]"


def test_bootstrap_waits_for_the_script_to_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "heavy = [m for m in ('torch', 'pyarrow', 'pandas', 'click') if m in sys.modules]\n"
        "import torch\n"
        "from fsdptrace.record import auto\n"
        "print(heavy, sorted(auto._handles), torch.__spec__.loader.__class__.__name__)\n"
    )
    assert _python(code, record_env(tmp_path)) == "[] ['forward', 'optimizer'] SourceFileLoader"


def test_bootstrap_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    env = record_env(tmp_path / "run", base_env={**os.environ, "PYTHONPATH": str(other)})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOTSTRAP_DIR), str(other)]
    code = "import os, fsdptrace.record.auto as a; print(os.environ['OTHER_SITE'])"
    assert _python(code, env) == "ran"


# --------------------------------------------------------------------- launcher
def test_record_env_says_exactly_what_was_asked(tmp_path: Path) -> None:
    inherited = {"FSDPTRACE_STEPS": "5:6", "FSDPTRACE_RAISE": "1", "PATH": "/bin"}
    env = record_env(Path("rel/run"), base_env=inherited)
    assert env["FSDPTRACE_RUN_DIR"] == str(Path("rel/run").resolve())
    assert "FSDPTRACE_STEPS" not in env and "FSDPTRACE_RAISE" not in env
    assert env["PYTHONPATH"] == str(BOOTSTRAP_DIR) and env["PATH"] == "/bin"
    assert env["FSDPTRACE_OVERRIDES"] == "run_dir"
    env = record_env(tmp_path, steps="::2", raise_on_violation=True, base_env=env)
    assert (env["FSDPTRACE_STEPS"], env["FSDPTRACE_RAISE"]) == ("::2", "1")
    assert env["FSDPTRACE_OVERRIDES"] == "run_dir,steps,raise_on_violation"
    assert env["PYTHONPATH"] == str(BOOTSTRAP_DIR)  # not added twice
    with pytest.raises(ValueError, match="bad steps spec"):
        record_env(tmp_path, steps="bogus")


def test_launcher_is_light_and_agrees_with_the_recorder() -> None:
    code = (
        "import sys, fsdptrace.record.launch as l, fsdptrace.store.run_dirs\n"
        "print([m for m in ('torch', 'pyarrow', 'pandas') if m in sys.modules], "
        "fsdptrace.store.run_dirs.DEFAULT_RUNS_ROOT)\n"
    )
    assert _python(code, dict(os.environ)) == f"[] {DEFAULT_RUNS_ROOT}"


def test_run_recorded_returns_the_exit_code(tmp_path: Path) -> None:
    env = record_env(tmp_path)
    assert run_recorded([sys.executable, "-c", "raise SystemExit(3)"], env) == 3
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run_recorded([sys.executable, "-c", kill_self], env) == 128 + signal.SIGKILL


def test_run_recorded_forwards_sigterm(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to the recording process reaches the job, whose own handler's exit
    code comes back. The recording process is one of its own (``run_recorded`` in a plain
    Python): SIGTERM sent to pytest itself would end it wherever the handler is not installed
    (a test worker off the main thread)."""
    ready = tmp_path / "ready"
    child = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(30)\n"
    )
    recording = (
        "import sys\n"
        "from pathlib import Path\n"
        "from fsdptrace.record.launch import record_env, run_recorded\n"
        f"sys.exit(run_recorded([sys.executable, '-c', {child!r}], "
        f"record_env(Path({str(tmp_path)!r}))))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", recording], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 7
    finally:
        kill_all([proc])


# --------------------------------------------------------------------- command line wins
@pytest.mark.slow
def test_record_options_win_over_the_scripts_attach_arguments(tmp_path: Path) -> None:
    """scenarios.py passes run_dir= and raise_on_violation=False to attach(): `record
    --run-dir R --raise` still records into R and stops the job, and says so once."""
    run_dir, script_out = tmp_path / "run", tmp_path / "script-out"
    command = [str(Path(sys.executable).parent / "fsdptrace"), "record", "--run-dir",
               str(run_dir), "--raise", "--", str(TORCHRUN), "--standalone", "--nproc-per-node",
               "2", str(REPO / "examples" / "scenarios.py"), "--out", str(script_out),
               "--steps", "1", "wrong-forward-prefetch"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if "overrides attach(" in line]
    assert said == [
        "fsdptrace: `fsdptrace record --run-dir` overrides "
        f"attach(run_dir='{script_out / 'wrong-forward-prefetch'}') in the script",
        "fsdptrace: `fsdptrace record --raise` overrides attach(raise_on_violation=False) in "
        "the script",
    ]
    assert "LifecycleError" in done.stderr and "before optimizer step 0" in done.stderr
    assert not script_out.exists()
    assert sorted(p.name for p in (run_dir / "meta").iterdir()) == ["rank=0", "rank=1"]
    assert "nothing was recorded" not in done.stderr
