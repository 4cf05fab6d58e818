"""Exceptions fsdptrace raises: one base class, so callers can catch everything at once."""

from __future__ import annotations


class FsdptraceError(Exception):
    """Base of every error fsdptrace raises on purpose."""


class RunDirError(FsdptraceError, ValueError):
    """A run dir is missing, empty, corrupt or written in a format this version cannot read."""


class UsageError(FsdptraceError, ValueError):
    """An argument a caller gave is not one fsdptrace knows (a check name, a steps spec)."""


class LifecycleError(FsdptraceError, RuntimeError):
    """Live checks found an unsafe FSDP lifecycle; the optimizer step was not executed."""

    def __init__(self, message: str, findings: object = None) -> None:
        super().__init__(message)
        self.findings = findings
