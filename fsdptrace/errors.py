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


class UnreadableChunkError(RunDirError):
    """One Parquet chunk of a run dir is truncated or corrupt (the rest may still be read)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class FsdptraceWarning(UserWarning):
    """Base of every warning fsdptrace gives: the command line prints each as one line."""


class SkippedChunkWarning(FsdptraceWarning):
    """A truncated or corrupt chunk was skipped; the steps it covered count as incomplete."""


class SkippedDumpWarning(FsdptraceWarning):
    """A file under ``dumps/`` (a stack capture, a Flight Recorder dump) is not what its name
    says (damaged, or a link planted under that name) and was skipped; the others are read."""
