"""Text from a run dir, made safe to print: the one place control characters are escaped.

Unit names, host names and crash messages come from someone else's job. Printed raw, an ESC
byte clears the screen, retitles the window or writes the clipboard (OSC 52), a newline forges
a report line, and a bidi override reorders what a person reads. Every text renderer passes
such strings through ``printable``; JSON, HTML and Python source have escapes of their own.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, line/paragraph separators and the bidi embedding/isolate controls.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group(0)
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` on one line with every control character shown as its escape."""
    return _UNSAFE.sub(_escape, str(text))
