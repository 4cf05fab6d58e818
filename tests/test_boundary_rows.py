"""The boundary's kept row encodings write what ``FramedTable.extend`` wrote (issue 26).

``boundary_rows`` joins the ``gradients`` and ``grads_written`` rows from JSON tails it keeps
between boundaries; the journal record must be the bytes ``json.dumps`` gives the row tuples,
so that the journal's readers see the same rows. Names carry the characters JSON escapes.
"""

from __future__ import annotations

import json

from fsdptrace.record import boundary_rows
from fsdptrace.record.backends.base import GradientPresence

UNITS = ["<root>", 'la"yers\\.0\x00', "caf\u00e9"]


def _dumps(rows: list[tuple]) -> bytes:
    return json.dumps(rows, separators=(",", ":")).encode()


def _answers(first_source: str) -> list[list[GradientPresence]]:
    return [[GradientPresence("w", True, first_source), GradientPresence("b\x00", False, "none")],
            [GradientPresence('we"ight', True, "unsharded")], []]


def test_kept_rows_are_the_bytes_of_the_row_tuples() -> None:
    rows = boundary_rows.BoundaryRows(UNITS)
    for step, answers in enumerate([_answers("sharded"), _answers("accumulated")]):
        gradients, held, all_held = rows.tails(answers)
        assert boundary_rows.rows_of(step, 1, gradients) == _dumps(
            [(step, 1, unit, *g) for unit, gs in zip(UNITS, answers, strict=True) for g in gs])
        written = [(step, 1, unit, g.param, True) for unit, gs in zip(UNITS, answers, strict=True)
                   for g in gs if g.has_grad]
        assert boundary_rows.rows_of(step, 1, all_held) == _dumps(written)
        assert boundary_rows.join_rows(step, 1, [t for tails in held for t in tails]) == _dumps(
            written)


def test_written_rows_of_a_baseline_with_gradients() -> None:
    answers = _answers("sharded")
    tails = boundary_rows.written_tails(UNITS[0], answers[0], [False, True])
    assert boundary_rows.join_rows(4, 0, tails) == _dumps([(4, 0, UNITS[0], "w", False)])
    assert boundary_rows.join_rows(4, 0, []) == boundary_rows.rows_of(4, 0, b"") == b"[]"


def test_answers_unchanged_are_not_encoded_again() -> None:
    rows = boundary_rows.BoundaryRows(UNITS)
    answers = _answers("sharded")
    first = rows.tails(answers)
    assert rows.tails(answers)[0] is first[0]
    assert rows.tails(_answers("unsharded"))[0] != first[0]
