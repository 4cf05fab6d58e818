"""The on-disk format of a run dir: one declared, versioned schema per table.

Every table lives at ``RUN_DIR/<table>/rank=<r>/part-*.parquet`` (hive partitioning),
so pandas, DuckDB, Polars and Spark read a whole run as it is. The rank is carried by the
partition path, not by a column in the files, so that hive-aware readers do not see it twice;
``fsdptrace.load`` adds it back as a column.

Bump ``SCHEMA_VERSION`` whenever a column changes meaning or type; the loader refuses files
written with a version it does not know instead of guessing.

Schema 2 (the memory-mapped journal) names parts by the journal segments they hold,
``part-<writer>-<first>-<last>.parquet``, keeps the tail a rank did not convert under
``RUN_DIR/journal/rank=<r>/`` (see ``journal_format``) and has every table from the start; the
columns are those of schema 1, which is still read (its run dirs may hold ``dropped_rows``
markers).

Tables added in schema 2 without a version bump (a run dir recorded before them reads them as
empty, like any table of a short run): ``backward_grads``, ``grads_written``, ``eval_forwards``
and ``settings``, what checks 2, 10, 11 and 12 of ``docs/checks.md`` read
(``docs/recorded_for_checks.md``).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
SCHEMA_VERSION_KEY = b"fsdptrace.schema_version"
FSDPTRACE_VERSION_KEY = b"fsdptrace.version"
RANK_KEY = b"fsdptrace.rank"

TABLE_DIR = "{table}"
RANK_DIR = "rank={rank}"
# A part named by a chunk number: schema-1 writers, and generators of synthetic run dirs.
# The recorder names its parts by journal segment range (``journal_format.RANGE_PART_FILE``).
PART_FILE = "part-{writer}-{chunk:06d}.parquet"
TEMP_SUFFIX = ".tmp"

FORWARD = "forward"
BACKWARD = "backward"
PHASES = (FORWARD, BACKWARD)

# Marker kinds written to the ``markers`` table.
MARKER_MICRO_STEP = "micro_step_begin"
MARKER_OPTIMIZER_STEP = "optimizer_step"
# How a rank's recording ended (read back in one place: ``fsdptrace.reading.endings``).
MARKER_CLOSE = "close"  # clean: training finished, no micro-step open
MARKER_CRASH = "crashed"  # detail: "Type: message"
MARKER_TERMINATED = "terminated"  # detail: the signal's name
MARKER_CLOSED_MID_STEP = "closed_mid_step"  # closed with a micro-step open
# Never written by a recorder: the reader folds a rank's fatal-signal dump in as this marker
# (detail: ``fatal_signals.marker_detail``), since no code runs in the dying process to write it.
MARKER_FATAL_SIGNAL = "fatal_signal"
ENDING_MARKERS = (MARKER_CLOSE, MARKER_CRASH, MARKER_TERMINATED, MARKER_CLOSED_MID_STEP,
                  MARKER_FATAL_SIGNAL)
# ``reset_iter_state()`` abandoned the open micro-step: it is cut off, not run that way.
MARKER_ABORTED = "aborted"
# One per contiguous run of rows the writer dropped (detail: JSON; schema-1 run dirs only).
MARKER_DROPPED_ROWS = "dropped_rows"
MARKER_DISABLED = "recording_disabled"
# The writer process ended without finishing (detail: how, and whether it was restarted), or
# fell silent (stopped, a frozen filesystem): rows may be missing from the run dir alone.
MARKER_WRITER_LOST = "writer_lost"
MARKER_WRITER_STALLED = "writer_stalled"
MARKER_GRAD_SYNC = "gradient_sync"

_dict_str = pa.dictionary(pa.int32(), pa.string())

META = pa.schema(
    [
        ("world_size", pa.int32()),
        ("host", pa.string()),
        ("pid", pa.int64()),
        ("backend", pa.string()),
        ("torch_version", pa.string()),
        ("fsdptrace_version", pa.string()),
        ("schema_version", pa.int32()),
        ("wall_anchor_ns", pa.int64()),
        ("mono_anchor_ns", pa.int64()),
        ("num_parts", pa.int32()),
        ("steps_spec", pa.string()),
        ("raise_on_violation", pa.bool_()),
    ]
)

UNITS = pa.schema(
    [
        ("unit", pa.string()),
        ("part", pa.int32()),
        ("fqn", pa.string()),
        ("module_type", pa.string()),
        ("is_root", pa.bool_()),
        ("num_params", pa.int32()),
        ("num_param_elements", pa.int64()),
        ("param_names", pa.list_(pa.string())),
    ]
)

EVENTS = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("phase", _dict_str),
        ("unit", _dict_str),
    ]
)

MARKERS = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("kind", _dict_str),
        ("count", pa.int64()),
        ("detail", pa.string()),
    ]
)

# One snapshot of every unit's configured targets, written whenever the configuration changes.
# A unit with no targets in a phase has one row with a null target, so a snapshot is complete.
PREFETCH = pa.schema(
    [
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("phase", _dict_str),
        ("target", _dict_str),
        ("target_index", pa.int32()),
    ]
)

GRADIENTS = pa.schema(
    [
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("param", pa.string()),
        ("has_grad", pa.bool_()),
        ("grad_source", _dict_str),
    ]
)

PENDING = pa.schema(
    [
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("kind", _dict_str),
        ("bucket", pa.string()),
        ("state", pa.string()),
    ]
)

# All-gather provenance (FSDP2): one row per unshard attempt, consumption or drop of a
# parameter group's all-gather, with who asked for it. ``issuer_unit`` is null for manual
# ``unshard()``; ``detail`` says why a ``noop`` did nothing (``pending``, ``unsharded``, ...).
ALLGATHERS = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("phase", _dict_str),
        ("unit", _dict_str),
        ("group", pa.int32()),
        ("event", _dict_str),
        ("issuer_kind", _dict_str),
        ("issuer_unit", _dict_str),
        ("num_bytes", pa.int64()),
        ("detail", _dict_str),
    ]
)

# Per unit post-backward (FSDP2 ``FSDPParamGroup.post_backward``), one row per managed parameter,
# written before the unit's reduce-scatter is issued: what that collective is about to reduce.
# ``state``: ``received`` (a gradient written in this backward), ``carried`` (held from an
# earlier no-sync micro-step of the step, nothing new), ``zero_filled`` (none, but the unit was
# told ``set_reduce_scatter_unused_params`` and FSDP reduces zeros), ``none``. ``via``:
# ``backward`` (the unit ran backward), ``idle`` (end-of-backward safety net for a unit that did
# not), ``unknown`` (the backend cannot tell).
BACKWARD_GRADS = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("param", _dict_str),
        ("state", _dict_str),
        ("via", _dict_str),
    ]
)
GRAD_STATES = ("received", "carried", "zero_filled", "none")
GRAD_VIAS = ("backward", "idle", "unknown")

# At each optimizer boundary, per managed parameter holding a gradient: was that gradient
# written during this step (compared with the step's first micro-step begin)? A zero-filled
# buffer kept by ``zero_grad(set_to_none=False)`` and untouched since is not.
GRADS_WRITTEN = pa.schema(
    [
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("param", pa.string()),
        ("written", pa.bool_()),
    ]
)

# A unit forward run with gradients disabled (validation, generation), in call order (``seq``),
# recorded at the forward pre-hook (before the all-gather). ``step``: the eval interval, i.e.
# how many optimizer boundaries the rank had passed. Never part of ``events``.
EVAL_FORWARDS = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("unit", _dict_str),
        ("grad_mode", _dict_str),
    ]
)
GRAD_MODES = ("no_grad", "inference_mode")

# The FSDP state that decides which collectives run, per unit, one row per setting whenever
# its value changed (read at each micro-step's first root forward and at each unit
# post-backward): the value in effect at a micro-step is the last row at or before it, and of
# several rows for one micro-step the last is what its backward used. ``value`` is JSON
# (``true``, ``4``, ``[2]``); null when the backend cannot read it.
SETTINGS = pa.schema(
    [
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("unit", _dict_str),
        ("setting", _dict_str),
        ("value", pa.string()),
    ]
)
SETTING_NAMES = ("requires_gradient_sync", "requires_all_reduce", "is_last_backward",
                 "reshard_after_forward", "reshard_after_backward",
                 "reduce_scatter_unused_params", "mesh_shape")

# Every collective FSDP issues for a unit (all-gather, reduce-scatter, HSDP all-reduce), recorded
# right before it is issued: its process group (``ProcessGroup.group_name``, as torch's Flight
# Recorder names it) and that group's sequence number for it (``collective_seq``: what
# ``_get_sequence_number_for_group()`` will read after it, the Flight Recorder's
# ``collective_seq_id``). ``phase`` is ``eval`` for an eval forward's all-gathers (micro_step -1);
# ``issuer_kind`` is who issued it (``allgathers``' kinds, or a backward's ``post_backward`` /
# the root's ``end_of_backward`` for a unit whose backward did not run).
COLLECTIVES = pa.schema(
    [
        ("seq", pa.int64()),
        ("t_ns", pa.int64()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("phase", _dict_str),
        ("unit", _dict_str),
        ("kind", _dict_str),
        ("group", _dict_str),
        ("collective_seq", pa.int64()),
        ("issuer_kind", _dict_str),
        ("issuer_unit", _dict_str),
    ]
)
EVAL = "eval"
COLLECTIVE_PHASES = (FORWARD, BACKWARD, EVAL)
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
COLLECTIVE_ISSUERS = ("own", "prefetch", "implicit", "manual", "other", "recompute",
                      "post_backward", "end_of_backward")

FINDINGS = pa.schema(
    [
        ("check", pa.string()),
        ("severity", pa.string()),
        ("step", pa.int32()),
        ("micro_step", pa.int32()),
        ("phase", pa.string()),
        ("unit", pa.string()),
        ("target", pa.string()),
        ("message", pa.string()),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "meta": META,
    "units": UNITS,
    "events": EVENTS,
    "markers": MARKERS,
    "prefetch": PREFETCH,
    "gradients": GRADIENTS,
    "pending": PENDING,
    "allgathers": ALLGATHERS,
    "findings": FINDINGS,
    "backward_grads": BACKWARD_GRADS,
    "grads_written": GRADS_WRITTEN,
    "eval_forwards": EVAL_FORWARDS,
    "settings": SETTINGS,
    "collectives": COLLECTIVES,
}

# Tables a recorder always writes; a run dir without them is not a run dir.
REQUIRED_TABLES = ("meta", "units")


def with_metadata(schema: pa.Schema, *, rank: int, version: str) -> pa.Schema:
    """Stamp a table schema with the schema version, writer version and rank."""
    return schema.with_metadata(
        {
            SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(),
            FSDPTRACE_VERSION_KEY: version.encode(),
            RANK_KEY: str(rank).encode(),
        }
    )
