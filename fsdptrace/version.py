"""The fsdptrace version, stamped into every file a recorder writes."""

__version__ = "0.1.0"
