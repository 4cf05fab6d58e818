"""One module per subcommand; each parses, calls the library, and renders."""

from __future__ import annotations

import importlib

import click

_MODULES = ("record", "watch", "analyze", "summary", "export", "suggest", "report", "diff")


def _load() -> list[click.Command]:
    commands = []
    for name in _MODULES:
        module = importlib.import_module(f"fsdptrace_cli.commands.{name}")
        commands.append(module.command)
    return commands


COMMANDS = _load()
