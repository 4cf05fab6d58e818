"""The journal reader's JSON depth guard: its fast path (quote parity, for text without a
backslash) agrees with matching the strings by their pattern, on any bytes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptrace.store.journal_read import MAX_JSON_DEPTH, loads_flat, nesting_depth

STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def depth_by_pattern(text: bytes) -> int:
    """The definition: strings removed by their pattern, then the brackets' running depth."""
    depth = deepest = 0
    for byte in STRING.sub(b"", text):
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b",", b"a", b"1", b":",
                                 b"\\", b'\\"', b" "]), max_size=60))
def test_depth_agrees_with_the_pattern_on_any_bytes(pieces: list[bytes]) -> None:
    text = b"".join(pieces)
    assert nesting_depth(text) == depth_by_pattern(text)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.one_of(st.integers(), st.text(alphabet='ab[]{}"\\ ', max_size=6)),
                    lambda inner: st.lists(inner, max_size=3), max_leaves=12))
def test_real_json_is_parsed_or_refused_by_its_depth(value: object) -> None:
    text = json.dumps(value).encode()

    def depth(v: object) -> int:
        return 1 + max(map(depth, v), default=0) if isinstance(v, list) else 0

    if depth(value) > MAX_JSON_DEPTH:
        with pytest.raises(ValueError, match="nested deeper"):
            loads_flat(text)
    else:
        assert loads_flat(text) == value


def test_a_megabyte_of_brackets_is_refused_before_parsing() -> None:
    with pytest.raises(ValueError, match="nested deeper"):
        loads_flat(b"[" * 1_000_000 + b"]" * 1_000_000)
    names = json.dumps([[1, "layers[0]]]]]", "x{{{{"]]).encode()  # brackets in strings
    assert loads_flat(names) == [[1, "layers[0]]]]]", "x{{{{"]]
    assert nesting_depth(b"") == 0 and np.issubdtype(type(nesting_depth(b"[]")), np.integer)
