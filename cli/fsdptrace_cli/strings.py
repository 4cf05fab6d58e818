"""The commands that analyze keep pandas' text in Python objects, not in Arrow arrays.

pandas 3 stores every column of text it makes (and every column label) as an Arrow string
array by default. The analyzer makes thousands of small frames and series an analysis, and
each operation on Arrow-backed text pays a conversion or an Arrow compute call: about a fifth
of a small run's analysis (0.77-0.83x the CPU with Python storage, the hostile corpus's
commands; benchmarks/README.md, "pandas' text storage in the command line"). The values,
their order and every output are the same either way (compared byte for byte on every
command and ~100 run dirs).

Only the command line sets it, and only for the command's duration
(``pandas.option_context``): the option is process-wide, and the library must not change
what its users' own frames hold. A command run in a test process or a notebook (click's
``CliRunner``) leaves the option as it found it, and what the analyzer keeps across calls is
kept per storage (``checks.kernel.columns.text_storage``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# pandas' ``mode.string_storage`` for the commands (pandas' default, ``auto``, is Arrow where
# pyarrow is installed, as it always is here).
STORAGE = "python"


@contextlib.contextmanager
def python_strings() -> Iterator[None]:
    """pandas' ``mode.string_storage`` set to ``STORAGE`` while the block runs."""
    import pandas as pd  # not at import: ``record`` and ``--help`` do without pandas

    with pd.option_context("mode.string_storage", STORAGE):
        yield
